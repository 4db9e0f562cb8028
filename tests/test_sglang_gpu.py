"""The SGLang backend for real, on local GPUs: the target deployment (TargetReplica, backend
'sglang') on its placement group, a streamed answer, acceptance statistics, capacity, health,
and abort on disconnect. Skipped without CUDA or without the checkpoints.

    KIMI_SGLANG_TARGET=/models/Kimi-K3 KIMI_SGLANG_DRAFT=/models/Kimi-K3-DSpark \
    KIMI_SGLANG_GPU_TYPE=H200 pytest -m gpu tests/test_sglang_gpu.py

Optional: KIMI_SGLANG_TP (default: every visible GPU, one node), KIMI_SGLANG_CONTEXT (default
32768, enough for the test and quick to start), KIMI_SGLANG_EXTRA (JSON extra_server_args).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.ray_cluster("own"),
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (os.environ.get("KIMI_SGLANG_TARGET")
                            and os.environ.get("KIMI_SGLANG_DRAFT")),
                       reason="set KIMI_SGLANG_TARGET and KIMI_SGLANG_DRAFT"),
]


@pytest.fixture(scope="module")
def target() -> Any:
    import ray
    from ray import serve
    from tiny_models import stop_ray

    from serve_app.app import validate
    from serve_app.config import AppConfig
    from serve_app.engines.sglang.args import runtime_env_vars
    from serve_app.serving.target import TargetReplica

    tp = int(os.environ.get("KIMI_SGLANG_TP", torch.cuda.device_count()))
    config = AppConfig.model_validate({
        "models": {"target": os.environ["KIMI_SGLANG_TARGET"],
                   "draft": os.environ["KIMI_SGLANG_DRAFT"]},
        "engine": {"backend": "sglang", "startup_timeout_s": 3600, "sglang": {
            "context_length": int(os.environ.get("KIMI_SGLANG_CONTEXT", 32768)),
            "extra_server_args": json.loads(os.environ.get("KIMI_SGLANG_EXTRA", "{}"))}},
        "parallelism": {"tp": tp, "ep": tp},
        "placement": {"accelerator": "GPU",
                      "gpu_type": os.environ.get("KIMI_SGLANG_GPU_TYPE", "H200")},
    })
    validate(config)
    env = runtime_env_vars(config)
    stop_ray()
    ray.init(runtime_env={"env_vars": env}, log_to_driver=True)
    os.environ.update(env)
    # The target deployment exactly as build_app configures it (the ingress needs a
    # tokenizer.json folder, which SGLang checkpoints need not ship; ids go in directly here).
    deployment = serve.deployment(TargetReplica, name="TargetDeployment").options(
        ray_actor_options={"num_cpus": 1, "num_gpus": 0},
        placement_group_bundles=config.bundles(), placement_group_strategy=config.strategy,
        health_check_timeout_s=120)
    serve.run(deployment.bind(json.loads(config.model_dump_json())), name="kimi",
              route_prefix=None)
    try:
        yield serve.get_deployment_handle("TargetDeployment", app_name="kimi"), config
    finally:
        stop_ray()


def test_stream_spec_stats_capacity_health_abort(target: Any) -> None:
    from serve_app.protocol.generation import GenerateRequest, SamplingParams

    handle, _ = target
    capacity = handle.capacity.remote().result()
    assert capacity["kv_tokens_total"] > 0 and capacity["kv_tokens_used"] == 0

    # Token ids of a short prompt are model-specific; any in-vocabulary ids give an answer.
    prompt = [163584, 100, 2000, 3000, 4000, 5000]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def collect(rid: str, stop_after: int | None = None) -> list[Any]:
        outs = []
        stream = handle.options(stream=True).generate.remote(GenerateRequest(rid, prompt, params))
        async for out in stream:
            outs.append(out)
            if stop_after is not None and len(outs) >= stop_after:
                stream.cancel()
                break
        return outs

    outs = asyncio.run(collect("gpu-0"))
    assert len(outs) > 1  # streamed, not one blob
    last = outs[-1]
    assert last.finished and last.finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == last.completion_tokens == 64
    assert "".join(o.text for o in outs)
    spec = last.spec
    assert spec is not None and spec["spec_verify_ct"] >= 1
    # SGLang's accept length is the answer's tokens per verify step, and every verify step
    # lands in the histogram once.
    assert spec["spec_accept_length"] == pytest.approx(64 / spec["spec_verify_ct"])
    assert sum(spec["spec_correct_drafts_histogram"]) == spec["spec_verify_ct"]
    stats = handle.stats.remote().result()
    assert stats["spec_verify_ct"] >= spec["spec_verify_ct"]

    handle.check_health.remote().result()

    # Client gone after two chunks: the request is aborted and its KV accounted free.
    asyncio.run(collect("gpu-1", stop_after=2))
    for _ in range(50):
        if handle.stats.remote().result()["running"] == 0:
            break
        time.sleep(0.2)
    assert handle.stats.remote().result()["running"] == 0
    assert handle.capacity.remote().result()["kv_tokens_used"] == 0


def test_images_reach_sglangs_tower(target: Any) -> None:
    """Two chats with one synthetic image each (a red circle, a blue square on white), planned
    by the ingress's own renderer and vision package from the checkpoint folder, sent with
    their images: SGLang's K3 processor and tower answer each with its colour (instant mode,
    greedy), and the two prompts' ids differ only inside their pad runs."""
    import random

    from serve_app.chat.formats import K3Format
    from serve_app.chat.segments import encode_prompt
    from serve_app.protocol.generation import GenerateRequest, SamplingParams
    from serve_app.protocol.openai import ChatCompletionRequest
    from serve_app.synthetic_images import QUESTIONS, draw_shape, png_data_url
    from serve_app.tokenizer import load_tokenizer
    from serve_app.vision import ImagePolicy, MediaConfig, load_images

    handle, _ = target
    folder = os.environ["KIMI_SGLANG_TARGET"]
    tok = load_tokenizer(folder)
    media = MediaConfig.from_folder(folder)
    assert media is not None, "the checkpoint has no preprocessor_config.json"
    answers = {}
    for shape, colour in (("circle", "red"), ("square", "blue")):
        url = png_data_url(draw_shape(shape, colour, random.Random(7)))
        body = ChatCompletionRequest.model_validate({
            "model": "kimi-k3", "thinking": {"type": "disabled"}, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": QUESTIONS["colour"] + " Answer with one word."},
                    {"type": "image_url", "image_url": {"url": url}}]}]})
        plan = K3Format(tok, vision=True).plan(body)
        images = asyncio.run(load_images(plan.images, ImagePolicy(), media))
        ids, offsets = encode_prompt(tok, plan.segments, images)
        request = GenerateRequest(f"gpu-image-{colour}", ids,
                                  SamplingParams(temperature=0.0, max_tokens=32),
                                  images=tuple(i.at(o) for i, o in zip(images, offsets,
                                                                       strict=True)))

        async def answer(request: GenerateRequest = request) -> str:
            text = ""
            async for out in handle.options(stream=True).generate.remote(request):
                text += out.text
            return text

        answers[colour] = asyncio.run(answer()).lower()
    for colour, text in answers.items():
        assert colour in text, answers
