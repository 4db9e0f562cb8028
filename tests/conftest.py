"""Test-wide settings.

One intra-op thread per process: the models here are tiny, and on the 2-core CI machine several
processes (Ray workers, TP ranks) share the cores; OpenMP threads spinning against each other
made a tiny forward 80x slower.
"""

from __future__ import annotations

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


# The modules on the shared Ray cluster (tests/tiny_models.py shared_serve) and those that start
# a cluster of their own (own_cluster, fake_gpu_cluster, the demo).
SHARED_CLUSTER = {"test_disaggregated_serve.py", "test_fuzz_api.py", "test_fuzz_k3.py",
                  "test_grammar_serve.py", "test_hardening.py", "test_hybrid_serve.py",
                  "test_k3_chat_serve.py", "test_multi_ingress.py", "test_prefix_serve.py",
                  "test_router_serve.py", "test_serve_app.py"}
OWN_CLUSTER = {"test_local_deployment.py", "test_multinode_placement.py", "test_observability.py",
               "test_request_path.py", "test_benches.py",
               "test_disaggregated_tracing.py", "test_sglang_placement.py", "test_sglang_gpu.py"}
# Modules without Ray that assert wall-clock bounds (a watchdog of 0.5 s, a waiting request
# placed within 0.3 s of a free slot, a 10 s subscriber deadline): never run at idle CPU
# priority (pytest_runtest_setup), so under xdist they go with the own-cluster scope.
TIMED = {"test_engine_faults.py", "test_router_policy.py", "test_sglang_kv_events.py"}


def _lane(node: pytest.Item | pytest.Module) -> int:
    name = node.path.name
    return 2 if name in OWN_CLUSTER else 1 if name in SHARED_CLUSTER else 0


def _scope(module: str) -> str | None:
    """The xdist scope a module's tests run in whole, at normal CPU priority; None: each test
    on its own, at idle priority."""
    if module in SHARED_CLUSTER:
        return "shared cluster"
    return "normal priority" if module in OWN_CLUSTER | TIMED else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules without Ray first (an idle cluster's processes take a quarter of a core from
    them), those with a slow test leading (under xdist a long test started last is the run's
    tail), then the shared-cluster ones, then those with a cluster of their own, so that the
    shared cluster is started once. Only for speed: `pytest --random-order` shuffles after
    this, and every order passes."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (_lane(item), item.path not in slow))  # stable: modules whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (pyproject's addopts: three workers) the shared-cluster modules are
    one scope, run whole by one worker on one cluster; the modules with a cluster of their own
    and the TIMED ones are another, which a second worker takes first (xdist hands out the
    largest scopes first), before it turns to the rest one test at a time; the third takes the
    rest from the start. Those run at idle CPU priority (pytest_runtest_setup), so the third
    worker only fills what the Ray modules leave: their requests wait on one process after
    another. Measured on the 2-core machine, the whole suite in one run each: two workers
    420.9 s, the machine 91% busy while the workers ran; three workers 414.5 s, 99% busy (each
    worker's collection, ~10 CPU-s, is the price of the third). (xdist's own
    `--dist loadgroup` marks a group by editing `item._nodeid`, which pytest 9.2 no longer
    reads: its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::")[0].rsplit("/", 1)[-1]) or nodeid

    return RayModulesTogether(config, log)


_yielding = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker running a test without Ray yields the CPU to the one running the Ray modules.
    Their requests hop through several processes (ingress, replica, ranks), each waiting on
    the last, so a core taken by a torch test stretches every hop. Measured on the 2-core CI
    machine, test_serve_app.py alone 32 s; beside test_grammar.py at nice 10, 38 s; beside it
    as SCHED_IDLE (runs only on a core nothing else wants), 31 s. A worker starts its scope of
    Ray or TIMED modules first or not at all, and the policy cannot be undone, so it is set once
    the worker is past them; the TP ranks and subprocesses its tests start inherit it."""
    global _yielding
    if _yielding and item.path.name in TIMED:
        pytest.fail(f"{item.path.name} asserts wall-clock bounds but this xdist worker already "
                    "runs at idle CPU priority: keep the module in the TIMED scope")
    if _yielding or _scope(item.path.name) or "PYTEST_XDIST_WORKER" not in os.environ:
        return
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
    without being listed above fails here: unlisted, it would run beside the Ray modules on
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
        pytest.fail(f"{request.path.name} uses Ray: add it to SHARED_CLUSTER or OWN_CLUSTER in "
                    "conftest.py")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tiny_models import stop_ray

    stop_ray()
