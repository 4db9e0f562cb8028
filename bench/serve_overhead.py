"""What the Serve path costs on top of the engine, side by side in one run.

Variants (all on this machine, sequential requests, medians and p99 over N requests):
  - engine:  a direct in-process call of the async engine (1 generated token);
  - echo:    a plain two-deployment Ray Serve app (FastAPI ingress -> handle -> back, no model),
             the floor any Serve app pays;
  - http:    the full OpenAI HTTP path of this app (1 generated token, non-streaming);
  - stream:  time to first token and per-chunk gaps of a streamed completion, HTTP vs engine;
  - stub:    this app's ingress in front of a stand-in target whose "engine" is --stub-ms of
             Python work on a thread, against work_floor: the plain two-deployment app with the
             same stand-in. Their difference is what this app's own ingress code costs, apart
             from the engine and apart from Serve.

Goal: http_p50 - engine_p50 <= 1.2 x echo_p50.

    python bench/serve_overhead.py [--requests 100] [--json out.json] [--pair embedded|random]
"""


import argparse
import asyncio
import http.server
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from serve_app.netutil import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))



def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
            "n": len(ordered)}


def _echo_app() -> Any:
    from fastapi import FastAPI, Request
    from ray import serve

    echo_api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Echo:
        def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
            return payload

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    @serve.ingress(echo_api)
    class EchoIngress:
        def __init__(self, echo: Any) -> None:
            self.echo = echo

        @echo_api.post("/")
        async def root(self, request: Request) -> dict[str, Any]:
            return await self.echo.remote(await request.json())

    return EchoIngress.bind(Echo.bind())


def _busy(ms: float) -> None:
    until = time.perf_counter() + ms / 1e3
    while time.perf_counter() < until:
        pass


def _stub_apps(stub_ms: float, raw_config: dict[str, Any]) -> tuple[Any, Any]:
    """(work_floor, stub): the same stand-in target behind a bare FastAPI ingress and behind
    this app's OpenAIIngress (router off: the stand-in has no KV to route by)."""
    from fastapi import FastAPI, Request
    from ray import serve

    from serve_app.protocol.generation import RequestOutput
    from serve_app.serving.ingress import OpenAIIngress

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class StandInTarget:
        async def generate(self, request: Any) -> Any:
            await asyncio.to_thread(_busy, stub_ms)
            yield RequestOutput(request.request_id, [5], "x", True, "length",
                                len(request.prompt_ids), 1)

        async def health_status(self) -> dict[str, Any]:
            return {"ok": True}

    floor_api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    @serve.ingress(floor_api)
    class FloorIngress:
        def __init__(self, target: Any) -> None:
            self.generate = target.options(stream=True).generate

        @floor_api.post("/")
        async def root(self, request: Request) -> dict[str, Any]:
            payload = await request.json()
            out = await self.generate.remote(_Prompt("r", [1, 2, 3])).__anext__()
            return {"text": out.text, "echo": payload}

    stub = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                            ray_actor_options={"num_cpus": 0.1})
    return (FloorIngress.bind(StandInTarget.bind()),
            stub.bind(StandInTarget.bind(), raw_config))


class _Prompt:
    def __init__(self, request_id: str, prompt_ids: list[int]) -> None:
        self.request_id, self.prompt_ids = request_id, prompt_ids


def _model_paths(pair: str, tmp: Path) -> dict[str, Path]:
    from serve_app.embedded import DRAFT, TARGET, TOKENIZER

    if pair == "embedded":
        return {"target": TARGET, "draft": DRAFT, "tokenizer": TOKENIZER}
    from tiny_models import write_tiny_serving_pair

    paths = write_tiny_serving_pair(tmp)
    return {**paths, "tokenizer": paths["target"]}


