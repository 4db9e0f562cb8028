"""A running request moving between reference engines (a replica scaled down or restarted):
exported between two decode steps (`EngineCore.export` of a decoding request: its tokens,
sampler state, speculative counts, what its client was sent, and every cache share) and
adopted by another engine, it goes on exactly as if it had never moved: the same tokens,
greedy and seeded, with speculation on and both KDA rollbacks, the same speculative
statistics, the same text (stop strings and grammars included), nothing sent twice, and the
engine it left holds nothing. `ReferenceAsyncEngine.evacuate` ends every client stream with
a `Moved` (a hand-over, or nothing for a request that had not started)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from spec_helpers import engine_from as _engine_from
from test_handoff import holds_nothing, prompts
from tiny_models import tiny_k3_config, write_random_k3_pair

from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.embedded import DRAFT, TARGET, TOKENIZER, heldout_prompt_ids
from serve_app.engines.reference.async_engine import ReferenceAsyncEngine
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.handoff import RequestHandoff
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.protocol.generation import GenerateRequest, Moved
from serve_app.protocol.grammar import GrammarSpec
from serve_app.tokenizer import load_tokenizer, stop_token_ids

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_random_k3_pair(tmp_path_factory.mktemp("migration"), tiny_k3_config(VOCAB))


def engine_from(pair: tuple[Path, Path], **spec: Any) -> EngineCore:
    """Fixed windows, so that speculative statistics are comparable across engines (the
    adaptive budget follows each engine's own step times)."""
    return _engine_from(pair, adaptive=False, **spec)


def run_moving(a: EngineCore, b: EngineCore, requests: list[tuple[list[int], SamplingParams]],
               steps_before: int) -> dict[str, tuple[list[int], str, Any]]:
    """Run `requests` on `a` for `steps_before` steps, move every decoding one to `b`, and
    finish there (a request still prefilling on `a` finishes there). Per request: the
    tokens and text its client received from both engines, and its final output."""
    rids = [a.add_request(p, params) for p, params in requests]
    got: dict[str, list[Any]] = {r: [[], "", None] for r in rids}

    def take(outs: list[Any]) -> None:
        for out in outs:
            got[out.request_id][0] += out.token_ids
            got[out.request_id][1] += out.text
            if out.finished:
                got[out.request_id][2] = out

    for _ in range(steps_before):
        take(a.step())
    moving = [r for r in rids if got[r][2] is None and a.sequences[r].status.value == "decoding"]
    assert moving, "nothing was decoding when the requests moved"
    for rid in moving:
        handoff = a.export(rid)
        assert handoff.reported_tokens == len(got[rid][0]) and handoff.nbytes > 0
        b.adopt(handoff)
    while any(got[r][2] is None for r in rids):
        take(a.step() if a.has_work else [])
        take(b.step() if b.has_work else [])
    return {r: tuple(got[r]) for r in rids}  # type: ignore[misc]


@pytest.mark.parametrize("rollback", ["scratch", "replay"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_moved_mid_decode_goes_on_as_if_it_had_not(
        pair: tuple[Path, Path], rollback: str, params: SamplingParams) -> None:
    spec = {"kda_rollback": rollback}
    requests = [(p, params) for p in prompts()]
    expected = engine_from(pair, **spec).generate([p for p, _ in requests], params)
    for steps_before in (2, 5):
        a, b = engine_from(pair, **spec), engine_from(pair, **spec)
        got = run_moving(a, b, requests, steps_before)
        for (tokens, _, final), want in zip(got.values(), expected, strict=True):
            assert tokens == want.token_ids  # nothing lost, nothing sent twice
            assert final.completion_tokens == len(want.token_ids)
            assert final.spec == want.spec  # the counts of both engines, in one total
        holds_nothing(a)
        holds_nothing(b)


def _embedded_engine() -> EngineCore:
    tok = load_tokenizer(TOKENIZER)
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096,
                                speculation=SpeculationConfig(adaptive=False))
    return build_engine(build_runner(TARGET, DRAFT, cfg), cfg, eos_token_ids=stop_token_ids(tok),
                        detokenize=tok.decode, tokenizer=tok)


def test_text_stop_strings_grammar_and_the_draft_move_with_the_request() -> None:
    """On the trained embedded pair (its draft accepts, so a lost draft context would show in
    the statistics): the text the client receives across the move is the unmoved text,
    including a stop string held back at the moment of the move and a JSON grammar whose
    matcher is rebuilt from the tokens."""
    tok = load_tokenizer(TOKENIZER)
    prompt = heldout_prompt_ids(tok, n_completion=1, n_chat=0)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=40)
    unmoved = _embedded_engine().generate([prompt], plain)[0]
    # A stop string from the middle of the unmoved text: the move happens before it.
    stop = unmoved.text[len(unmoved.text) // 2:][:3]
    assert stop.strip(), unmoved.text
    cases = [plain, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
             SamplingParams(temperature=0.0, max_tokens=40,
                            grammar=GrammarSpec("json_object", "response_format")),
             SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=3)]
    for params in cases:
        want = _embedded_engine().generate([prompt], params)[0]
        a, b = _embedded_engine(), _embedded_engine()
        ((tokens, text, final),) = run_moving(a, b, [(prompt, params)], 2).values()
        assert (tokens, text, final.finish_reason) == (want.token_ids, want.text,
                                                       want.finish_reason)
        assert final.spec == want.spec
    assert want.spec["spec_accept_length"] > 1.5  # the check had drafts to lose


def test_an_adoption_checks_what_the_hand_over_claims(pair: tuple[Path, Path]) -> None:
    a, b = engine_from(pair), engine_from(pair)
    rid = a.add_request(prompts()[0], GREEDY)
    for _ in range(3):
        a.step()
    handoff = a.export(rid)
    for bad in ({"num_cached": handoff.num_cached + 1},
                {"reported_tokens": len(handoff.output_ids) + 1}):
        forged = RequestHandoff(**{**handoff.__dict__, **bad})
        with pytest.raises(ValueError, match="hand-over"):
            b.adopt(forged)
        holds_nothing(b)
    with pytest.raises(ValueError, match="neither prefilled"):
        a.export(rid)  # it has left


async def test_evacuate_ends_every_client_stream_with_a_move(pair: tuple[Path, Path]) -> None:
    """Three streams on an engine that runs two at a time: the two decoding ones leave with
    their hand-overs, the waiting one with nothing (it starts again); continued on another
    engine, each client receives exactly the unmoved tokens, and the engine left holds
    nothing."""
    requests = [(f"r{i}", p) for i, p in enumerate(prompts())]
    expected = engine_from(pair).generate([p for _, p in requests], SEEDED)
    a = ReferenceAsyncEngine(_engine_from(pair, adaptive=False, engine={"max_batch_size": 2}))
    b = ReferenceAsyncEngine(engine_from(pair))
    try:
        started = asyncio.Event()

        async def client(rid: str, prompt: list[int]) -> tuple[list[int], bool]:
            tokens: list[int] = []
            stream: Any = a.generate(GenerateRequest(rid, prompt, SEEDED))
            moved_with = None
            async for out in stream:
                if isinstance(out, Moved):
                    moved_with = out
                    break
                tokens += out.token_ids
                if len(tokens) >= 3:
                    started.set()
            assert moved_with is not None and moved_with.request_id == rid
            if moved_with.handoff is None:
                assert not tokens  # nothing had been sent: it starts again
                rest: Any = b.generate(GenerateRequest(rid, prompt, SEEDED))
            else:
                rest = b.adopt(moved_with.handoff)
            async for out in rest:
                tokens += out.token_ids
            return tokens, moved_with.handoff is not None

        tasks = [asyncio.create_task(client(rid, p)) for rid, p in requests]
        await asyncio.wait_for(started.wait(), 60)
        moved = await a.evacuate()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert moved == 3
        assert [tokens for tokens, _ in results] == [o.token_ids for o in expected]
        assert sorted(carried for _, carried in results) == [False, True, True]
        holds_nothing(a.core)
        holds_nothing(b.core)
    finally:
        await a.shutdown()
        await b.shutdown()
