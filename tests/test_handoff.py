"""Prefill/decode disaggregation in the reference engine: a request prefilled on one engine,
exported (`EngineCore.export`: its tokens, sampler state and cache shares) and adopted by
another (`EngineCore.adopt`) decodes exactly as the aggregated engine does — the same tokens,
greedy and seeded sampling, with speculation on and both KDA rollback strategies, and the same
speculative statistics (the draft's context moved too) — and both sides end holding nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from spec_helpers import engine_from as _engine_from
from spec_helpers import prefill_for_handoff as prefill
from spec_helpers import run_tensor_parallel
from tiny_models import tiny_k3_config, write_random_k3_pair

from serve_app.config import ReferenceEngineConfig
from serve_app.embedded import DRAFT, TARGET, TOKENIZER, heldout_prompt_ids
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.handoff import RequestHandoff, reshard
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.models.kv_capacity import KVCapacityError
from serve_app.tokenizer import load_tokenizer

VOCAB = 256
ROLLBACKS = ["scratch", "replay"]
# Prefill in chunks that cross KDA's 16-token chunks, so the state handed over was carried
# across both kinds of boundary.


def engine_from(pair: tuple[Path, Path], **kwargs: Any) -> EngineCore:
    """Fixed windows (speculation.adaptive false): a greedy request's speculative statistics
    then depend on its own tokens alone, so a handed-over request's are comparable with the
    aggregated engine's (adaptive windows depend on step times and the traffic around it)."""
    return _engine_from(pair, adaptive=False, **kwargs)


CHUNKED = {"prefill_chunk_tokens": 40, "max_prefill_tokens_per_request": 40}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_random_k3_pair(tmp_path_factory.mktemp("handoff"), tiny_k3_config(VOCAB))


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(3)
    return [[rng.randrange(VOCAB - 3) for _ in range(n)] for n in (9, 70, 131)]


def finish(engine: EngineCore, rids: list[str]) -> dict[str, Any]:
    """Step until every request in `rids` ends: its tokens and its final output."""
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    final: dict[str, Any] = {}
    while len(final) < len(rids):
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    final[out.request_id] = out
    return {r: (tokens[r], final[r]) for r in rids}


def disaggregated(p: EngineCore, d: EngineCore, prompt: list[int], params: SamplingParams
                  ) -> tuple[list[int], Any]:
    handoff = p.export(prefill(p, prompt, params))
    assert handoff.nbytes > 0
    rid = d.adopt(handoff)
    return finish(d, [rid])[rid]


def holds_nothing(engine: EngineCore) -> None:
    cap = engine.capacity()
    assert cap["kv_tokens_used"] == 0 and cap["state_slots_used"] == 0
    assert cap["kv_tokens_reserved"] == 0 and not engine.sequences
    assert engine.runner.cache.states.used == 0


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_handed_over_request_decodes_as_the_aggregated_engine(
        pair: tuple[Path, Path], rollback: str, params: SamplingParams) -> None:
    spec = {"kda_rollback": rollback}
    agg = engine_from(pair, engine=CHUNKED, **spec)
    p, d = engine_from(pair, engine=CHUNKED, **spec), engine_from(pair, engine=CHUNKED, **spec)
    for prompt in prompts():
        expected = agg.generate([prompt], params)[0]
        tokens, out = disaggregated(p, d, prompt, params)
        assert tokens == expected.token_ids
        assert out.completion_tokens == len(tokens) and out.prompt_tokens == len(prompt)
        assert out.spec == expected.spec
    holds_nothing(p)
    holds_nothing(d)
    assert d.stats()["spec_verify_ct"] == agg.stats()["spec_verify_ct"]


