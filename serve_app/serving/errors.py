"""Any failure on a request's path as what a client may see: an OpenAIError with no reprs,
paths or internal addresses; faults a retry can cure are 503 with Retry-After."""

from __future__ import annotations

import ray.exceptions

from serve_app.models.kv_capacity import KVCapacityError
from serve_app.observability.logs import get_logger
from serve_app.protocol.generation import EngineUnavailable, RequestFailed
from serve_app.protocol.openai import OpenAIError
from serve_app.routing.policy import ClientLimit, QueueFull, RequestTooLarge, RouterError

logger = get_logger("ingress")


_RAY_UNAVAILABLE: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
    ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError)


def unwrap(exc: BaseException) -> BaseException:
    # Ray wraps a replica's exception; the original is its cause.
    return getattr(exc, "cause", None) or exc


def unavailable(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(503, message, "server_error", code="service_unavailable",
                       headers={"Retry-After": str(retry_after_s)})


def router_error(exc: RouterError, retry_after_s: int) -> OpenAIError:
    """Router refusals: 400 (larger than any replica), 429 + Retry-After (queue or client
    limit), 503 + Retry-After (queue timeout)."""
    if isinstance(exc, QueueFull):
        code = "client_limit" if isinstance(exc, ClientLimit) else "router_queue_full"
        return OpenAIError(429, str(exc), "rate_limit_error", code=code,
                           headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
    if isinstance(exc, RequestTooLarge):
        return OpenAIError(400, str(exc), param="max_tokens", code="kv_capacity_exceeded")
    err = unavailable(str(exc), retry_after_s)
    err.code = "router_queue_timeout"
    return err


def error_for(exc: BaseException, retry_after_s: int, request_id: str = "") -> OpenAIError:
    """Any failure as what a client may see: no reprs, paths or internal addresses; faults
    that a retry can cure are 503 with Retry-After."""
    cause = unwrap(exc)
    if isinstance(cause, OpenAIError):
        return cause
    if isinstance(cause, RouterError):
        return router_error(cause, retry_after_s)
    if isinstance(cause, KVCapacityError):
        return OpenAIError(400, str(cause), code="kv_capacity_exceeded")
    if isinstance(cause, EngineUnavailable):
        return unavailable(str(cause) or "the engine is unavailable", retry_after_s)
    if isinstance(cause, RequestFailed):
        logger.error("request %s failed in the engine: %s", request_id, cause)
        return OpenAIError(500, str(cause) or "the request failed in the engine",
                           "server_error", code="request_failed")
    if isinstance(cause, ValueError):  # the engine refused it before queueing: names the field
        return OpenAIError(400, str(cause), param=getattr(cause, "param", None))
    if isinstance(exc, _RAY_UNAVAILABLE) or isinstance(cause, _RAY_UNAVAILABLE) or type(
            cause).__name__ in ("BackPressureError", "DeploymentUnavailableError"):
        logger.warning("request %s: target replica unavailable", request_id, exc_info=exc)
        return unavailable("the model replica is unavailable (restarting or overloaded); "
                            "retry", retry_after_s)
    logger.error("request %s failed", request_id, exc_info=exc)
    return OpenAIError(500, "internal error", "server_error", code="internal_error")