class _Sink(http.server.BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP exports and drops them: the cost measured is the app's, not a
    collector's."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _measure_serve(config: Any, prompt: str, args: argparse.Namespace,
                   tracing: bool) -> dict[str, Any]:
    """The HTTP path on a cluster of its own (tracing on: every process of it exports to a
    local sink); tracing off, also the floors (echo, stand-in), the stub and a stream."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.observability.tracing import TracingConfig, tracing_env

    sink = None
    env: dict[str, str] = {}
    if tracing:
        sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        env = tracing_env(TracingConfig(
            exporter="otlp_http", sampling_ratio=1.0,
            endpoint=f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"))
    os.environ.update(env)  # inherited by every process of the new cluster
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="kimi", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        results: dict[str, Any] = {}
        body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            def timed(url: str, payload: dict[str, Any]) -> list[float]:
                samples = []
                for i in range(args.requests + 5):
                    t0 = time.perf_counter()
                    client.post(url, json=payload).raise_for_status()
                    if i >= 5:
                        samples.append(time.perf_counter() - t0)
                return samples

            # Before the other apps start: tracing on and off, the cluster is the same.
            results["http"] = timed(base + "/v1/completions", body)
            if not tracing:
                serve.run(_echo_app(), name="echo", route_prefix="/echo")
                stub_config = json.loads(config.model_copy(update={
                    "router": config.router.model_copy(update={"policy": "ray_default"})
                }).model_dump_json())
                floor_app, stub_app = _stub_apps(args.stub_ms, stub_config)
                serve.run(floor_app, name="work_floor", route_prefix="/work_floor")
                serve.run(stub_app, name="stub", route_prefix="/stub")
                results["echo"] = timed(base + "/echo/", {"x": 1})
                results["work_floor"] = timed(base + "/work_floor/", {"x": 1})
                results["stub"] = timed(base + "/stub/v1/completions", body)
                stream_body = {**body, "max_tokens": args.stream_tokens, "stream": True,
                               "ignore_eos": True}
                marks = results["marks"] = []
                t0 = time.perf_counter()
                with client.stream("POST", base + "/v1/completions",
                                   json=stream_body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            marks.append(time.perf_counter() - t0)
        serve.shutdown()
        ray.shutdown()
    finally:
        for key in env:
            os.environ.pop(key, None)
        if sink is not None:
            sink.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--stub-ms", type=float, default=10.0,
                        help="the stand-in target's work per request (about the engine's)")
    parser.add_argument("--pair", choices=["embedded", "random"], default="embedded")
    parser.add_argument("--json")
    args = parser.parse_args()

    from serve_app.config import AppConfig
    from serve_app.engines.reference.async_engine import ReferenceAsyncEngine
    from serve_app.engines.reference.builder import build_engine, build_runner
    from serve_app.protocol.generation import GenerateRequest, SamplingParams
    from serve_app.tokenizer import load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    paths = _model_paths(args.pair, tmp)
    if args.pair == "embedded" and not (paths["target"] / "config.json").exists():
        sys.exit("the embedded pair is not in serve_app/assets yet; use --pair random")
    config = AppConfig.model_validate({
        "models": {"target": str(paths["target"]), "draft": str(paths["draft"]),
                   "tokenizer": str(paths["tokenizer"]), "served_model_name": "bench"},
        "engine": {"reference": {"kv_capacity_tokens": 8192}},
        "parallelism": {"tp": 1},
        "placement": {"accelerator": "CPU", "cpus_per_rank": 0.5},
    })
    tokenizer = load_tokenizer(paths["tokenizer"])
    prompt = "def main():"
    prompt_ids = tokenizer.encode(prompt)
    one = SamplingParams(temperature=0.0, max_tokens=1)

    # --- engine, in-process ---
    runner = build_runner(paths["target"], paths["draft"], config.engine.reference)
    engine = ReferenceAsyncEngine(build_engine(runner, config.engine.reference,
                                               [tokenizer.eos_token_id], tokenizer.decode))

    async def engine_times() -> tuple[list[float], dict[str, Any]]:
        samples = []
        for i in range(args.requests + 5):
            t0 = time.perf_counter()
            async for _ in engine.generate(GenerateRequest(f"e{i}", prompt_ids, one)):
                pass
            if i >= 5:
                samples.append(time.perf_counter() - t0)
        stream_params = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens,
                                       ignore_eos=True)
        t0 = time.perf_counter()
        marks = []
        async for _ in engine.generate(GenerateRequest("es", prompt_ids, stream_params)):
            marks.append(time.perf_counter() - t0)
        return samples, {"ttft_ms": marks[0] * 1e3,
                         "chunk_gap_ms": statistics.median(
                             [b - a for a, b in itertools.pairwise(marks)] or [0]) * 1e3,
                         "chunks": len(marks)}

    engine_samples, engine_stream = asyncio.run(engine_times())
    asyncio.run(engine.shutdown())

    # --- Serve: echo floor and the full HTTP path, tracing off then on ---
    results: dict[str, Any] = {"pair": args.pair, "requests": args.requests}
    off = _measure_serve(config, prompt, args, tracing=False)
    on = _measure_serve(config, prompt, args, tracing=True)
    echo, full, marks = off["echo"], off["http"], off["marks"]
    results["tracing"] = {
        "off": _summary(off["http"]), "on": _summary(on["http"]),
        "exporter": "otlp_http to a local sink, sampling 1.0",
    }
    results["tracing"]["p50_ratio"] = (results["tracing"]["on"]["p50_ms"]
                                       / results["tracing"]["off"]["p50_ms"])

    results["engine"] = _summary(engine_samples)
    results["echo"] = _summary(echo)
    results["http"] = _summary(full)
    overhead = results["http"]["p50_ms"] - results["engine"]["p50_ms"]
    results["http_overhead_p50_ms"] = overhead
    results["work_floor"] = _summary(off["work_floor"])
    results["stub"] = _summary(off["stub"])
    results["ingress_code_p50_ms"] = results["stub"]["p50_ms"] - results["work_floor"]["p50_ms"]
    results["overhead_over_echo_floor"] = overhead / results["echo"]["p50_ms"]
    results["stream"] = {
        "engine": engine_stream,
        "http": {"ttft_ms": marks[0] * 1e3,
                 "chunk_gap_ms": statistics.median(
                     [b - a for a, b in itertools.pairwise(marks)]) * 1e3,
                 "chunks": len(marks)},
    }
    results["stream"]["ttft_overhead_ms"] = (results["stream"]["http"]["ttft_ms"]
                                             - engine_stream["ttft_ms"])

    print(f"Serve overhead ({args.pair} pair, {args.requests} sequential requests, 1 token)")
    print(f"{'path':<28}{'p50 ms':>10}{'p99 ms':>10}")
    for name in ("engine", "echo", "http"):
        r = results[name]
        print(f"{name:<28}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}")
    print(f"{'http - engine (p50)':<28}{overhead:>10.2f}")
    print(f"{'(http - engine) / echo':<28}{results['overhead_over_echo_floor']:>10.2f}"
          "   goal <= 1.2")
    for name in ("work_floor", "stub"):
        r = results[name]
        print(f"{name + f' ({args.stub_ms:g} ms stand-in)':<28}{r['p50_ms']:>10.2f}"
              f"{r['p99_ms']:>10.2f}")
    print(f"{'stub - work_floor (p50)':<28}{results['ingress_code_p50_ms']:>10.2f}"
          "   this app's ingress code")
    s = results["stream"]
    print(f"{'stream TTFT engine / http':<28}{s['engine']['ttft_ms']:>10.2f}"
          f"{s['http']['ttft_ms']:>10.2f}")
    print(f"{'chunk gap engine / http':<28}{s['engine']['chunk_gap_ms']:>10.2f}"
          f"{s['http']['chunk_gap_ms']:>10.2f}")
    t = results["tracing"]
    print(f"{'http, tracing on (p50/p99)':<28}{t['on']['p50_ms']:>10.2f}{t['on']['p99_ms']:>10.2f}")
    print(f"{'tracing on / off (p50)':<28}{t['p50_ratio']:>10.2f}   goal < 1.10")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
