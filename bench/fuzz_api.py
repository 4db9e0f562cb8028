"""The OpenAI HTTP API under thousands of hostile requests: the larger run of
tests/test_fuzz_api.py, with the same requests (tests/fuzz_strategies.py) and the same oracle
(tests/fuzz_oracle.py: no 5xx, no hang, OpenAI-shaped errors leaking nothing, well-formed 200s
and SSE, garbage never accepted).

It sends every named case once (each hostile number alone in an otherwise valid body, huge
nesting, wrong routes, ...), then Hypothesis examples, two fifths chat, two fifths completions,
one fifth raw bodies. After a 5xx or a hang it probes the server; a failed probe is an outage,
and the run waits for the server to come back (or stops). At the end: GET /health and one plain
completion ("health after").

Starts its own server (the tiny random pair, TP 1, on a local Ray cluster, as the test does)
unless --url names a running one. Exit status 1 when anything failed.

    python bench/fuzz_api.py [--requests 3000] [--seed 0] [--url http://127.0.0.1:8000]
                             [--model NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzz_oracle import FuzzReport, local_server, probe  # noqa: E402 (needs the path above)
from fuzz_strategies import (  # noqa: E402
    MODEL,
    FuzzRequest,
    any_request,
    explicit_bodies,
    explicit_raw,
    explicit_routes,
)
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url:
        yield url.rstrip("/")
        return
    with tempfile.TemporaryDirectory(prefix="fuzz-api-") as tmp, local_server(Path(tmp)) as base:
        yield base


def _served_model(client: httpx.Client, base: str) -> str:
    models = client.get(base + "/v1/models", timeout=60)
    models.raise_for_status()
    return str(models.json()["data"][0]["id"])


def fuzz(client: httpx.Client, base: str, model: str, requests: int, seed_: int,
         named: bool) -> FuzzReport:
    report = FuzzReport(model=model)
    cases: list[FuzzRequest] = []
    if named:
        cases = (explicit_bodies("chat", model) + explicit_bodies("completion", model)
                 + explicit_raw(model) + explicit_routes(model))[:requests]
    progress = {"next": 250}

    def one(request: FuzzRequest) -> None:
        report.run(client, base, request)
        sent = sum(report.sent.values())
        if sent >= progress["next"]:
            progress["next"] += 250
            print(f"  {sent} sent, {report.failures} failures, {len(report.outages)} outages, "
                  f"{time.perf_counter() - report.started:.0f} s", file=sys.stderr, flush=True)

    for request in cases:
        one(request)
    remaining = requests - len(cases)
    if remaining > 0:
        @seed(seed_)
        @settings(max_examples=remaining, deadline=None, database=None, phases=[Phase.generate],
                  print_blob=False, suppress_health_check=list(HealthCheck))
        @given(any_request(model))
        def generated(request: FuzzRequest) -> None:
            one(request)

        generated()
    return report


def _table(report: FuzzReport, health: str | None) -> str:
    rows: list[tuple[str, Any]] = [("requests sent", sum(report.sent.values()))]
    rows += [(f"  {kind}", n) for kind, n in sorted(report.sent.items())]
    rows += [(f"status {status}", n) for status, n in sorted(report.statuses.items())]
    rows += [("5xx", report.five_xx), ("hangs (> 60 s)", report.hangs),
             ("outages", len(report.outages)), ("failures", report.failures),
             ("failure classes", len(report.classes)),
             ("health after", "ok" if health is None else f"FAILED: {health}"),
             ("wall (s)", f"{time.perf_counter() - report.started:.0f}")]
    if report.stopped:
        rows.append(("stopped", report.stopped))
    return "\n".join(f"{name:<24}{value!s:>12}" for name, value in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (same seed, same "
                        "requests)")
    parser.add_argument("--url", help="a running server (default: start the tiny pair locally)")
    parser.add_argument("--model", help="the served model name (default: /v1/models' first)")
    parser.add_argument("--no-named", action="store_true", help="skip the named cases")
    parser.add_argument("--json", help="also write the JSON result here")
    args = parser.parse_args()

    with _server(args.url) as base, httpx.Client() as client:
        model = args.model or (_served_model(client, base) if args.url else MODEL)
        print(f"fuzzing {base} ({model}): {args.requests} requests, seed {args.seed}",
              file=sys.stderr, flush=True)
        report = fuzz(client, base, model, args.requests, args.seed, not args.no_named)
        health = probe(client, base, model)

    print(f"OpenAI API fuzz ({'--url ' + args.url if args.url else 'tiny pair, TP 1'})")
    print(_table(report, health))
    if report.classes or report.outages:
        print("\n" + "\n".join(report.summary().splitlines()[1:]))
    result = {**report.as_json(), "health_after": "ok" if health is None else health,
              "seed": args.seed, "url": args.url}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if not report.failures and not report.outages and health is None else 1


if __name__ == "__main__":
    sys.exit(main())
