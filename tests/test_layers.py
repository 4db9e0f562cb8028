"""serve_app's packages import only the layers below them: the shared vocabulary (protocol/) at
the bottom, the app and its commands at the top. A package that imports one beside or above it
(the loops issue 49 removed: chat <-> serving, tokenizer <-> chat, engines <-> observability,
engines <-> routing) fails here, naming the module and the import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "serve_app"

# Bottom first. A unit is a sub-package or a top-level module of serve_app.
LAYERS: list[set[str]] = [
    {"protocol"},
    {"netutil", "observability", "models", "vision", "tokenizer_tiktoken", "synthetic_images"},
    {"tokenizer"},
    {"grammar", "chat", "routing"},
    {"config"},
    {"engines"},
    {"serving"},
    {"app", "embedded"},
    {"demo", "training"},
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "serve_app" and len(parts) > 1 else None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, serve_app module) of every import in `path`, in functions too."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-node.level])
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module:
                out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if _unit(m) is not None]


def test_every_unit_has_a_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert units == set(LAYER), f"place these in LAYERS: {sorted(units ^ set(LAYER))}"


def test_no_unit_imports_one_beside_or_above_it() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _unit(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if me is None or me == "__init__":
            continue
        for line, module in imports(path):
            them = _unit(module)
            if them != me and them in LAYER and LAYER[them] >= LAYER[me]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_the_ingress_reaches_the_router_only_through_its_dispatcher() -> None:
    ingress = PACKAGE / "serving" / "ingress.py"
    assert "serve_app.serving.dispatch" in {m for _, m in imports(ingress)}
    assert not [m for _, m in imports(ingress) if _unit(m) == "routing"]


def test_the_server_calls_the_engine_only_through_its_interface() -> None:
    """No `type: ignore` in serving/, no attribute looked up on an engine by name: every call
    the server makes is declared in engines/interface.py."""
    for path in (PACKAGE / "serving").glob("*.py"):
        source = path.read_text()
        assert "type: ignore" not in source, path.name
        assert not re.search(r"(getattr|hasattr)\(\s*self\.engine", source), path.name
