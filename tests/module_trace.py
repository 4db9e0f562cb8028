"""Which serve_app modules the processes of a Ray cluster execute while tracing is on.

`install` is a Ray worker setup hook (runtime_env `worker_process_setup_hook`), active where
the environment names a trace folder (`KIMI_MODULE_TRACE`). It sets a profile function in
every thread (the engine loop's and Serve's user-code threads start later and inherit it),
which records the file of every Python function called while the folder holds `on` (switched
on afresh: what ran before is forgotten); when `dump` appears there, each process writes what
it recorded to `<pid>.json`. The recording costs one Python call per function call, so only a
cluster of its own, for this purpose, installs it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ENV = "KIMI_MODULE_TRACE"
_seen: set[str] = set()
_on = False


def _profile(frame: FrameType, event: str, _arg: Any) -> None:
    if _on and event == "call":
        _seen.add(frame.f_code.co_filename)


def _watch(folder: Path, package: str) -> None:
    global _on
    dumped = False
    while True:
        on = (folder / "on").exists()
        if on and not _on:
            _seen.clear()
        _on = on
        if (folder / "dump").exists() and not dumped:
            mine = sorted(f for f in set(_seen) if f.startswith(package))
            tmp = folder / f"{os.getpid()}.tmp"
            tmp.write_text(json.dumps(mine))
            tmp.rename(folder / f"{os.getpid()}.json")
            dumped = True
        time.sleep(0.02)


def install() -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    import serve_app

    package = str(Path(serve_app.__file__).parent) + os.sep
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_watch, args=(Path(folder), package), daemon=True,
                     name="module-trace").start()


def modules(files: list[str], package_root: Path) -> set[str]:
    """`serve_app/...py` paths, relative to the checkout, of the recorded files."""
    return {str(Path(f).relative_to(package_root)) for f in files}
