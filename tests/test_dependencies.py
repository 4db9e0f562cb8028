"""Every third-party module the shipped packages import is a declared runtime dependency.

`pip install -e .` (the README's first command) installs `[project].dependencies` only, so a
module the shipped code imports but only the `dev` extra brings (as `openai` once was, for the
demo) breaks a fresh machine while every test here, run with `.[dev]`, still passes. The
sources are parsed with `ast`, never imported: imports inside functions count too, since they
run as soon as that code path does (the demo's `import openai` is one).

Rules, for every `.py` file under `serve_app/` and `capacity/`:
  - stdlib modules and the project's own packages are skipped; relative imports are own;
  - a module of the optional `sglang` extra (`SGLANG_EXTRA_MODULES`) may be imported only in
    `serve_app/engines/sglang/engine.py` and there only inside a function body, the way
    `SGLangEngine.start` does: that module is imported on CPU machines without SGLang (config
    mapping, start-up checks), so a module-level import, even under `if TYPE_CHECKING:` which
    static tools would then require, is refused;
  - every other module maps (via `importlib.metadata.packages_distributions()`) to a
    distribution that `[project].dependencies` names; one that only the `dev` extra names is
    reported as dev-only.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("serve_app", "capacity")  # = [tool.setuptools.packages.find] include
SGLANG_BACKEND = "serve_app/engines/sglang/engine.py"
# Modules the `sglang` extra brings that the code may import (lazily, on GPU nodes). They are
# not installed here, so packages_distributions() cannot map them: this table does, and marks
# them as the extra's. Add a row when the backend starts importing another of them.
SGLANG_EXTRA_MODULES = {
    "sglang": "sglang",
    "sgl_kernel": "sgl-kernel",
    "flashinfer": "flashinfer-python",
}


def normalize(name: str) -> str:
    """PEP 503: runs of -, _ and . are one -, case-insensitive."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a PEP 508 requirement names: `ray[serve]==2.60.*` -> `ray`."""
    match = re.match(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)", requirement)
    assert match, f"unparseable requirement {requirement!r}"
    return normalize(match.group(1))


@dataclass(frozen=True)
class Declared:
    runtime: frozenset[str]
    dev_only: frozenset[str]  # in the dev extra and not a runtime dependency


def declared(pyproject: Mapping[str, object]) -> Declared:
    project = pyproject["project"]
    assert isinstance(project, dict)
    runtime = frozenset(requirement_name(r) for r in project["dependencies"])
    dev = frozenset(requirement_name(r) for r in project["optional-dependencies"]["dev"])
    return Declared(runtime, dev - runtime)


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repo root, posix
    line: int
    module: str  # the dotted module as written (for `from a import b`: `a`)
    names: tuple[str, ...]  # for `from a import b, c`: (b, c); () for `import a`
    in_function: bool

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        written = (f"from {self.module} import {', '.join(self.names)}" if self.names
                   else f"import {self.module}")
        return f"{self.path}:{self.line}: {written}"


