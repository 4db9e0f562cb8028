"""docs/request-path.md is true of the code: the spine files it names run down, never back up.
(The modules a traced request executes against the doc's list: test_request_trace.py.)
No spine file imports one above it on the path, and nothing a spine file imports (a leaf, a
spine file below it, or anything under those) imports that spine file or one above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "request-path.md"


def spine() -> list[str]:
    """The spine's modules, in the doc's order ("N. **`serve_app/...py`**")."""
    files = re.findall(r"^\d+\. \*\*`(serve_app/[\w/]+\.py)`\*\*", DOC.read_text(), re.M)
    return [f[:-3].replace("/", ".") for f in files]


def imports(module: str) -> set[str]:
    """The serve_app modules `module` imports anywhere in its code (functions included)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith("serve_app") and exists(n))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("serve_app"))
    return out


def exists(module: str) -> bool:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def below(module: str) -> set[str]:
    """Everything `module` imports, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_doc_names_the_six_spine_files() -> None:
    files = spine()
    assert len(files) == 6 and all(exists(f) for f in files), files
    assert files[0] == "serve_app.serving.ingress"
    assert files[-1] == "serve_app.engines.reference.model_runner"


def test_no_spine_file_imports_one_above_it() -> None:
    files = spine()
    for i, module in enumerate(files):
        above = set(files[:i])
        assert not imports(module) & above, (module, imports(module) & above)


def test_nothing_below_a_spine_file_imports_it_or_one_above_it() -> None:
    files = spine()
    for i, module in enumerate(files):
        upper = set(files[: i + 1])
        for m in below(module):
            assert not imports(m) & upper, (module, m, imports(m) & upper)
