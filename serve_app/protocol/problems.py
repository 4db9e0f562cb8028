"""One error that names every problem of an input at once (a checkpoint folder, a
preprocessing config): whoever fixes it sees the whole list, not the first item."""

from __future__ import annotations

import os


class ProblemsError(ValueError):
    """`where`'s problems, all listed; `label` prefixes `where` in the message."""

    label = ""

    def __init__(self, where: str | os.PathLike[str], problems: list[str]) -> None:
        self.problems = problems
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        super().__init__(f"{self.label}{where}: {count}:\n  - " + "\n  - ".join(problems))
