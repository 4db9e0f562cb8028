"""The training corpus: the Python standard library's own source, read from this machine.

Nothing is downloaded: every machine with Python has these files. The split into training and
held-out files is decided by a hash of each file's path relative to the stdlib root (not of its
content), so the same files are held out on every Python 3.11 install even when patch releases
edit a few of them. Another minor version of Python gives a slightly different corpus; the
committed models were trained on CPython 3.11.7.

Besides raw files, some training documents are chat exchanges built from the same training
files ("Write the function X from module Y." -> its source), so that a chat request to the demo
gets an answer in the assistant's turn instead of random code.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Directories that are not representative library code (tests, GUI demos, the 2to3 grammar
# tool) or are mostly data tables (codec maps), which would waste vocabulary and training steps.
_SKIP_PARTS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
    "encodings", "__pycache__", "ensurepip", "venv", "pydoc_data", "config-3.11-x86_64-linux-gnu",
})
_MAX_FILE_BYTES = 400_000  # a few generated giants (e.g. _pydecimal is fine; tables are not)
HELDOUT_BUCKETS = 20  # 1 bucket of 20 = 5 % of files held out


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, '/'-separated
    text: str

    @property
    def module(self) -> str:
        name = self.rel.removesuffix(".py").removesuffix("/__init__")
        return name.replace("/", ".")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    """Held-out by a stable hash of the relative path."""
    digest = hashlib.sha1(rel.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_BUCKETS == 0


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """Every usable .py file in a deterministic (sorted) order."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _SKIP_PARTS.intersection(rel.split("/")[:-1]) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel, text))
    return files


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.rel)]
    heldout = [f for f in files if is_heldout(f.rel)]
    return train, heldout


def function_examples(file: SourceFile, max_chars: int = 1600) -> Iterator[tuple[str, str]]:
    """(request, source) pairs for the top-level functions and methods of a file whose source
    is short enough to fit a training window."""
    try:
        tree = ast.parse(file.text)
    except SyntaxError:
        return
    lines = file.text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("__") or node.name.startswith("test") or not node.end_lineno:
            continue
        # Whole lines, dedented (methods read as standalone functions); not
        # ast.get_source_segment, which rescans the file per call (minutes on the stdlib).
        src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip() + "\n"
        if not 80 <= len(src) <= max_chars:
            continue
        yield f"Write the function {node.name} from the {file.module} module.", src


def chat_documents(files: list[SourceFile], rng: random.Random,
                   max_examples: int) -> list[list[dict[str, str]]]:
    """Chat exchanges (message lists) drawn from the given files."""
    examples = [ex for f in files for ex in function_examples(f)]
    rng.shuffle(examples)
    chats = []
    for request, src in examples[:max_examples]:
        messages = [{"role": "user", "content": request},
                    {"role": "assistant", "content": src}]
        # A third of the chats carry a system turn, so the template's system role is trained.
        if rng.random() < 0.33:
            messages.insert(0, {"role": "system", "content": "You are a helpful Python assistant."})
        chats.append(messages)
    return chats


def heldout_prompts(files: list[SourceFile], n: int, seed: int = 0,
                    min_chars: int = 200, max_chars: int = 400) -> list[str]:
    """Prompt texts cut from held-out files at line boundaries: the start of a function or
    class definition with what precedes it (the model continues the code)."""
    rng = random.Random(seed)
    prompts: list[str] = []
    candidates = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith(("def ", "class ", "    def ")) and i >= 3:
                candidates.append((f, lines, i))
    rng.shuffle(candidates)
    used: set[str] = set()
    for f, lines, i in candidates:
        if f.rel in used:
            continue
        # Take lines before the definition until the prompt is long enough, then the def line.
        start = i
        while start > 0 and len("".join(lines[start:i + 1])) < min_chars:
            start -= 1
        text = "".join(lines[start:i + 1])
        if not min_chars <= len(text) <= max_chars:
            continue
        used.add(f.rel)
        prompts.append(text)
        if len(prompts) == n:
            break
    return prompts
