"""The README's main job: `deployments/local.yaml` served for real, one streamed answer."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema
from spec_helpers import generate_tensor_parallel
from tiny_models import stop_ray

from serve_app.chat.formats import chat_format_for
from serve_app.chat.parameters import K3_TEMPERATURE, K3_TOP_P
from serve_app.demo import LOCAL_YAML, run_demo
from serve_app.embedded import chat_prompt_ids
from serve_app.netutil import free_port
from serve_app.protocol.generation import SamplingParams
from serve_app.protocol.openai import ChatCompletionRequest
from serve_app.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster("own")]


# Enough for the retrained pair's thinking, then its answer or its forced call.
MAX_TOKENS = 160


def test_local_yaml_is_a_valid_serve_config() -> None:
    raw = yaml.safe_load(LOCAL_YAML.read_text())
    ServeDeploySchema.model_validate(raw)
    app = raw["applications"][0]
    assert app["import_path"] == "serve_app.app:build_app"
    assert app["args"]["parallelism"]["tp"] == 2  # TP 2 over two CPU rank slots


def test_demo_streams_a_k3_conversation_with_acceptance_stats(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first command: a held-out K3 conversation streamed (reasoning, then the
    answer), then a request with tools and tool_choice required answered by a call of a
    declared tool, then an image's colour and shape; acceptance statistics after each; the
    served TP-2 answers are what a TP-2 engine outside Serve generates from the same prompt ids
    and seed."""
    stop_ray()  # the demo starts Ray itself, as a user's first command does
    result: dict[str, Any] = {}
    assert run_demo(max_tokens=MAX_TOKENS, port=free_port(), result=result) == 0
    printed = capsys.readouterr().out
    colour, shape = result["image_turns"]
    # Then two questions about one held-out synthetic image, its colour and its shape: each
    # answered with its statistics (the server takes image input). The embedded target names
    # held-out colours and shapes (its card: 92% / 94% of 50 at K3's thinking parameters, what
    # the demo samples at), so both answers are checked.
    assert printed.count("spec_accept_length") == 4
    assert "refused" not in colour and "refused" not in shape
    for turn in (colour, shape):
        question, picture = turn["request"]["messages"][0]["content"]
        assert question["type"] == "text" and picture["type"] == "image_url"
        assert picture["image_url"]["url"].startswith("data:image/png;base64,")
    assert colour["request"]["messages"][0]["content"][1] == picture
    assert f"drawn: a {shape['expected']} in {colour['expected']}" in printed
    for turn in (colour, shape):
        assert turn["text"].strip().rstrip(".").lower() == turn["expected"], turn["text"]
    config = result["config"]
    tokenizer = load_tokenizer(config.models.tokenizer_path())
    fmt = chat_format_for(tokenizer, config.api.tool_strict_level)  # as the ingress plans
    plans = [fmt.plan(ChatCompletionRequest.model_validate({"model": "m", **turn["request"]}))
             for turn in result["turns"]]
    # The served replica's engine again, at its TP (2): sampling seeded, so the same tokens.
    direct = generate_tensor_parallel(
        (config.models.target_path(), config.models.draft_path()), config.engine.reference,
        config.models.tokenizer_path(),
        [(chat_prompt_ids(tokenizer, turn["request"]), SamplingParams(
            temperature=K3_TEMPERATURE[plan.k3.thinking], top_p=K3_TOP_P,
            max_tokens=MAX_TOKENS, seed=turn["request"]["seed"], grammar=plan.grammar))
         for turn, plan in zip(result["turns"], plans, strict=True)],
        world=config.parallelism.tp)
    for turn, plan, out in zip(result["turns"], plans, direct, strict=True):
        usage = turn["usage"]
        spec = usage.model_extra
        assert usage.completion_tokens >= 1
        assert spec["spec_accept_length"] == pytest.approx(
            usage.completion_tokens / spec["spec_verify_ct"])
        assert sum(spec["spec_correct_drafts_histogram"]) == spec["spec_verify_ct"]
        output = fmt.output(plan)
        output.parser.feed(out.token_ids)  # type: ignore[attr-defined]
        output.parser.finish()  # type: ignore[attr-defined]
        assert (output.parser.reasoning, output.parser.content) == (  # type: ignore[attr-defined]
            turn["reasoning"], turn["text"])
        assert out.completion_tokens == usage.completion_tokens
    first, second = result["turns"]
    assert first["reasoning"] and first["reasoning"] in printed
    declared = {t["function"]["name"] for t in second["request"]["tools"]}
    assert second["request"]["tool_choice"] == "required"
    assert second["tool_calls"] and {c["name"] for c in second["tool_calls"]} <= declared
