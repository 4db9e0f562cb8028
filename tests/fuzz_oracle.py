"""What every answer of the OpenAI API must look like, whatever was sent; the report of a fuzz
run; and the server both fuzzers start. Shared by tests/test_fuzz_api.py and bench/fuzz_api.py.

The oracle, per response:
  - no 5xx: every bad input is the client's fault, and answered 4xx;
  - an answer within the timeout (no hang), and an answer at all (no dropped connection);
  - every non-2xx body is exactly OpenAI's error object
    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}},
    and its message leaks no internals (tracebacks, paths, Python reprs of exceptions);
  - a 200 is a completion with choices and usage, or, streamed, SSE whose every `data:` line
    is JSON or `[DONE]`, without an error event, ending with `data: [DONE]`; neither carries
    finish_reason "error" (the engine's mark for a request it aborted: that must surface as an
    error, not as a short successful answer);
  - inputs that are no request at all (garbage bytes, wrong routes) are never 2xx.
After a 5xx, a hang or a dropped connection the server is probed with a plain request; if that
fails too the server was taken down by the request (an outage), and the run waits for it to
come back before going on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from app_configs import tiny_app
from fuzz_strategies import COMPLETIONS, MODEL, FuzzRequest

TIMEOUT_S = 60.0
RECOVERY_S = 120.0
# Substrings no error message may carry: a traceback, a source path, a site-packages path, an
# object repr, an exception repr such as ActorDiedError(...) or UnicodeEncodeError('utf-8', ...).
LEAKS = ("Traceback", 'File "', "/work/", "site-packages", " object at 0x", "Error(")
ERROR_KEYS = {"message", "type", "param", "code"}


def plain_request(model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "prompt": "def hello", "max_tokens": 4, "temperature": 0}


@dataclass
class Outcome:
    request: FuzzRequest
    status: int | None  # None: no HTTP answer
    elapsed_s: float
    problems: list[tuple[str, str]]  # (kind, detail); empty: the answer was right
    response: str  # the start of the body (or the transport error)
    error: str | None = None  # "type: message" of the error object, when there was one

    @property
    def kind(self) -> str:
        return self.problems[0][0] if self.problems else "ok"


def _error_problems(body: bytes) -> tuple[list[tuple[str, str]], str | None]:
    try:
        payload = json.loads(body)
    except ValueError:
        return [("error-shape", "the error body is not JSON")], body[:120].decode(
            "utf-8", "backslashreplace")
    return _check_error_object(payload)


def _check_error_object(payload: Any) -> tuple[list[tuple[str, str]], str | None]:
    """Problems, and "type: message" (or the body's own text) to tell one bug from another."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(payload) != {"error"} or set(error) != ERROR_KEYS:
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        return [("error-shape", f"not the OpenAI error object: keys {keys}")], json.dumps(
            payload)[:120]
    problems = []
    if not (isinstance(error["message"], str) and isinstance(error["type"], str)
            and isinstance(error["param"], str | None) and isinstance(error["code"], str | None)):
        problems.append(("error-shape", "error fields of the wrong type: "
                         f"{ {k: type(v).__name__ for k, v in error.items()} }"))
    message = error["message"] if isinstance(error["message"], str) else str(error["message"])
    leaked = [s for s in LEAKS if s in message]
    if leaked:
        problems.append(("leak", f"the message carries {leaked}"))
    return problems, f"{error['type']}: {message}"


def _sse_problems(body: bytes) -> list[tuple[str, str]]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return [("bad-sse", "the stream is not UTF-8")]
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    problems: list[tuple[str, str]] = []
    for payload in data:
        if payload == "[DONE]":
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            problems.append(("bad-sse", f"a data line is not JSON: {payload[:80]!r}"))
            continue
        if isinstance(event, dict) and "error" in event:
            found, error = _check_error_object(event)
            problems += [("stream-error", f"an error event: {error}"), *found]
        elif _aborted(event):
            problems.append(("stream-error", 'a chunk with finish_reason "error"'))
    if not data or data[-1] != "[DONE]":
        problems.append(("bad-sse", "the stream does not end with data: [DONE]"))
    return problems


def _completion_problems(body: bytes) -> list[tuple[str, str]]:
    try:
        payload = json.loads(body)
    except ValueError:
        return [("bad-200", "a 200 body that is not JSON")]
    if not (isinstance(payload, dict) and isinstance(payload.get("choices"), list)
            and payload["choices"] and isinstance(payload.get("usage"), dict)
            and isinstance(payload["usage"].get("completion_tokens"), int)):
        return [("bad-200", "a 200 without choices and usage")]
    if _aborted(payload):
        return [("bad-200", 'a 200 with finish_reason "error"')]
    return []


def _aborted(payload: Any) -> bool:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "error" for c in choices)


