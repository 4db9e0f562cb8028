"""docs/request-path.md lists every module a chat request executes: one request, traced in
every process of a cluster serving deployments/local.yaml, against the doc's list, both ways.
A refactor that puts a module on a request's path, or takes one off, without saying so in the
doc fails here, naming the module."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray_cluster("own")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "request-path.md"
DOC_SECTION = "## Every module a chat request executes"


def documented_modules() -> set[str]:
    """The `serve_app/...py` files the doc's section lists."""
    text = DOC.read_text()
    section = text[text.index(DOC_SECTION):]
    end = section.find("\n## ", len(DOC_SECTION))
    section = section if end < 0 else section[:end]
    return set(re.findall(r"`(serve_app/[\w/]+\.py)`", section))


def traced_request_modules(folder: Path) -> set[str]:
    """The serve_app modules (package __init__ files aside) that every process of a cluster
    serving deployments/local.yaml executes while answering one chat request: streamed,
    with tools and tool_choice required (a grammar), speculation on (it decodes alone)."""
    import openai
    import yaml
    from module_trace import ENV, modules
    from tiny_models import TESTS, _start_local_serve, stop_ray, wait_for

    from serve_app.app import build_app
    from serve_app.demo import LOCAL_YAML

    args = yaml.safe_load(LOCAL_YAML.read_text())["applications"][0]["args"]
    stop_ray()
    try:
        port = _start_local_serve(runtime_env={
            "worker_process_setup_hook": "module_trace.install",
            "env_vars": {"PYTHONPATH": str(TESTS), ENV: str(folder)}})
        from ray import serve

        serve.run(build_app(args), name="kimi", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]

        model = args["models"]["served_model_name"]
        # The router has heard from the replica, every process has imported what it needs;
        # the traced request's grammar is still to be compiled, as a new request's is.
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
        (folder / "on").touch()
        time.sleep(0.5)  # every process has seen it
        chunks = list(client.chat.completions.create(
            model=model, stream=True, max_tokens=48, stream_options={"include_usage": True},
            tools=tools, tool_choice="required", seed=7,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}]))
        (folder / "dump").touch()
        assert chunks[-1].usage.model_extra["spec_verify_ct"] >= 1  # it speculated
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        dumps = wait_for(lambda: _settled(folder), timeout=30, interval=0.5)
        assert dumps, "no process wrote its trace"
    finally:
        stop_ray()
    executed: set[str] = set()
    for dump in dumps:
        executed |= modules(json.loads(dump.read_text()), ROOT)
    return {m for m in executed if not m.endswith("__init__.py")}


def _settled(folder: Path, seen: list[int] = []) -> list[Path]:  # noqa: B006
    """The dumps, once their number has stopped growing for a poll."""
    dumps = sorted(folder.glob("*.json"))
    seen.append(len(dumps))
    return dumps if len(seen) > 2 and seen[-1] == seen[-2] == seen[-3] > 0 else []


def test_the_doc_lists_every_module_a_chat_request_executes(tmp_path: Path) -> None:
    """A refactor that puts a module on a request's path, or takes one off, without saying so
    in docs/request-path.md fails here, naming the module."""
    executed = traced_request_modules(tmp_path)
    documented = documented_modules()
    assert not executed - documented, f"executed, not in the doc: {sorted(executed - documented)}"
    assert not documented - executed, f"in the doc, not executed: {sorted(documented - executed)}"
