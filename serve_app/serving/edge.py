"""The ingress's edge: what every request meets before FastAPI parses it (API key -> 401, body
size -> 413, anything unexpected -> an OpenAI-shaped 500), and the one JSON response class.

A pure ASGI middleware, outermost. Its settings are set once per process by the ingress's
constructor (`configure_edge`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from serve_app.observability.logs import get_logger
from serve_app.protocol.openai import OpenAIError

logger = get_logger("ingress")

DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class OpenAIJSONResponse(JSONResponse):
    """JSON that is always ASCII: no client string (a lone surrogate in a field name) can make
    rendering an error fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")



def error_response(err: OpenAIError) -> OpenAIJSONResponse:
    return OpenAIJSONResponse(err.body(), status_code=err.status, headers=err.headers)



@dataclass
class EdgeSettings:
    """Set once per process by the ingress's constructor (one ingress per replica process)."""

    key_digests: list[bytes] = field(default_factory=list)
    max_body_bytes: int = 1 << 20
    expose_docs: bool = False


EDGE = EdgeSettings()

# What a model that sees adds to the default body limit: base64 of three images at the default
# 20 MB per-image limit. A larger request (more, or larger, images) needs
# ingress.max_body_bytes raised beside images.max_image_bytes; the limit bounds the memory one
# request's body can take before any field is read.
IMAGE_BODY_BYTES = 64 << 20


def default_body_bytes(context_tokens: int, sees: bool) -> int:
    """The body limit when ingress.max_body_bytes is unset: 16 bytes per token of the context
    (JSON-escaped text or token ids) + 64 KiB, and IMAGE_BODY_BYTES when the model takes
    images."""
    return 16 * context_tokens + 65_536 + (IMAGE_BODY_BYTES if sees else 0)


def configure_edge(keys: list[str], max_body_bytes: int, expose_docs: bool) -> EdgeSettings:
    """Set the process's edge settings. A function of this module on purpose: Serve pickles
    the ingress class by value, so its methods would see a copy of EDGE, not this one."""
    EDGE.key_digests = [_digest(k) for k in keys]
    EDGE.max_body_bytes = max_body_bytes
    EDGE.expose_docs = expose_docs
    return EDGE


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def key_matches(presented: str, digests: list[bytes]) -> int | None:
    """Index of the matching key, comparing in constant time against every key (SHA-256
    digests first, so lengths leak nothing either)."""
    d = _digest(presented)
    found = None
    for i, k in enumerate(digests):
        if hmac.compare_digest(d, k) and found is None:
            found = i
    return found


class _BodyTooLarge(Exception):
    pass


class EdgeGuard:
    """Pure ASGI middleware, outermost: what every request meets before FastAPI parses it."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if path in DOC_PATHS and not EDGE.expose_docs:
            await _send_error(send, OpenAIError(404, "unknown path", code="not_found"))
            return
        if EDGE.key_digests and path != "/health":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            index = (key_matches(token.strip(), EDGE.key_digests)
                     if scheme.lower() == "bearer" else None)
            if index is None:
                await _send_error(send, OpenAIError(
                    401, "a valid API key is required (Authorization: Bearer KEY)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
            scope.setdefault("state", {})["client"] = f"key-{index}"
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > EDGE.max_body_bytes):
            await _send_error(send, _too_large())
            return
        seen = 0

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > EDGE.max_body_bytes:
                    raise _BodyTooLarge
            return message

        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, _too_large())
        except Exception:
            logger.exception("unhandled error on %s", path)
            if not started:
                await _send_error(send, OpenAIError(500, "internal error", "server_error"))


def _too_large() -> OpenAIError:
    return OpenAIError(413, f"the request body exceeds this server's limit of "
                       f"{EDGE.max_body_bytes} bytes", param=None, code="request_too_large")


async def _send_error(send: Any, err: OpenAIError) -> None:
    response = error_response(err)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