def judge(request: FuzzRequest, status: int, content_type: str, body: bytes,
          elapsed_s: float) -> Outcome:
    problems: list[tuple[str, str]] = []
    error = None
    if status >= 500:
        problems.append(("5xx", f"status {status}"))
    if 200 <= status < 300:
        if request.must_fail:
            problems.append(("accepted-garbage", f"{status} for input that is no request"))
        elif status != 200:
            problems.append(("unexpected-status", f"status {status}"))
        elif content_type.startswith("text/event-stream"):
            problems += _sse_problems(body)
        elif request.wants_stream:
            problems.append(("bad-200", "stream: true answered without SSE"))
        else:
            problems += _completion_problems(body)
    else:
        if status < 400:
            problems.append(("unexpected-status", f"status {status} (neither success nor error)"))
        found, error = _error_problems(body)
        problems += found
    preview = body[:300].decode("utf-8", "backslashreplace")
    return Outcome(request, status, elapsed_s, problems, preview, error)


def send(client: httpx.Client, base: str, request: FuzzRequest,
         timeout_s: float = TIMEOUT_S) -> Outcome:
    """One request; the whole answer must arrive within `timeout_s` (a stream that trickles
    forever is a hang too, which httpx's per-read timeout alone would not see)."""
    started = time.perf_counter()
    try:
        content: bytes | Iterator[bytes] | None = request.body
        if request.chunked and request.body is not None:
            content = iter([request.body])  # an iterator: httpx sends it chunked
        with client.stream(request.method, base + request.path, content=content,
                           headers=dict(request.headers), timeout=timeout_s) as resp:
            chunks = []
            for chunk in resp.iter_bytes():
                chunks.append(chunk)
                if time.perf_counter() - started > timeout_s:
                    return Outcome(request, resp.status_code, time.perf_counter() - started,
                                   [("hang", f"no complete answer in {timeout_s:.0f} s")],
                                   b"".join(chunks)[:300].decode("utf-8", "backslashreplace"))
            return judge(request, resp.status_code, resp.headers.get("content-type", ""),
                         b"".join(chunks), time.perf_counter() - started)
    except httpx.TimeoutException as exc:
        return Outcome(request, None, time.perf_counter() - started,
                       [("hang", f"no answer in {timeout_s:.0f} s")], type(exc).__name__)
    except httpx.TransportError as exc:
        return Outcome(request, None, time.perf_counter() - started,
                       [("no-answer", "the connection failed or was dropped")],
                       f"{type(exc).__name__}: {exc}")


def probe(client: httpx.Client, base: str, model: str = MODEL) -> str | None:
    """None if the server serves (health 200, a plain completion with >= 1 token), else why."""
    try:
        health = client.get(base + "/health", timeout=TIMEOUT_S)
        if health.status_code != 200:
            return f"GET /health: {health.status_code} {health.text[:200]}"
        resp = client.post(base + COMPLETIONS, json=plain_request(model), timeout=TIMEOUT_S)
        if resp.status_code != 200:
            return f"a plain completion: {resp.status_code} {resp.text[:200]}"
        if resp.json()["usage"]["completion_tokens"] < 1:
            return "a plain completion returned no tokens"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _normalised(detail: str) -> str:
    """A message with its variable parts (quoted values, numbers) blanked, so that one bug is
    one class."""
    detail = re.sub(r"'[^']*'", "'…'", detail)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", detail)[:160]


