"""Test-wide settings.

One intra-op thread per process: the models here are tiny, and on the 2-core CI machine several
processes (Ray workers, TP ranks) share the cores; OpenMP threads spinning against each other
made a tiny forward 80x slower.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A Serve proxy must report ready within 5 s by default; on a loaded 2-core machine its worker
# process can take longer to start, and Serve then kills it and starts another, forever.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))


# A module that runs on Ray says which cluster, as its own mark:
#     pytestmark = pytest.mark.ray_cluster("shared")  # tests/tiny_models.py shared_serve
#     pytestmark = pytest.mark.ray_cluster("own")  # own_cluster, fake_gpu_cluster, the demo
# (or that mark in a pytestmark list). The xdist controller schedules by it before any worker
# has imported a test module, so it reads the mark from the module's source (_declared); a test
# whose mark is not that one fails at setup.
RAY_CLUSTERS = ("shared", "own")


@functools.cache
def _declared(path: Path) -> str | None:
    """The kind in the module's `pytestmark` ray_cluster mark, read from its source."""
    if path.suffix != ".py" or not path.is_file():
        return None
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for call in ast.walk(node.value):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "ray_cluster" and call.args
                        and isinstance(call.args[0], ast.Constant)):
                    return call.args[0].value
    return None


def _cluster(node: pytest.Item | pytest.Module) -> str | None:
    mark = node.get_closest_marker("ray_cluster")
    return mark.args[0] if mark is not None and mark.args else None


def _lane(node: pytest.Item | pytest.Module) -> int:
    return {"own": 2, "shared": 1}.get(_cluster(node) or "", 0)


def _scope(path: Path) -> str | None:
    """The xdist scope a module's tests run in whole, at normal CPU priority; None: each test
    on its own, at idle priority."""
    return {"shared": "shared cluster", "own": "own clusters"}.get(_declared(path) or "")


_misdeclared: dict[str, str] = {}  # node id -> why its ray_cluster mark is not its module's


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules without Ray first (an idle cluster's processes take a quarter of a core from
    them), those with a slow test leading (under xdist a long test started last is the run's
    tail), then the shared-cluster ones, then those with a cluster of their own, so that the
    shared cluster is started once. Only for speed: `pytest --random-order` shuffles after
    this, and every order passes. A test whose ray_cluster mark is not its module's, as the
    source declares it (what the xdist scheduler reads), fails at setup."""
    for item in items:
        kind, declared = _cluster(item), _declared(item.path)
        if kind != declared or kind not in (None, *RAY_CLUSTERS):
            _misdeclared[item.nodeid] = (
                f"ray_cluster({kind!r}), but its module declares {declared!r}: mark the module, "
                f"`pytestmark = pytest.mark.ray_cluster(kind)`, kind one of {RAY_CLUSTERS}, "
                "and no test or class on its own")
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (_lane(item), item.path not in slow))  # stable: modules whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (pyproject's addopts: three workers) the shared-cluster modules are
    one scope, run whole by one worker on one cluster; the modules with a cluster of their own
    are another, which a second worker takes first (xdist hands out the largest scopes first),
    before it turns to the rest one test at a time; the third takes the rest from the start.
    Those run at idle CPU priority (pytest_runtest_setup), so the third worker only fills what
    the Ray modules leave: their requests wait on one process after another. Measured on the
    2-core machine, the whole suite in one run each: two workers 420.9 s, the machine 91% busy
    while the workers ran; three workers 414.5 s, 99% busy (each worker's collection, ~10
    CPU-s, is the price of the third). (xdist's own `--dist loadgroup` marks a group by editing
    `item._nodeid`, which pytest 9.2 no longer reads: its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(root / nodeid.split("::")[0]) or nodeid

    return RayModulesTogether(config, log)


_yielding = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker running a test without Ray yields the CPU to the one running the Ray modules.
    Their requests hop through several processes (ingress, replica, ranks), each waiting on
    the last, so a core taken by a torch test stretches every hop. Measured on the 2-core CI
    machine, test_serve_app.py alone 32 s; beside test_grammar.py at nice 10, 38 s; beside it
    as SCHED_IDLE (runs only on a core nothing else wants), 31 s. A worker starts its scope of
    Ray modules first or not at all, and the policy cannot be undone, so it is set once the
    worker is past them; the TP ranks and subprocesses its tests start inherit it. No test
    depends on its speed: none asserts a wall-clock bound. The shared cluster, which the
    worker will not use again, stops then: idle, it took ~0.15 of a core (measured) for the
    rest of the run. (Were a shared-cluster test to come later, shared_serve starts one.)"""
    global _yielding
    if item.nodeid in _misdeclared:
        pytest.fail(_misdeclared[item.nodeid], pytrace=False)
    if _yielding or _cluster(item) or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    from tiny_models import stop_ray

    stop_ray()
    if hasattr(os, "sched_setscheduler"):  # Linux
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        # Rank processes fork from a server (spec_helpers.rank_processes) that an earlier test
        # may have started: it yields too, and so do the ranks it forks from now on.
        from multiprocessing import forkserver

        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if server is not None:
            os.sched_setscheduler(server, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
    _yielding = True


@pytest.fixture(autouse=True, scope="module")
def _no_app_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module whose fixture failed half-way must leave neither an app on the shared cluster
    nor a cluster of its own (every later `ray.init` would then fail). A module that used Ray
    without its ray_cluster mark fails here: unmarked, it would run beside the Ray modules on
    another xdist worker, on a second cluster."""
    import ray
    import tiny_models

    uses, was_up = tiny_models.shared_serve_calls, ray.is_initialized()
    yield
    used = tiny_models.shared_serve_calls != uses or (ray.is_initialized() and not was_up)
    if ray.is_initialized():
        if not tiny_models._SHARED:
            tiny_models.stop_ray()
        else:
            try:
                tiny_models.delete_apps()
            except Exception:  # the shared cluster is broken: the next module starts a new one
                tiny_models.stop_ray()
    if used and _lane(request.node) == 0:
        pytest.fail(f"{request.path.name} uses Ray: declare which cluster, "
                    '`pytestmark = pytest.mark.ray_cluster("shared")` or ("own")')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tiny_models import stop_ray

    stop_ray()
