"""The main job on the embedded CPU default: serve `deployments/local.yaml` with Ray Serve, stream
one chat answer through the OpenAI API, and print its speculative-decoding statistics."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

LOCAL_YAML = Path(__file__).resolve().parents[1] / "deployments" / "local.yaml"


def _local_config() -> dict[str, Any]:
    """The local deployment file; installed without the repo, the same values built in."""
    if LOCAL_YAML.exists():
        return yaml.safe_load(LOCAL_YAML.read_text())
    from serve_app.embedded import DRAFT, TARGET, TOKENIZER

    return {"http_options": {"host": "127.0.0.1", "port": 8000}, "applications": [{
        "name": "kimi", "route_prefix": "/", "args": {
            "models": {"target": str(TARGET), "draft": str(DRAFT), "tokenizer": str(TOKENIZER),
                       "served_model_name": "kimi-k3-mini-dspark"},
            "parallelism": {"tp": 2},
            "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25}}}]}


def run_demo(prompt: str | None = None, max_tokens: int = 160, port: int | None = None,
             result: dict[str, Any] | None = None) -> int:
    """Returns the exit status; `result`, if given, receives the prompt, the streamed text and
    the usage (with the speculative statistics)."""
    # A local, single-machine cluster: no token authentication (set explicitly, see README).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Serve's 5 s proxy readiness check is tight on a small, busy laptop (the proxy is killed
    # and restarted in a loop); every Ray process started below inherits this.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    import openai
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppConfig
    from serve_app.embedded import heldout_prompt_texts

    deployment = _local_config()
    app_spec = deployment["applications"][0]
    config = AppConfig.model_validate(app_spec["args"])
    http = dict(deployment.get("http_options", {}))
    if port is not None:
        http["port"] = port
    prompt = prompt or heldout_prompt_texts()["chat"][0]

    print(f"starting Ray Serve with {LOCAL_YAML.name}: {config.models.served_model_name}, "
          f"reference engine, TP {config.parallelism.tp}, speculation "
          f"{'on' if config.engine.reference.speculation.enabled else 'off'}", flush=True)
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=http)
        started = time.perf_counter()
        serve.run(build_app(config), name=app_spec.get("name", "kimi"),
                  route_prefix=app_spec.get("route_prefix", "/"))
        base = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}/v1"
        print(f"serving at {base} (ready in {time.perf_counter() - started:.1f} s)\n")
        client = openai.OpenAI(base_url=base, api_key="local", max_retries=0)
        print(f"user> {prompt}\nassistant> ", end="", flush=True)
        t0 = time.perf_counter()
        first = None
        usage = None
        text = ""
        stream = client.chat.completions.create(
            model=config.models.served_model_name, messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
                sys.stdout.write(chunk.choices[0].delta.content)
                sys.stdout.flush()
            if chunk.usage is not None:
                usage = chunk.usage
        elapsed = time.perf_counter() - t0
        print("\n")
        if result is not None:
            result.update(prompt=prompt, text=text, usage=usage, config=config)
        if usage is None:
            print("no usage returned", file=sys.stderr)
            return 1
        spec = usage.model_extra or {}
        print(f"completion tokens      {usage.completion_tokens} in {elapsed:.2f} s "
              f"({usage.completion_tokens / elapsed:.1f} tokens/s, first token after "
              f"{((first or t0) - t0) * 1e3:.0f} ms)")
        print(f"spec_accept_length     {spec.get('spec_accept_length', 0):.2f} tokens per verify "
              f"step (max {(config.engine.reference.speculation.gamma or 7) + 1})")
        print(f"spec_accept_rate       {spec.get('spec_accept_rate', 0):.2f}")
        print(f"spec_verify_ct         {spec.get('spec_verify_ct')}")
        print(f"accepted-drafts histogram (steps that accepted 0..7 drafts): "
              f"{json.dumps(spec.get('spec_correct_drafts_histogram'))}")
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
