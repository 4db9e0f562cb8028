"""Running a bench script as its README row does, for the bench smokes (tests/test_benches.py,
tests/test_benches_ray.py, and the smokes beside the servers they drive): the one way a test runs
`python bench/<name>.py`, so that `test_every_bench_script_runs_in_the_suite` can find them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str) -> str:
    """Run `script` (a path under the repository root) with `args`; its stdout. The timeout
    only keeps a hung bench from hanging the suite."""
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (f"{script} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def json_line(stdout: str) -> dict[str, Any]:
    """The report a bench prints as its last JSON line."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in:\n{stdout[-2000:]}"
    return json.loads(lines[-1])


def same(a: Any, b: Any) -> bool:
    """Equal reports (NaN equal to NaN: a tiny run may have none of some kind of sample)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def line_and_file(stdout: str, path: Path) -> dict[str, Any]:
    """The printed JSON line, checked equal to the --json file."""
    report = json_line(stdout)
    assert same(report, json.loads(path.read_text()))
    return report
