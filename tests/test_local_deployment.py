"""The README's main job: `deployments/local.yaml` served for real, one streamed answer."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema
from tiny_models import stop_ray

from serve_app.demo import LOCAL_YAML, run_demo
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.engines.types import SamplingParams
from serve_app.netutil import free_port
from serve_app.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def test_local_yaml_is_a_valid_serve_config() -> None:
    raw = yaml.safe_load(LOCAL_YAML.read_text())
    ServeDeploySchema.model_validate(raw)
    app = raw["applications"][0]
    assert app["import_path"] == "serve_app.app:build_app"
    assert app["args"]["parallelism"]["tp"] == 2  # TP 2 over two CPU rank slots


def test_demo_streams_an_answer_with_acceptance_stats(capsys: pytest.CaptureFixture[str]) -> None:
    stop_ray()  # the demo starts Ray itself, as a user's first command does
    result: dict[str, Any] = {}
    assert run_demo(max_tokens=48, port=free_port(), result=result) == 0
    printed = capsys.readouterr().out
    usage = result["usage"]
    spec = usage.model_extra
    assert usage.completion_tokens >= 1
    assert spec["spec_accept_length"] == pytest.approx(
        usage.completion_tokens / spec["spec_verify_ct"])
    assert sum(spec["spec_correct_drafts_histogram"]) == spec["spec_verify_ct"]
    assert "spec_accept_length" in printed and result["text"] in printed
    # The served TP-2 answer is what the engine generates in this process (greedy).
    config = result["config"]
    tokenizer = load_tokenizer(config.models.tokenizer_path())
    engine_cfg = config.engine.reference
    engine = build_engine(build_runner(config.models.target_path(), config.models.draft_path(),
                                       engine_cfg), engine_cfg, [tokenizer.eos_token_id],
                          tokenizer.decode)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": result["prompt"]}])
    direct = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=48))[0]
    assert direct.text == result["text"]
    assert direct.completion_tokens == usage.completion_tokens
