"""Hostile input and faults in the reference engine: sampling that cannot fail on any accepted
parameter, requests refused up front, one request's failure isolated from its batch, engine
faults and a hung step (the watchdog) failing every stream with a client-safe message.

Engine-only: no Ray. Every `asyncio.wait_for(..., HANG_GUARD_S)` below is a guard that turns
a hang into a failure, not a latency check, and the watchdog runs on the test's clock
(HeldClock): no test depends on how fast this machine is."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import tiny_k3_config, write_random_k3_pair, write_tiny_pair

import serve_app.engines.reference.sequence as sequence_module
from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.engines.reference.async_engine import ReferenceAsyncEngine
from serve_app.engines.reference.builder import (
    build_engine,
    build_runner,
)
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import (
    SamplingParams,
    sample_token,
    target_probs,
    verify_drafts,
)
from serve_app.engines.reference.sequence import Sequence
from serve_app.protocol.generation import (
    EngineUnavailable,
    GenerateRequest,
    RequestFailed,
    RequestOutput,
)
from serve_app.protocol.media import ImageInput

HANG_GUARD_S = 120.0
VOCAB = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

HOSTILE_TEMPERATURES = [1e-38, 5e-324, 1e-300, 1e-6, 1e-5, 2.0]
HOSTILE_TOP_P = [1e-300, 5e-324, 1e-6, 1.0]
HOSTILE_TOP_K = [0, 1, 3, 10**18]
HOSTILE_SEEDS = [-(2**63), 2**63 - 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny K3-layout pair: a failure must also leave the KDA state slots exact."""
    return write_random_k3_pair(tmp_path_factory.mktemp("k3"), tiny_k3_config(64))


def detok(ids: list[int]) -> str:
    return "".join(chr(48 + i) for i in ids)


def engine_from(pair: tuple[Path, Path], speculative: bool = True, adaptive: bool = True,
                **kwargs: Any) -> EngineCore:
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, speculation=SpeculationConfig(
        enabled=speculative, adaptive=adaptive))
    runner = build_runner(pair[0], pair[1] if speculative else None, cfg)
    return build_engine(runner, cfg, **kwargs)


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, RequestOutput]:
    """Run to completion; the final output of each request, with all its tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    final: dict[str, RequestOutput] = {}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                out.token_ids = tokens[out.request_id]
                final[out.request_id] = out
    return final


def assert_client_safe(message: str) -> None:
    """No reprs, paths or addresses: the message is shown to clients."""
    for leak in ("Error(", "Exception", "Traceback", "/", "\\", "0x", "<", "'"):
        assert leak not in message, (leak, message)


# --- sampling that cannot fail -----------------------------------------------------------------


def hostile_logits(rows: int, seed: int) -> torch.Tensor:
    """Wide-ranged logits (a tiny temperature multiplies them by up to 1e38) with ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 30
    logits[:, 5] = logits[:, 7] = logits.amax(-1) + 1  # a tie for the maximum
    return logits


@pytest.mark.parametrize("temperature", HOSTILE_TEMPERATURES)
@pytest.mark.parametrize("top_p", HOSTILE_TOP_P)
def test_hostile_params_give_valid_tokens(temperature: float, top_p: float) -> None:
    logits = hostile_logits(4, seed=0)
    drafts = [5, 7, 11]
    q_rows = {
        "one-hot": None,
        "softmax": torch.softmax(torch.randn(3, VOCAB), -1),
        "nan": torch.full((3, VOCAB), float("nan")),
        "negative": -torch.softmax(torch.randn(3, VOCAB), -1),
    }
    for top_k in HOSTILE_TOP_K:
        for seed in HOSTILE_SEEDS:
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed)
            g = torch.Generator().manual_seed(seed)
            if not params.greedy:
                p = target_probs(logits, params)
                assert bool(torch.isfinite(p).all())
                assert torch.allclose(p.sum(-1), torch.ones(4))
                # A most likely token (5 and 7 tie) keeps its probability.
                top = logits == logits.amax(-1, keepdim=True)
                assert bool(((p * top).sum(-1) > 0).all())
            for row in logits:
                assert 0 <= sample_token(row, params, g) < VOCAB
            for q in q_rows.values():
                verdict = verify_drafts(logits, drafts, q, params, g)
                assert 0 <= verdict.accepted <= len(drafts)
                assert len(verdict.tokens) == verdict.accepted + 1
                assert all(0 <= t < VOCAB for t in verdict.tokens)


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-300, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    assert not SamplingParams(temperature=1e-5).greedy  # the epsilon itself samples
    logits = hostile_logits(8, seed=1)
    g = torch.Generator().manual_seed(1)
    assert [sample_token(r, params, g) for r in logits] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45])
