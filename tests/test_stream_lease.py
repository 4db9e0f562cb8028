"""A streaming answer's lease (its router reservation and its engine stream) is released when
its response ends, on every path, without the garbage collector: the race behind a capacity
leak where a client that left before the first byte kept its tokens committed in the router.

Driven at the ASGI level with Starlette's own StreamingResponse machinery: the client's
disconnect arrives before the response could send anything, so Starlette cancels the send
before the body generator ever starts."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from serve_app.protocol.generation import GenerateRequest
from serve_app.serving.dispatch import Lease
from serve_app.serving.responses import LeasedStream


class Releases:
    """Records what a lease gives back (the AdmissionStage's release hook)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def prefill_done(self, request_id: str) -> None: ...


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def body(lease: Lease, ran: list[str]) -> AsyncIterator[str]:
    async def sse() -> AsyncIterator[str]:
        try:
            ran.append("started")
            yield "data: 1\n\n"
        finally:
            lease.close()

    return sse()


async def client_gone_before_the_first_byte(response: StreamingResponse) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(3600)  # the socket is gone: the send never completes

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await response(scope, receive, send)


def lease_for(request_id: str, router: Releases) -> Lease:
    async def no_move(lease: Lease, moved: Any) -> Any:
        raise AssertionError("nothing moves here")

    request = GenerateRequest(request_id, [1])
    return Lease(request, router, no_move, 16)  # type: ignore[arg-type]


def test_the_race_a_plain_streaming_response_leaves_the_lease_held(no_gc: None) -> None:
    """The premise: the body generator never starts, so its `finally` never runs."""
    router, ran = Releases(), []
    lease = lease_for("r1", router)
    lease.hold()
    response = StreamingResponse(body(lease, ran), media_type="text/event-stream")
    asyncio.run(client_gone_before_the_first_byte(response))
    assert ran == [] and router.released == []


def test_a_leased_stream_releases_when_the_client_left_before_the_first_byte(
        no_gc: None) -> None:
    router, ran, abandoned = Releases(), [], []
    lease = lease_for("r2", router)
    lease.hold()
    response = LeasedStream(body(lease, ran), lease, lambda: abandoned.append(1))
    asyncio.run(client_gone_before_the_first_byte(response))
    assert ran == []
    assert router.released == ["r2"] and abandoned == [1]


def test_a_leased_stream_that_finishes_releases_once_and_is_not_abandoned(no_gc: None) -> None:
    router, abandoned, sent = Releases(), [], []
    lease = lease_for("r3", router)
    lease.hold()

    async def sse() -> AsyncIterator[str]:
        try:
            yield "data: [DONE]\n\n"
            lease.finished = True
        finally:
            lease.close()

    async def run() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message["type"])

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await LeasedStream(sse(), lease, lambda: abandoned.append(1))(scope, receive, send)

    asyncio.run(run())
    assert router.released == ["r3"] and abandoned == []
    assert sent[0] == "http.response.start" and sent[-1] == "http.response.body"
