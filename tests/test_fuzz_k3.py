"""Property-based fuzzing of a server in Kimi K3's chat format (the random mini K3 with a
K3-style tokenizer, K3's parameter policy): the K3 fields (thinking, tools and dynamic tools,
tool_choice, response_format, tool calls and results in the history) hostile, alongside the
fuzz suite's own (tests/test_fuzz_api.py, whose oracle and run loop this shares).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fuzz_oracle import check, fuzz, local_server
from fuzz_strategies import explicit_bodies, explicit_k3_bodies, k3_chat_requests

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("shared")]

EXAMPLES = 150  # named cases included
_DOWN: list[str] = []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with local_server(tmp_path_factory.mktemp("fuzz-k3"), k3_format=True) as base:
        yield base


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def test_k3_chat_completions(server: str, client: httpx.Client) -> None:
    named = explicit_k3_bodies() + explicit_bodies("chat")
    check(fuzz(client, server, named, k3_chat_requests(), EXAMPLES, _DOWN))


def test_the_server_still_serves_after_the_fuzzing(server: str, client: httpx.Client) -> None:
    resp = client.post(server + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-kimi-dspark", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    assert isinstance(resp.json()["choices"][0]["message"]["content"], str)