def test_a_tiny_top_p_keeps_exactly_the_top_token(top_p: float) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_a_nan_draft_row_is_a_rejection_and_stays_exact() -> None:
    """q = NaN: the draft is rejected and the token drawn from p alone, distributed as p."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits, params)[0]
    q = torch.full((1, 8), float("nan"))
    n = 4000
    samples = []
    for seed in range(n):
        verdict = verify_drafts(logits, [int(p.argmax())], q, params,
                                torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0
        samples.append(verdict.tokens[0])
    observed = torch.bincount(torch.tensor(samples), minlength=8).double()
    expected = p.double() * n
    keep = expected >= 5
    obs = [*observed[keep].tolist(), float(observed[~keep].sum())]
    exp = [*expected[keep].tolist(), float(expected[~keep].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


def test_the_engine_serves_hostile_params(pair: tuple[Path, Path]) -> None:
    prompt = [3, 1, 4, 1, 5]
    greedy = run(engine_from(pair), {"g": (prompt, GREEDY)})["g"].token_ids
    requests = {}
    for i, (t, top_p, top_k, seed) in enumerate([
        (1e-38, 1.0, 0, HOSTILE_SEEDS[0]),
        (5e-324, 1e-300, 10**18, HOSTILE_SEEDS[1]),
        (1e-300, 1e-6, 0, None),
        (1.0, 1e-300, 0, HOSTILE_SEEDS[0]),  # top-p keeps only the argmax: greedy output
        (2.0, 5e-324, 10**18, HOSTILE_SEEDS[1]),
        (2.0, 1.0, 10**18, 2**64 - 1),
    ]):
        requests[f"h{i}"] = (prompt, SamplingParams(temperature=t, top_p=top_p, top_k=top_k,
                                                    seed=seed, max_tokens=12, ignore_eos=True))
    for speculative in (True, False):
        outs = run(engine_from(pair, speculative), requests)
        for rid, out in outs.items():
            assert out.error is None and out.finish_reason == "length", rid
            assert all(0 <= t < VOCAB for t in out.token_ids)
        for rid in ("h0", "h1", "h2", "h3", "h4"):
            assert outs[rid].token_ids == greedy, rid


# --- requests refused up front -----------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "field"), [
    ([1, 64, 2], "prompt"),
    ([1, -1], "prompt"),
    ([1, 2.5], "prompt"),
    ([1, True], "prompt"),
])
def test_add_request_refuses_bad_prompts_by_name(pair: tuple[Path, Path], prompt: list[Any],
                                                 field: str) -> None:
    engine = engine_from(pair, speculative=False)
    with pytest.raises(ValueError, match=rf"^{field}\b|\b{field}="):
        engine.add_request(prompt, GREEDY)
    assert not engine.sequences and not engine.scheduler.waiting
    # The extremes of the seed range are fine.
    for seed in (-(2**63), 2**64 - 1):
        engine.add_request([1], SamplingParams(seed=seed, max_tokens=2))
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize(("fields", "field"), [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_token_ids": ("x",)}, "stop_token_ids"),
    ({"stop": ("",)}, "stop"),
])
def test_sampling_params_refuse_bad_fields_by_name(fields: dict[str, Any], field: str) -> None:
    """SamplingParams checks its own fields, once, for both engine backends."""
    with pytest.raises(ValueError, match=rf"^{field}\b|\b{field}="):
        SamplingParams(**fields)


# --- one request's failure is its own ----------------------------------------------------------


Stage = Callable[[pytest.MonkeyPatch, EngineCore, str, int], None]


def _fail_nth(n: int) -> Callable[[], bool]:
    calls = [0]

    def hit() -> bool:
        calls[0] += 1
        return calls[0] == n

    return hit


def poison_sampling(mp: pytest.MonkeyPatch, engine: EngineCore, rid: str, n: int) -> None:
    real, hit = sequence_module.sample_token, _fail_nth(n)
    generator = engine.sequences[rid].generator

    def sample(logits: torch.Tensor, params: SamplingParams, g: torch.Generator | None,
               allowed: torch.Tensor | None = None) -> int:
        if g is generator and hit():
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, params, g, allowed)

    mp.setattr(sequence_module, "sample_token", sample)


def poison_verify(mp: pytest.MonkeyPatch, engine: EngineCore, rid: str, n: int) -> None:
    real, hit = sequence_module.verify_batch, _fail_nth(n)
    generator = engine.sequences[rid].generator

    def verify(*args: Any) -> Any:
        # The batch walks together: the poisoned request's verdict is the error, as a walk
        # that raised leaves it.
        verdicts = real(*args)
        for i, g in enumerate(args[4]):
            if g is generator and hit():
                verdicts[i] = IndexError("index 99 is out of bounds for dimension 0 with size 64")
        return verdicts

    mp.setattr(sequence_module, "verify_batch", verify)


def poison_method(name: str) -> Stage:
    def poison(mp: pytest.MonkeyPatch, engine: EngineCore, rid: str, n: int) -> None:
        real, hit = getattr(Sequence, name), _fail_nth(n)

        def method(self: Sequence, *args: Any) -> Any:
            if self.request_id == rid and hit():
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return real(self, *args)

        mp.setattr(Sequence, name, method)

    return poison


STAGES: dict[str, tuple[Stage, str]] = {
    "sample": (poison_sampling, "sampling"),
    "verify": (poison_verify, "verifying drafts"),
    "append": (poison_method("append"), "checking stop conditions"),
    "text_delta": (poison_method("text_delta"), "detokenizing"),
}


def batch() -> dict[str, tuple[list[int], SamplingParams]]:
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=14,
                              ignore_eos=True) for i in range(2)]
    return {
        "a": ([5, 6, 7], GREEDY),
        "bad": ([9, 8, 7, 6], SamplingParams(temperature=0.7, seed=5, max_tokens=14,
                                             ignore_eos=True)),
        "b": ([1, 2], sampled[0]),
        "c": ([11, 12, 13, 14, 15], sampled[1]),
        "d": ([4, 4], GREEDY),
    }


@pytest.mark.parametrize(("stage", "speculative", "family"), [
    ("sample", False, "k2"), ("verify", True, "k2"), ("append", True, "k2"),
    ("append", False, "k2"), ("text_delta", True, "k2"),
    ("sample", False, "k3"), ("verify", True, "k3"), ("append", True, "k3"),
])
def test_one_failing_request_leaves_the_batch_exact(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, stage: str, speculative: bool, family: str) -> None:
    pair = request.getfixturevalue("pair" if family == "k2" else "hybrid_pair")
    requests = batch()
    clean = run(engine_from(pair, speculative, detokenize=detok), requests)
    engine = engine_from(pair, speculative, detokenize=detok)
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    poison, what = STAGES[stage]
    poison(monkeypatch, engine, "bad", 2)  # the second call: mid-stream, in a full batch
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    final: dict[str, RequestOutput] = {}
    with caplog.at_level(logging.ERROR, logger="serve_app.engines.reference.engine"):
        while engine.has_work:
            for out in engine.step():
                assert out.request_id not in final
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    final[out.request_id] = out
    bad = final.pop("bad")
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error == f"the request failed in the engine while {what}"
    assert_client_safe(bad.error)
    assert 0 < len(tokens["bad"]) < 14 and bad.completion_tokens == len(tokens["bad"])
    for rid, out in final.items():
        assert out.error is None and tokens[rid] == clean[rid].token_ids, rid
        assert out.text == clean[rid].text
    # The traceback is in the log with the request id.
    [record] = [r for r in caplog.records if "bad" in r.getMessage()]
    assert record.exc_info is not None
    # Nothing of it is left behind, and the engine carries on.
    assert not engine.sequences and not engine.scheduler.running
    assert engine.capacity()["kv_tokens_used"] == 0
    assert engine.capacity()["kv_tokens_reserved"] == 0
    assert engine.capacity()["state_slots_used"] == 0
    pool = getattr(engine.runner.cache, "states", None)  # the hybrid's KDA state slots
    assert pool is None or pool.used == 0
    assert engine.stats()["requests_failed"] == 1
    assert engine.stats()["requests_finished"] == len(requests) - 1
    again = run(engine, {"again": requests["a"]})["again"]
    assert again.token_ids == clean["a"].token_ids


class RecordingRunner:
    """Wraps a runner's rank-0 entry points (each one broadcast to the followers)."""

    def __init__(self, engine: EngineCore) -> None:
        self.calls: list[tuple[str, Any]] = []
        runner = engine.runner
        for name in ("add", "free", "forward", "commit", "propose"):
            real = getattr(runner, name)
            setattr(runner, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            ids = args[0] if name in ("free", "add") else (
                [s.request_id for s in args[0]] if name == "propose"
                else list(args[1] if name == "forward" else args[0]))
            self.calls.append((name, ids))
            return real(*args, **kwargs)

        return call


def test_a_failed_request_is_freed_after_the_others_commit(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TP every runner call is broadcast: the failing step must issue the same calls as
    a clean one (propose, forward, commit), then free the failed request. Fixed windows: every
    request is drafted for (the adaptive budget drafts for those worth it)."""
    engine = engine_from(pair, adaptive=False)
    requests = batch()
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    engine.step()  # prefill all
    recorder = RecordingRunner(engine)
    poison_verify(monkeypatch, engine, "bad", 1)
    outs = engine.step()
    assert [o.request_id for o in outs if o.error] == ["bad"]
    others = [r for r in requests if r != "bad"]
    assert recorder.calls == [
        ("propose", list(requests)),
        ("forward", list(requests)),
        ("commit", others),
        ("free", "bad"),
    ]


def test_a_failed_prefill_sample_frees_after_the_prefill_commit(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_from(pair)
    requests = batch()
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    recorder = RecordingRunner(engine)
    poison_sampling(monkeypatch, engine, "bad", 1)
    outs = engine.step()
    assert [o.request_id for o in outs if o.error] == ["bad"]
    assert [name for name, _ in recorder.calls] == [
        *["add"] * len(requests), "forward", "commit", "free"]


def test_a_batched_forward_failure_is_an_engine_fault(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, speculative=False)
    engine.add_request([1, 2, 3], GREEDY)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("NCCL error: remote process exited")

    engine.runner.forward = forward  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="NCCL"):
        engine.step()


def test_observer_exceptions_never_fail_requests(pair: tuple[Path, Path],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Callable[..., None]:
            def hook(*args: Any) -> None:
                raise RuntimeError(f"telemetry bug in {name}")
            return hook

    requests = batch()
    clean = run(engine_from(pair), requests)
    engine = engine_from(pair)
    engine.observer = Broken()  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR):
        outs = run(engine, requests)
    assert {r: o.token_ids for r, o in outs.items()} == {r: o.token_ids for r, o in clean.items()}
    assert any("observer on_step failed" in r.getMessage() for r in caplog.records)


# --- the async engine --------------------------------------------------------------------------


async def collect(engine: ReferenceAsyncEngine, rid: str, prompt: list[int],
                  params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(GenerateRequest(rid, prompt, params)):
        tokens += out.token_ids
    return tokens


async def gather(*aws: Any) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=True), HANG_GUARD_S)


@pytest.fixture
def async_engine() -> Iterator[Callable[..., ReferenceAsyncEngine]]:
    """Builds ReferenceAsyncEngines and, at the end, stops their threads."""
    made: list[ReferenceAsyncEngine] = []

    def make(core: EngineCore, **kwargs: Any) -> ReferenceAsyncEngine:
        made.append(ReferenceAsyncEngine(core, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine._stopping = True
        engine._stopped.set()
        engine._wake.set()
        engine._thread.join(HANG_GUARD_S)


async def test_a_failed_request_fails_only_its_stream(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    clean = run(engine_from(pair), {"a": ([5, 6, 7], GREEDY), "b": ([1, 2], GREEDY)})
    engine = async_engine(engine_from(pair, detokenize=detok))
    poison_method("text_delta")(monkeypatch, engine.core, "bad", 2)
    a, bad, b = await gather(collect(engine, "a", [5, 6, 7]), collect(engine, "bad", [9, 8]),
                             collect(engine, "b", [1, 2]))
    assert isinstance(bad, RequestFailed)
    assert str(bad) == "the request failed in the engine while detokenizing"
    assert a == clean["a"].token_ids and b == clean["b"].token_ids
    assert engine.problem() is None
    await asyncio.wait_for(engine.health(HANG_GUARD_S), HANG_GUARD_S)


async def test_an_add_request_crash_refuses_only_that_request(
        pair: tuple[Path, Path], async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    core = engine_from(pair)
    real = core.add_request

    def add_request(prompt: list[int], params: SamplingParams, rid: str | None = None,
                    hand_off: bool = False, images: tuple[ImageInput, ...] = ()) -> str:
        if rid == "boom":
            raise RuntimeError("an unexpected bug at /srv/engine.py")
        return real(prompt, params, rid, hand_off=hand_off, images=images)

    core.add_request = add_request  # type: ignore[method-assign]
    engine = async_engine(core)
    ok, boom, bad_prompt = await gather(
        collect(engine, "ok", [5, 6, 7]), collect(engine, "boom", [1]),
        collect(engine, "bad-prompt", [10**9]))
    assert isinstance(boom, RequestFailed) and "could not accept" in str(boom)
    assert_client_safe(str(boom))
    assert isinstance(bad_prompt, ValueError) and "prompt" in str(bad_prompt)
    assert len(ok) == GREEDY.max_tokens
    assert engine.problem() is None and engine._thread.is_alive()


async def test_a_step_exception_fails_every_stream_safely(
        pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture,
        async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    core = engine_from(pair, speculative=False)
    real, calls = core.runner.forward, [0]

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("CUDA error at /opt/kernels/attn.cu: <Tensor at 0x7f00>")
        return real(*args, **kwargs)

    core.runner.forward = forward  # type: ignore[method-assign]
    engine = async_engine(core)
    with caplog.at_level(logging.ERROR, logger="serve_app.engines.reference.async_engine"):
        results = await gather(collect(engine, "a", [5, 6, 7]), collect(engine, "b", [1, 2]))
    for exc in results:
        assert isinstance(exc, EngineUnavailable)
        assert str(exc) == "the engine failed; the replica will be replaced"
    assert any(r.exc_info for r in caplog.records)  # the traceback went to the log
    problem = engine.problem()
    assert problem is not None and "RuntimeError" in problem
    assert_client_safe(str(results[0]))
    with pytest.raises(EngineUnavailable):
        await engine.health(HANG_GUARD_S)
    with pytest.raises(EngineUnavailable, match="the engine failed"):
        await collect(engine, "later", [1])


class HeldClock:
    """Stands in for the async engine module's `time`: its monotonic() moves only when the test
    advances it. The watchdog times each busy stretch of the engine loop with it, so a step
    looks long only when the test says so, however slow the real steps are."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


async def test_the_watchdog_fails_a_stuck_step(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    """A step that never returns (a stopped TP rank: the collective waits forever) fails every
    stream, later calls and the health check; idle time before it never counts. The engine's
    clock is the test's: four watchdog periods of it pass while the engine is idle, two while
    a step is stuck. (With an hour's watchdog, only that clock can make a step exceed it.)"""
    import serve_app.engines.reference.async_engine as async_module

    watchdog_s = 3600.0
    clock = HeldClock()
    monkeypatch.setattr(async_module, "time", clock)
    core = engine_from(pair, speculative=False)
    real = core.runner.forward
    stuck, release = threading.Event(), threading.Event()

    def forward(rows: Any, rids: list[str], capture: bool, **options: Any) -> torch.Tensor:
        if "stuck" in rids:
            stuck.set()
            release.wait()
        return real(rows, rids, capture, **options)

    core.runner.forward = forward  # type: ignore[method-assign]
    engine = async_engine(core, watchdog_s=watchdog_s)
    try:
        clock.advance(4 * watchdog_s)  # idle: no work, so no watchdog
        assert engine.problem() is None
        await asyncio.wait_for(engine.health(HANG_GUARD_S), HANG_GUARD_S)
        assert engine.problem() is None

        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        running = engine.generate(GenerateRequest("running", [5, 6, 7], params))
        first = await asyncio.wait_for(anext(running), HANG_GUARD_S)
        assert first.token_ids and not first.finished  # decoding: in the stuck step's batch

        async def rest() -> None:
            async for _ in running:
                pass

        async def stall() -> None:
            assert await asyncio.to_thread(stuck.wait, HANG_GUARD_S)
            clock.advance(2 * watchdog_s)  # the stuck step's time on the engine's clock

        *results, stalled = await gather(rest(), collect(engine, "stuck", [1, 2, 3]), stall())
        assert stalled is None  # the step got stuck, and then the clock moved
        for exc in results:
            assert isinstance(exc, EngineUnavailable)
            assert str(exc) == ("an engine step exceeded the watchdog (3600 s); the replica "
                                "will be replaced")
        problem = engine.problem()
        assert problem is not None and "watchdog" in problem
        with pytest.raises(EngineUnavailable, match="watchdog"):
            await engine.health(HANG_GUARD_S)
        with pytest.raises(EngineUnavailable, match="exceeded the watchdog"):
            await collect(engine, "later", [1])
    finally:
        release.set()
    engine._thread.join(HANG_GUARD_S)
    assert not engine._thread.is_alive()  # the released step returned and the loop ended
    assert engine.problem() is not None  # a failed engine stays failed


async def test_an_idle_pass_held_midway_is_not_a_stuck_step(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    """The loop's idle pass (nothing in the inbox, no work) starts no busy stretch: held inside
    it (a preempted thread on a loaded machine) while hours pass on the engine's clock, the
    engine still reads as idle. (It used to start the stretch first: under the whole suite
    the watchdog test above once read 'an engine step has run for 14400.0 s' before any
    request.)"""
    import serve_app.engines.reference.async_engine as async_module

    clock = HeldClock()
    monkeypatch.setattr(async_module, "time", clock)
    core = engine_from(pair, speculative=False)
    inside, resume = threading.Event(), threading.Event()
    has_work = type(core).has_work

    def held(self: EngineCore) -> bool:
        if threading.current_thread().name == "engine-loop" and not resume.is_set():
            inside.set()
            resume.wait(HANG_GUARD_S)
        return has_work.fget(self)  # type: ignore[attr-defined]

    monkeypatch.setattr(type(core), "has_work", property(held))
    engine = async_engine(core, watchdog_s=3600.0)
    try:
        assert await asyncio.to_thread(inside.wait, HANG_GUARD_S)
        clock.advance(4 * 3600.0)
        assert engine.problem() is None
    finally:
        resume.set()
    await asyncio.wait_for(engine.health(HANG_GUARD_S), HANG_GUARD_S)
    assert engine.problem() is None


def test_watchdog_s_must_be_positive(pair: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="watchdog_s=0"):
        ReferenceAsyncEngine(engine_from(pair, speculative=False), watchdog_s=0)


async def test_a_grammar_that_does_not_compile_in_time_is_refused_naming_its_field(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        async_engine: Callable[..., ReferenceAsyncEngine]) -> None:
    """The compile bound: a request whose grammar is still compiling when the bound passes is
    refused with a ValueError naming its field (a 400), nothing of it queued, and the engine
    serves the next request. (The compile is held on an event: a real one is bounded by
    llguidance's limits, tests/test_grammar.py.)"""
    import serve_app.engines.reference.async_engine as async_module
    from serve_app.grammar.compiler import GrammarStats
    from serve_app.protocol.grammar import GrammarSpec

    release = threading.Event()

    class HeldCompiler:
        stats = GrammarStats()

        def prepare(self, spec: GrammarSpec) -> None:
            release.wait(HANG_GUARD_S)

    monkeypatch.setattr(async_module, "GRAMMAR_COMPILE_TIMEOUT_S", 0.2)
    engine = async_engine(engine_from(pair))
    engine.core.grammar = HeldCompiler()  # type: ignore[assignment]
    spec = GrammarSpec("json_object", "response_format")
    params = SamplingParams(temperature=0.0, max_tokens=4, grammar=spec)
    with pytest.raises(ValueError, match=r"^response_format: the grammar did not compile"):
        await asyncio.wait_for(collect(engine, "g", [1, 2], params), HANG_GUARD_S)
    release.set()
    assert not engine.core.sequences and engine.core.capacity()["kv_tokens_reserved"] == 0
    assert len(await asyncio.wait_for(collect(engine, "free", [1, 2]), HANG_GUARD_S)) == 12