@dataclass
class FailureClass:
    kind: str  # every problem kind of the answer, "5xx+leak"
    status: int | None
    signature: str
    count: int = 0
    examples: list[Outcome] = field(default_factory=list)  # the smallest distinct requests

    KEEP = 3

    def add(self, outcome: Outcome) -> None:
        self.count += 1
        if any(o.request == outcome.request for o in self.examples):
            return
        self.examples.append(outcome)
        self.examples.sort(key=lambda o: len(o.request.describe(10**6)))
        del self.examples[self.KEEP:]

    @property
    def smallest(self) -> Outcome:
        return self.examples[0]


@dataclass
class FuzzReport:
    model: str = MODEL
    sent: Counter[str] = field(default_factory=Counter)  # by request kind
    statuses: Counter[str] = field(default_factory=Counter)
    hangs: int = 0
    outages: list[str] = field(default_factory=list)  # the request that took the server down
    classes: dict[tuple[str, str, str | None, str], FailureClass] = field(default_factory=dict)
    stopped: str | None = None  # why the run stopped early
    server_down: bool = False  # ... because the server did not come back
    max_outages: int | None = None  # stop after this many (each costs a replica restart)
    skipped: int = 0
    started: float = field(default_factory=time.perf_counter)

    def record(self, outcome: Outcome) -> None:
        self.sent[outcome.request.kind] += 1
        self.statuses[str(outcome.status) if outcome.status is not None else "none"] += 1
        if outcome.kind == "hang":
            self.hangs += 1
        if outcome.problems:
            kind = "+".join(dict.fromkeys(k for k, _ in outcome.problems))
            detail = outcome.problems[0][1]
            if outcome.error and not kind.startswith("stream-error"):
                # The status alone says little; the error message says which bug it is.
                detail = f"{detail}; {outcome.error}"
            key = (outcome.request.kind, kind, str(outcome.status), _normalised(detail))
            cls = self.classes.setdefault(key, FailureClass(kind, outcome.status, key[3]))
            cls.add(outcome)

    def run(self, client: httpx.Client, base: str, request: FuzzRequest) -> Outcome | None:
        """Send, judge, record; after a server-side failure, probe, and if the server is down,
        count an outage and wait for it to come back (or stop the run)."""
        if self.stopped:
            self.skipped += 1
            return None
        outcome = send(client, base, request)
        self.record(outcome)
        if outcome.kind in ("5xx", "hang", "no-answer", "stream-error"):
            why = probe(client, base, self.model)
            if why is not None:
                self.outages.append(f"{request.describe(200)} -> {outcome.status}: {why}")
                deadline = time.perf_counter() + RECOVERY_S
                while why is not None and time.perf_counter() < deadline:
                    time.sleep(2)
                    why = probe(client, base, self.model)
                if why is not None:
                    self.stopped = f"not serving {RECOVERY_S:.0f} s after an outage: {why}"
                    self.server_down = True
                elif self.max_outages is not None and len(self.outages) >= self.max_outages:
                    self.stopped = f"{len(self.outages)} outages"
        return outcome

    @property
    def failures(self) -> int:
        return sum(c.count for c in self.classes.values())

    @property
    def five_xx(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.isdigit() and int(s) >= 500)

    def summary(self) -> str:
        lines = [f"sent {sum(self.sent.values())} requests ({dict(self.sent)}) in "
                 f"{time.perf_counter() - self.started:.0f} s; statuses "
                 f"{dict(sorted(self.statuses.items()))}; 5xx {self.five_xx}, hangs "
                 f"{self.hangs}, outages {len(self.outages)}, failures {self.failures} in "
                 f"{len(self.classes)} classes"]
        if self.stopped:
            lines.append(f"STOPPED: {self.stopped} ({self.skipped} requests not sent)")
        for text in self.outages:
            lines.append(f"  outage after: {text}")
        for (endpoint, _, _, _), cls in sorted(self.classes.items(),
                                               key=lambda kv: -kv[1].count):
            lines.append(f"  [{endpoint}] {cls.kind} x{cls.count} (status {cls.status}): "
                         f"{cls.signature}")
            for example in cls.examples:
                lines.append(f"      request: {example.request.describe(300)}")
            lines.append(f"      answer:  {cls.smallest.response[:300]!r}")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": sum(self.sent.values()), "by_kind": dict(self.sent),
            "statuses": dict(sorted(self.statuses.items())), "5xx": self.five_xx,
            "hangs": self.hangs, "outages": len(self.outages), "failures": self.failures,
            "failure_classes": [
                {"endpoint": k[0], "kind": c.kind, "status": c.status, "count": c.count,
                 "signature": c.signature,
                 "requests": [o.request.describe(300) for o in c.examples],
                 "answer": c.smallest.response[:300]}
                for k, c in self.classes.items()],
            "stopped": self.stopped, "wall_s": round(time.perf_counter() - self.started, 1),
        }


