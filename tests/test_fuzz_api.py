"""Property-based fuzzing of the OpenAI HTTP API against a real Serve app (Ray, serve.run,
HTTP): hostile bodies for both endpoints, raw garbage, wrong routes and methods.

The properties (tests/fuzz_oracle.py): no 5xx, no hang, every error is OpenAI's error object
with no internals in its message, every 200 is a well-formed completion or SSE stream, garbage
is never accepted, and the server still serves afterwards. The requests
(tests/fuzz_strategies.py) are the same ones `bench/fuzz_api.py` sends in larger numbers.

Each test sends its named cases and then Hypothesis' examples, records every answer, and
fails at the end with one line per distinct failure class (the smallest request seen for
each) rather than at the first: on a broken server one run then lists every bug, and no
shrinking is needed (each shrink step would be another request to a live server). The
examples are derandomized, so CI sends the same requests every run.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from bench_runner import json_line, run_bench
from fuzz_oracle import FuzzReport, check, fuzz, local_server, plain_request
from fuzz_strategies import (
    COMPLETIONS,
    FuzzRequest,
    chat_requests,
    completion_requests,
    explicit_bodies,
    explicit_raw,
    explicit_routes,
    raw_requests,
)
from hypothesis import strategies as st

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("shared")]

EXAMPLES = {"chat": 150, "completion": 150, "raw": 100}  # named cases included
# A request that takes the server down costs ~30 s here (Serve replaces the replica): a test
# stops after this many, already failed, so that a broken server fails CI in minutes.
MAX_OUTAGES = 2
# Set when a run found the server not coming back: the next tests fail at once instead of each
# waiting out the recovery time again.
_DOWN: list[str] = []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with local_server(tmp_path_factory.mktemp("fuzz")) as base:
        yield base


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def _fuzz(client: httpx.Client, base: str, named: list[FuzzRequest],
          strategy: st.SearchStrategy[FuzzRequest], total: int) -> FuzzReport:
    return fuzz(client, base, named, strategy, total, _DOWN, MAX_OUTAGES)


_check = check


def test_chat_completions(server: str, client: httpx.Client) -> None:
    _check(_fuzz(client, server, explicit_bodies("chat"), chat_requests(), EXAMPLES["chat"]))


def test_completions(server: str, client: httpx.Client) -> None:
    _check(_fuzz(client, server, explicit_bodies("completion"), completion_requests(),
                 EXAMPLES["completion"]))


def test_raw_bodies_routes_and_methods(server: str, client: httpx.Client) -> None:
    _check(_fuzz(client, server, explicit_raw() + explicit_routes(), raw_requests(),
                 EXAMPLES["raw"]))


def test_the_fuzz_bench_runs_against_this_server(server: str) -> None:
    """bench/fuzz_api.py at smoke size against the same server (its README row's --url
    form): it exits 0 (no failure, no outage, healthy after) and reports what it sent."""
    report = json_line(run_bench("bench/fuzz_api.py", "--url", server, "--requests", "12",
                                 "--no-named", "--seed", "1"))
    assert report["requests"] == 12 and sum(report["by_kind"].values()) == 12
    assert report["5xx"] == report["hangs"] == report["outages"] == 0
    assert report["failures"] == 0 and report["health_after"] == "ok"


def test_the_server_still_serves_after_the_fuzzing(server: str, client: httpx.Client) -> None:
    # Runs last (file order): whatever the fuzzing did, the server must serve right away.
    health = client.get(server + "/health", timeout=60)
    assert health.status_code == 200, health.text
    resp = client.post(server + COMPLETIONS, json=plain_request(), timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
