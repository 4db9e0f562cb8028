"""The main job on the embedded CPU default: serve `deployments/local.yaml` with Ray Serve, stream
a K3 conversation through the OpenAI API (the reasoning, then the answer; then a request with
tools and tool_choice required, answered by a tool call; then two questions about an image:
its colour, its shape), and
print the speculative-decoding statistics after each."""

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


def _stats(usage: Any, elapsed: float, first: float | None, t0: float, gamma: int) -> None:
    spec = usage.model_extra or {}
    print(f"  completion tokens      {usage.completion_tokens} in {elapsed:.2f} s "
          f"({usage.completion_tokens / elapsed:.1f} tokens/s, first token after "
          f"{((first or t0) - t0) * 1e3:.0f} ms)")
    print(f"  spec_accept_length     {spec.get('spec_accept_length', 0):.2f} tokens per verify "
          f"step (max {gamma + 1})")
    print(f"  spec_accept_rate       {spec.get('spec_accept_rate', 0):.2f}")
    print(f"  spec_verify_ct         {spec.get('spec_verify_ct')}")
    print(f"  accepted-drafts histogram (steps that accepted 0..{gamma} drafts): "
          f"{json.dumps(spec.get('spec_correct_drafts_histogram'))}\n")


def _stream(client: Any, model: str, request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Stream one chat request, printing reasoning and answer as they come; returns what came."""
    t0 = time.perf_counter()
    first, usage, reasoning, text, calls = None, None, "", "", {}
    channel = None
    stream = client.chat.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                            **request)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        think = (delta.model_extra or {}).get("reasoning_content")
        for name, piece in (("thinking", think), ("assistant", delta.content)):
            if piece:
                first = first or time.perf_counter()
                if channel != name:
                    print(f"\n{name}> ", end="")
                    channel = name
                sys.stdout.write(piece)
                sys.stdout.flush()
                if name == "thinking":
                    reasoning += piece
                else:
                    text += piece
        for call in delta.tool_calls or []:
            got = calls.setdefault(call.index, {"name": "", "arguments": ""})
            got["name"] += call.function.name or ""
            got["arguments"] += call.function.arguments or ""
    elapsed = time.perf_counter() - t0
    for call in calls.values():
        print(f"\ntool call> {call['name']}({call['arguments']})", end="")
    print("\n")
    return {"reasoning": reasoning, "text": text, "tool_calls": list(calls.values()),
            "usage": usage, "elapsed": elapsed, "first": first, "t0": t0}


def image_requests(seed: int = 0) -> list[tuple[dict[str, Any], Any]]:
    """Two chat requests about one image, as a client sends them: a held-out synthetic image
    (never trained on) of a coloured shape as a PNG data URL, after the question (the question
    first, as in training): its colour, then its shape. Returns [(request, example)]."""
    from serve_app.synthetic_images import (
        QUESTIONS,
        SyntheticExample,
        heldout_examples,
        png_data_url,
        user_content,
    )

    shape = heldout_examples(seed, 1, ("shape",))[0]
    colour = SyntheticExample("colour", QUESTIONS["colour"], dict(shape.attributes)["colour"],
                              shape.image, shape.attributes)
    url = png_data_url(shape.image)
    return [({"messages": [{"role": "user", "content": user_content(example, url)}], "seed": 1},
             example) for example in (colour, shape)]


def _image_turns(client: Any, model: str, max_tokens: int, gamma: int) -> list[dict[str, Any]]:
    """The image questions, streamed; a server without image input answers 400, which is
    printed (with what the image shows) instead of an answer."""
    import openai

    turns = []
    for request, example in image_requests():
        url = request["messages"][0]["content"][1]["image_url"]["url"]
        drawn = dict(example.attributes)
        print(f"\nuser> {example.question}\n[image] {example.image.width}x"
              f"{example.image.height} PNG, {len(url):,}-character data URL (held-out synthetic "
              f"image; drawn: a {drawn['shape']} in {drawn['colour']})", end="")
        try:
            turn = _stream(client, model, request, max_tokens)
        except openai.BadRequestError as exc:
            print(f"\nthe server refused the image ({exc.status_code}): {exc.message}\n")
            turns.append({"request": request, "expected": example.answer,
                          "refused": exc.message})
            continue
        if turn["usage"] is not None:
            _stats(turn["usage"], turn["elapsed"], turn["first"], turn["t0"], gamma)
        right = turn["text"].strip().rstrip(".").lower() == example.answer
        print(f"  answer {'matches' if right else 'differs from'} the drawn {example.kind} "
              f"({example.answer})\n")
        turns.append({"request": request, "expected": example.answer, **turn})
    return turns


def run_demo(max_tokens: int = 256, port: int | None = None,
             result: dict[str, Any] | None = None) -> int:
    """Returns the exit status; `result`, if given, receives each turn's request and what came
    back (reasoning, text, tool calls, usage with the speculative statistics)."""
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
    from serve_app.embedded import heldout_prompts

    deployment = _local_config()
    app_spec = deployment["applications"][0]
    config = AppConfig.model_validate(app_spec["args"])
    http = dict(deployment.get("http_options", {}))
    if port is not None:
        http["port"] = port
    # Two held-out conversations (never trained on): a question answered after thinking, then
    # a request that must call one of its tools.
    held = heldout_prompts()["conversations"]
    # Seeded: K3 samples (T 1.0 while thinking), and the demo shows the same answers each run.
    turns = [{**next(c["request"] for c in held if c["kind"] == kind), "seed": 1}
             for kind in ("code", "tool_required")]
    gamma = config.engine.reference.speculation.gamma or 7

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
        print(f"serving at {base} (ready in {time.perf_counter() - started:.1f} s)")
        client = openai.OpenAI(base_url=base, api_key="local", max_retries=0)
        got = []
        for request in turns:
            for tool in request.get("tools", []):
                print(f"\n[tool] {tool['function']['name']}: {tool['function']['description']}",
                      end="")
            if "tool_choice" in request:
                print(f"\n[tool_choice] {request['tool_choice']}", end="")
            print(f"\nuser> {request['messages'][-1]['content']}", end="")
            turn = _stream(client, config.models.served_model_name, request, max_tokens)
            got.append({"request": request, **turn})
            if turn["usage"] is None:
                print("no usage returned", file=sys.stderr)
                return 1
            _stats(turn["usage"], turn["elapsed"], turn["first"], turn["t0"], gamma)
        images = _image_turns(client, config.models.served_model_name, max_tokens, gamma)
        if result is not None:
            result.update(turns=got, image_turns=images, config=config)
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