# --- the server under test ----------------------------------------------------------------------

def app_config(paths: dict[str, Path], model: str = MODEL) -> dict[str, Any]:
    """TP 1 on one CPU rank slot, small token limits, so that valid requests stay cheap."""
    return tiny_app(paths, model, parallelism={"tp": 1},
                    ingress={"default_max_tokens": 8, "max_tokens_limit": 64})


def k3_app_config(paths: dict[str, Path], model: str = MODEL) -> dict[str, Any]:
    """The same, serving a pair in Kimi K3's chat format under K3's parameter policy."""
    return {**app_config(paths, model), "api": {"parameter_policy": "k3"}}


@contextlib.contextmanager
def local_server(folder: Path, model: str = MODEL, k3_format: bool = False) -> Iterator[str]:
    """A local Ray cluster serving the tiny pair (tests/tiny_models.py) over HTTP, or with
    `k3_format` the random mini K3 in K3's chat format; yields the base URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tiny_models import served, write_k3_format_pair, write_tiny_serving_pair

    from serve_app.config import AppConfig

    if k3_format:
        config = k3_app_config(write_k3_format_pair(folder), model)
    else:
        config = app_config(write_tiny_serving_pair(folder), model)
    with served(AppConfig.model_validate(config)) as port:
        yield f"http://127.0.0.1:{port}"


def fuzz(client: httpx.Client, base: str, named: list[FuzzRequest], strategy: Any, total: int,
         down: list[str], max_outages: int = 2) -> FuzzReport:
    """Send the named cases, then Hypothesis' examples (derandomized: CI sends the same
    requests every run), recording every answer. `down` carries a server found down from one
    test to the next, which then fail at once instead of each waiting out the recovery."""
    import pytest
    from hypothesis import HealthCheck, Phase, given, settings

    if down:
        pytest.fail(f"the server is down since an earlier test: {down[0]}")
    report = FuzzReport(max_outages=max_outages)
    for request in named:
        report.run(client, base, request)

    @settings(max_examples=max(1, total - len(named)), deadline=None, derandomize=True,
              database=None, phases=[Phase.generate], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def generated(request: FuzzRequest) -> None:
        report.run(client, base, request)

    generated()
    if report.server_down:
        down.append(report.stopped or "")
    print(report.summary())  # shown with -s, and in the failure message
    return report


def check(report: FuzzReport) -> None:
    assert report.failures == 0 and not report.outages and not report.stopped, report.summary()
