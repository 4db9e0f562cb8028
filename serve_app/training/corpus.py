"""The training corpus: the Python standard library's own source, read from this machine.

Nothing is downloaded: every machine with Python has these files. The split into training and
held-out files is decided by a hash of each file's path relative to the stdlib root (not of its
content), so the same files are held out on every Python 3.11 install even when patch releases
edit a few of them. Another minor version of Python gives a slightly different corpus; the
committed models were trained on CPython 3.11.7.

The training stream also holds conversations in Kimi K3's chat format about the same files'
functions (`conversations.py`).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
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