class _ImportCollector(ast.NodeVisitor):
    """Absolute imports, each marked with whether it sits inside a function body (class bodies
    run at import time, so they count as module level)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.depth = 0
        self.imports: list[Import] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Decorators and defaults run at definition time, i.e. module level.
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self.depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self.depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append(Import(self.path, node.lineno, alias.name, (), self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:  # relative imports are the project's own
            self.imports.append(Import(self.path, node.lineno, node.module,
                                       tuple(a.name for a in node.names), self.depth > 0))


def collect_imports(path: str, source: str) -> list[Import]:
    collector = _ImportCollector(path)
    collector.visit(ast.parse(source, filename=path))
    return collector.imports


@functools.cache
def _files_of(distribution: str) -> frozenset[str]:
    files = importlib.metadata.distribution(distribution).files or ()
    return frozenset(f.as_posix() for f in files)


def _ships(distribution: str, dotted: str) -> bool:
    base = dotted.replace(".", "/")
    files = _files_of(distribution)
    return f"{base}.py" in files or any(f.startswith(base + "/") for f in files)


def distributions_for(imp: Import, top_level: Mapping[str, list[str]]) -> set[str]:
    """The distributions that provide the imported module (empty: unknown). A namespace package
    (`opentelemetry`: a dozen distributions) is resolved to the one that ships the imported
    submodule, most specific first (`from opentelemetry import trace` -> opentelemetry-api)."""
    if imp.top in SGLANG_EXTRA_MODULES:
        return {normalize(SGLANG_EXTRA_MODULES[imp.top])}
    candidates = top_level.get(imp.top, [])
    if len(set(candidates)) <= 1:
        return {normalize(d) for d in candidates}
    dotted = [f"{imp.module}.{n}" for n in imp.names if n != "*"]
    parts = imp.module.split(".")
    dotted += [".".join(parts[:i]) for i in range(len(parts), 1, -1)]
    for name in dotted:
        shipping = {normalize(d) for d in candidates if _ships(d, name)}
        if shipping:
            return shipping
    return {normalize(d) for d in candidates}


def problems(sources: Mapping[str, str], deps: Declared,
             top_level: Mapping[str, list[str]] | None = None) -> list[str]:
    """One line per import that a plain `pip install .` would not satisfy, or that breaks the
    sglang rule. `sources` maps repo-relative paths to file contents."""
    if top_level is None:
        top_level = importlib.metadata.packages_distributions()
    out = []
    for path, source in sorted(sources.items()):
        for imp in collect_imports(path, source):
            where = str(imp)
            if imp.top in sys.stdlib_module_names or imp.top in SHIPPED:
                continue
            if imp.top in SGLANG_EXTRA_MODULES:
                if imp.path != SGLANG_BACKEND:
                    out.append(f"{where}: a module of the optional sglang extra, importable "
                               f"only in {SGLANG_BACKEND}")
                elif not imp.in_function:
                    out.append(f"{where}: a module of the optional sglang extra at module "
                               "level; import it inside the function that needs it")
                continue
            dists = distributions_for(imp, top_level)
            if not dists:
                out.append(f"{where}: no installed distribution provides {imp.top!r} (if it "
                           "belongs to an optional extra, add it to the table in this test)")
            elif not dists & deps.runtime:
                kind = ("provided by the dev extra only" if dists <= deps.dev_only
                        else "not declared")
                out.append(f"{where}: {', '.join(sorted(dists))} is {kind}; add it to "
                           "[project].dependencies in pyproject.toml")
    return out


def shipped_sources(roots: Iterable[str] = SHIPPED) -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
            for root in roots for p in sorted((ROOT / root).rglob("*.py"))}


def _declared_here() -> Declared:
    return declared(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8")))


# --- the tests ----------------------------------------------------------------------------------


def test_shipped_packages_import_only_declared_runtime_dependencies() -> None:
    sources = shipped_sources()
    assert len(sources) > 20 and SGLANG_BACKEND in sources  # the scan did find the packages
    found = problems(sources, _declared_here())
    assert not found, "\n".join(found)


def test_the_sglang_backend_imports_sglang_lazily() -> None:
    # The rule above is only meaningful while the backend really does import SGLang: if that
    # moved elsewhere, this test must be revisited rather than pass vacuously.
    imports = collect_imports(SGLANG_BACKEND, (ROOT / SGLANG_BACKEND).read_text())
    sglang = [i for i in imports if i.top == "sglang"]
    assert sglang and all(i.in_function for i in sglang)


def test_the_checker_reports_what_it_should() -> None:
    deps = _declared_here()
    assert "openai" in deps.runtime and "ray" in deps.runtime  # ray[serve] counts as ray
    assert "scipy" in deps.dev_only and "pytest" in deps.dev_only

    def report(path: str, source: str) -> list[str]:
        return problems({path: source}, deps)

    # A dev-only package, at module level or lazily, in either shipped package.
    [line] = report("capacity/fake.py", "import scipy.stats\n")
    assert "capacity/fake.py:1: import scipy.stats" in line and "dev extra only" in line
    [line] = report("serve_app/fake.py", "def f():\n    from scipy import optimize\n")
    assert "serve_app/fake.py:2" in line and "scipy" in line
    # Not installed at all.
    [line] = report("serve_app/fake.py", "import no_such_module_xyz\n")
    assert "no installed distribution provides 'no_such_module_xyz'" in line
    # SGLang: only lazily, only in the backend.
    assert report(SGLANG_BACKEND, "def start():\n    from sglang.srt.ray.engine import E\n") == []
    assert "at module level" in report(SGLANG_BACKEND, "import sglang\n")[0]
    assert "at module level" in report(
        SGLANG_BACKEND, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    import sglang\n")[0]
    assert "only in serve_app/engines/sglang/engine.py" in report(
        "serve_app/serving/target.py", "def f():\n    import sgl_kernel\n")[0]
    # A class body runs at import time.
    assert "at module level" in report(SGLANG_BACKEND, "class A:\n    import sglang\n")[0]
    # Stdlib, the project's own packages and relative imports are not dependencies.
    assert report("serve_app/fake.py", "import os, json\nfrom . import x\nimport capacity\n"
                  "from serve_app.config import AppConfig\nfrom __future__ import annotations\n"
                  ) == []
    # A namespace package resolves to the distribution of the submodule imported.
    runtime_without_api = Declared(deps.runtime - {"opentelemetry-api"}, deps.dev_only)
    [line] = problems({"serve_app/fake.py": "from opentelemetry import trace\n"},
                      runtime_without_api)
    assert "opentelemetry-api is not declared" in line


def test_requirement_names_are_normalised() -> None:
    assert requirement_name("ray[serve]==2.60.*") == "ray"
    assert requirement_name("PyYAML>=6") == "pyyaml"
    assert requirement_name("opentelemetry_exporter.OTLP>=1") == "opentelemetry-exporter-otlp"
    assert requirement_name("torch>=2.4,<2.15") == "torch"


def test_the_ingress_and_the_config_tree_do_not_load_torch() -> None:
    """The ingress process (and anything that only reads a config, such as the planner's
    emitter checking a deployment) imports no torch: it costs the ingress about a second and a
    few hundred MB per replica for nothing it uses."""
    import subprocess

    code = ("import sys, serve_app.serving.ingress, serve_app.app, serve_app.config; "
            "sys.exit('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "torch was imported"
