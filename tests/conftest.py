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
SHARED_CLUSTER = {"test_fuzz_api.py", "test_fuzz_k3.py", "test_grammar_serve.py", "test_hardening.py",
                  "test_hybrid_serve.py", "test_k3_chat_serve.py", "test_multi_ingress.py",
                  "test_prefix_serve.py", "test_router_serve.py", "test_serve_app.py"}
OWN_CLUSTER = {"test_local_deployment.py", "test_multinode_placement.py", "test_observability.py",
               "test_disaggregated_tracing.py",
               "test_sglang_placement.py", "test_sglang_gpu.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules without Ray first (an idle cluster's processes take a quarter of a core from
    them), then the shared-cluster ones, then those with a cluster of their own, so that the
    shared cluster is started once. Only for speed: `pytest --random-order` shuffles after
    this, and every order passes."""
    def lane(item: pytest.Item) -> int:
        name = item.path.name
        return 2 if name in OWN_CLUSTER else 1 if name in SHARED_CLUSTER else 0

    items.sort(key=lane)  # stable: modules stay whole


@pytest.fixture(autouse=True, scope="module")
def _no_app_left_behind() -> Iterator[None]:
    """A module whose fixture failed half-way must leave neither an app on the shared cluster
    nor a cluster of its own (every later `ray.init` would then fail)."""
    yield
    import ray
    from tiny_models import _SHARED, delete_apps, stop_ray

    if not ray.is_initialized():
        return
    if not _SHARED:
        stop_ray()
        return
    try:
        delete_apps()
    except Exception:  # the shared cluster is broken: the next module starts a new one
        stop_ray()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tiny_models import stop_ray

    stop_ray()