def test_the_draft_context_moves_with_the_request() -> None:
    """On the trained embedded pair (its draft accepts), the decode side's speculation is the
    aggregated engine's, step for step: equal tokens, verify steps and histogram, greedy and
    seeded. A decode side that rebuilt nothing of the draft's context would accept less."""
    tok = load_tokenizer(TOKENIZER)
    prompt = heldout_prompt_ids(tok, n_completion=1, n_chat=0)[0]
    pair = (TARGET, DRAFT)
    for params in (GREEDY, SEEDED):
        agg = engine_from(pair)
        p, d = engine_from(pair), engine_from(pair)
        expected = agg.generate([prompt], params)[0]
        tokens, out = disaggregated(p, d, prompt, params)
        assert tokens == expected.token_ids
        assert out.spec == expected.spec
        assert expected.spec["spec_accept_length"] > 1.5  # the check has drafts to lose


def test_the_prefill_side_keeps_the_prompt_in_its_prefix_cache(pair: tuple[Path, Path]
                                                               ) -> None:
    """A hand-off request's prompt stays cached on the prefill side (a second request with
    that prefix hits it and is handed over exactly too); the decode side caches nothing it
    was not asked to and frees everything."""
    cache = {**CHUNKED, "prefix_cache": {"enabled": True, "snapshot_interval": 32}}
    agg = engine_from(pair, engine=CHUNKED)
    p, d = engine_from(pair, engine=cache), engine_from(pair, engine=CHUNKED)
    first = prompts()[2]
    second = [*first[:96], 5, 6, 7]
    for prompt in (first, second):
        tokens, out = disaggregated(p, d, prompt, GREEDY)
        assert tokens == agg.generate([prompt], GREEDY)[0].token_ids
    assert out.cached_tokens == 96  # the second prompt's hit, reported by the decode side
    assert p.capacity()["state_slots_used"] == 0 and not p.sequences
    holds_nothing(d)


def test_an_adoption_that_does_not_fit_changes_nothing(pair: tuple[Path, Path]) -> None:
    p = engine_from(pair)
    small = engine_from(pair, engine={"kv_capacity_tokens": 64})
    no_draft = engine_from(pair, draft=False)
    handoff = p.export(prefill(p, prompts()[2], GREEDY))  # 131 + 16 tokens: > 64
    before = small.capacity()
    with pytest.raises(KVCapacityError):
        small.adopt(handoff)
    assert small.capacity() == before and not small.sequences
    with pytest.raises(ValueError, match="draft"):
        no_draft.adopt(handoff)
    holds_nothing(no_draft)
    with pytest.raises(ValueError, match="neither prefilled"):
        p.export("no-such-request")
    # The hand-over is still whole: a decode engine with room takes it.
    d = engine_from(pair)
    rid = d.adopt(handoff)
    assert len(finish(d, [rid])[rid][0]) == GREEDY.max_tokens
    holds_nothing(d)


def test_a_request_that_ends_on_its_first_token_is_not_handed_over(pair: tuple[Path, Path]
                                                                  ) -> None:
    p = engine_from(pair)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rid = p.add_request(prompts()[0], one, hand_off=True)
    (tokens, out), = finish(p, [rid]).values()
    assert len(tokens) == 1 and out.finish_reason == "length" and not out.prefilled
    holds_nothing(p)


def test_reshard_is_a_round_trip(pair: tuple[Path, Path]) -> None:
    p = engine_from(pair)
    handoff = p.export(prefill(p, prompts()[1], GREEDY))
    two = reshard(handoff.shares, 2, draft_kv_heads=2)
    assert len(two) == 2
    conv = next(n for n in two[0]["target"] if n.endswith(".conv"))
    whole = handoff.shares[0]["target"][conv]
    assert two[0]["target"][conv].shape[-1] * 2 == whole.shape[-1]
    back = reshard(two, 1, draft_kv_heads=2)[0]
    for part, entries in handoff.shares[0].items():
        for name, t in entries.items():
            assert torch.equal(back[part][name], t), (part, name)
    with pytest.raises(ValueError, match="KV heads"):
        reshard(handoff.shares, 4, draft_kv_heads=2)


# --- between tensor-parallel sizes -----------------------------------------------------------


def _tp2_job(engine: EngineCore, prompt: list[int], handoff: RequestHandoff) -> tuple:
    """On a TP 2 engine: hand over `prompt` after prefilling it, and decode `handoff`
    (prefilled by a TP 1 engine)."""
    out = engine.export(prefill(engine, prompt, SEEDED))
    rid = engine.adopt(handoff)
    decoded = finish(engine, [rid])[rid]
    return out, decoded[0], decoded[1].spec, engine.capacity()


