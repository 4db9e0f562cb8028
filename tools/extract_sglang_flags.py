"""Extract SGLang's server-argument definitions from its source, without importing it.

    python tools/extract_sglang_flags.py /path/to/site-packages/sglang \
        > capacity/data/sglang_flags_0_5_23.json

SGLang cannot be imported on CPU-only machines (it pulls CUDA wheels), yet the SGLang backend's
server arguments must match its `ServerArgs` exactly. In 0.5.23 `ServerArgs` is assembled by
`msgspec.defstruct` from the input namespaces listed in `srt/server_args.py`
(`_INPUT_NAMESPACES`), each a class in `srt/arg_groups/fields/*.py` whose annotated attributes
are `A[type, "help"]` or `A[type, Arg(help=..., choices=..., aliases=..., no_cli=...)]`. This
script walks those files with `ast` and writes, per field: namespace, type (source text),
default (a literal where the source has one), CLI flag and aliases, choices (resolved from
`srt/arg_groups/choices.py` where the source names a list there) and the help text. The JSON
is committed, so tests check the generated arguments against SGLang's real definitions.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any


def _module_lists(path: Path) -> dict[str, list[Any]]:
    """Module-level `NAME = [literal, ...]` assignments (the choice lists)."""
    out: dict[str, list[Any]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, list | set | frozenset | tuple):
                out[node.targets[0].id] = sorted(value) if isinstance(
                    value, set | frozenset) else list(value)
    return out


def _resolve(node: ast.expr, lists: dict[str, list[Any]]) -> list[Any] | None:
    """A choices expression: a literal list, a known list name, or `A + [..]`."""
    try:
        value = ast.literal_eval(node)
        return list(value)
    except ValueError:
        pass
    if isinstance(node, ast.Name):
        return lists.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _resolve(node.left, lists), _resolve(node.right, lists)
        if left is not None and right is not None:
            return left + right
    return None


def _literal(node: ast.expr | None) -> tuple[bool, Any]:
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        return False, ast.unparse(node)


def _string(node: ast.expr) -> str | None:
    """Help text: a string literal, implicit concatenation, or an f-string (kept as source)."""
    ok, value = _literal(node)
    if ok and isinstance(value, str):
        return value
    return ast.unparse(node)


def _field(stmt: ast.AnnAssign, namespace: str, lists: dict[str, list[Any]]) -> dict[str, Any]:
    ann = stmt.annotation
    info: dict[str, Any] = {"namespace": namespace}
    type_node, meta = ann, None
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in (
            "A", "Annotated") and isinstance(ann.slice, ast.Tuple):
        type_node = ann.slice.elts[0]
        meta = ann.slice.elts[1] if len(ann.slice.elts) > 1 else None
    info["type"] = ast.unparse(type_node)
    has_default = stmt.value is not None
    info["required"] = not has_default
    ok, default = _literal(stmt.value)
    info["default"] = default if ok else None
    if has_default and not ok:
        info["default_source"] = default
    name = stmt.target.id  # type: ignore[union-attr]
    flag, aliases, choices, help_text, no_cli = f"--{name.replace('_', '-')}", [], None, "", False
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        for kw in meta.keywords:
            if kw.arg == "help":
                help_text = _string(kw.value) or ""
            elif kw.arg == "choices":
                choices = _resolve(kw.value, lists)
                if choices is None:
                    info["choices_source"] = ast.unparse(kw.value)
            elif kw.arg == "aliases":
                aliases = list(ast.literal_eval(kw.value))
            elif kw.arg == "cli_name":
                flag = ast.literal_eval(kw.value)
            elif kw.arg == "no_cli":
                no_cli = bool(ast.literal_eval(kw.value))
    elif meta is not None:
        help_text = _string(meta) or ""
    info["flag"] = None if no_cli else flag
    info["aliases"] = aliases
    info["choices"] = choices
    info["help"] = help_text
    return info


def _input_namespaces(server_args: Path) -> list[str]:
    for node in ast.parse(server_args.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets):
            return [e.id for e in node.value.elts]  # type: ignore[attr-defined]
    raise SystemExit("_INPUT_NAMESPACES not found in server_args.py")


def extract(package: Path) -> dict[str, Any]:
    srt = package / "srt"
    lists = _module_lists(srt / "arg_groups" / "choices.py")
    wanted = set(_input_namespaces(srt / "server_args.py"))
    fields: dict[str, Any] = {}
    for path in sorted((srt / "arg_groups" / "fields").glob("*.py")):
        lists_here = {**lists, **_module_lists(path)}
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef) or node.name not in wanted:
                continue
            namespace = node.name
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "_NS_PATH" for t in stmt.targets):
                    namespace = ast.literal_eval(stmt.value)
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if stmt.target.id.startswith("_") and stmt.target.id == "_NS_PATH":
                        continue
                    fields[stmt.target.id] = _field(stmt, namespace, lists_here)
    version = "unknown"
    version_file = package / "_version.py"
    if version_file.exists():
        for node in ast.parse(version_file.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                value = node.value.value if isinstance(node.value, ast.Assign) else node.value
                ok, v = _literal(value)  # type: ignore[arg-type]
                version = v if ok else version
    return {
        "sglang_version": version,
        "source": "sglang/srt/arg_groups/fields/*.py (classes in server_args._INPUT_NAMESPACES)",
        "generated_by": "tools/extract_sglang_flags.py",
        "fields": dict(sorted(fields.items())),
        # Lists SGLang checks at resolution rather than in argparse (a DSPARK draft backend
        # outside this list silently falls back: draft_worker_common.py).
        "draft_attention_backend_choices": lists["DRAFT_ATTENTION_BACKEND_CHOICES"],
    }


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    json.dump(extract(Path(argv[1])), sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv)