def _own_handoff(result: tuple) -> tuple:
    """The TP 2 engine's hand-over with its tensors copied out of the worker's memory."""
    handoff = result[0]
    handoff.shares = [{part: {n: t.clone() for n, t in entries.items()}
                       for part, entries in share.items()} for share in handoff.shares]
    handoff.generator_state = handoff.generator_state.clone()
    return result


@pytest.mark.slow
def test_a_hand_over_between_tp1_and_tp2_is_exact(pair: tuple[Path, Path]) -> None:
    """TP 2 prefill -> TP 1 decode and TP 1 prefill -> TP 2 decode (the KDA heads, their conv
    channels and the draft's KV heads re-split; the MLA latent is every rank's) give the
    aggregated TP 1 engine's tokens and speculative statistics, seeded sampling."""
    first, second = prompts()[1], prompts()[2]
    agg = engine_from(pair, engine=CHUNKED)
    expected = {i: agg.generate([p], SEEDED)[0] for i, p in enumerate((first, second))}
    tp1 = engine_from(pair, engine=CHUNKED)
    to_tp2 = tp1.export(prefill(tp1, second, SEEDED))
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, **CHUNKED)  # type: ignore[arg-type]
    from_tp2, tokens, spec, capacity = run_tensor_parallel(
        pair, cfg, 2, _tp2_job, (first, to_tp2), own=_own_handoff)
    assert len(from_tp2.shares) == 2
    assert tokens == expected[1].token_ids and spec == expected[1].spec
    assert capacity["kv_tokens_used"] == 0 and capacity["state_slots_used"] == 0
    rid = tp1.adopt(from_tp2)
    decoded, out = finish(tp1, [rid])[rid]
    assert decoded == expected[0].token_ids and out.spec == expected[0].spec
    holds_nothing(tp1)


# --- through the async engine (what a prefill and a decode replica run) ----------------------


async def test_the_async_engines_hand_over_while_other_requests_decode(
        pair: tuple[Path, Path]) -> None:
    """A prefill replica's engine returns the hand-over (exported on its loop thread); a decode
    replica's engine streams the request from its first token, batched with a request of its
    own, and both give the aggregated tokens. A decode engine without room refuses the
    hand-over as it would a request, and a client gone mid-stream frees the decode side."""
    import asyncio

    from serve_app.engines.reference.async_engine import ReferenceAsyncEngine
    from serve_app.protocol.generation import GenerateRequest

    agg = engine_from(pair)
    first, second = prompts()[1], prompts()[2]
    expected = [o.token_ids for o in agg.generate([first, second], SEEDED)]
    p, d = ReferenceAsyncEngine(engine_from(pair)), ReferenceAsyncEngine(engine_from(pair))
    small = ReferenceAsyncEngine(engine_from(pair, engine={"kv_capacity_tokens": 64}))
    try:
        async def local() -> list[int]:
            return [t async for o in d.generate(GenerateRequest("own", first, SEEDED))
                    for t in o.token_ids]

        async def moved() -> list[int]:
            handoff = await p.prefill(GenerateRequest("moved", second, SEEDED))
            assert isinstance(handoff, RequestHandoff)
            with pytest.raises(KVCapacityError):
                async for _ in small.adopt(handoff):
                    pass
            return [t async for o in d.adopt(handoff) for t in o.token_ids]

        got = await asyncio.wait_for(asyncio.gather(local(), moved()), 120)
        assert got == expected
        handoff = await p.prefill(GenerateRequest("gone", second, SEEDED))
        stream = d.adopt(handoff)
        await anext(stream)
        await stream.aclose()  # the client went away
        for _ in range(200):
            if not d.core.sequences:
                break
            await asyncio.sleep(0.05)
        for engine in (p, d, small):
            holds_nothing(engine.core)
    finally:
        for engine in (p, d, small):
            await engine.shutdown()
