"""The reference engine: lossless speculation, exact sampling, stops, KV capacity, stats, TP."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spec_helpers import (
    GREEDY,
    SAMPLED,
    WRONG_RULE_SAMPLES,
    OracleProposer,
    SkewedProposer,
    chi2_pvalue,
    detok,
    engine_from,
    engine_with,
    exact_marginals,
    greedy_continuation,
    random_prompts,
    run_staggered,
    run_tensor_parallel,
    sample_many,
)
from tiny_models import tiny_k3_config, write_random_k3_pair, write_tiny_pair

from serve_app.config import ReferenceEngineConfig
from serve_app.engines.reference.builder import (
    build_engine,
    build_runner,
)
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.engines.reference.sequence import Sequence
from serve_app.models.k3_paged import PagedK3
from serve_app.models.k3_weights import load_k3
from serve_app.models.kimi import KimiForCausalLM
from serve_app.models.kimi_weights import load_kimi
from serve_app.models.kv_capacity import KVCapacityError


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def target(pair: tuple[Path, Path]) -> KimiForCausalLM:
    return load_kimi(pair[0])


# --- lossless greedy -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_outputs(pair: tuple[Path, Path]) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(10, 64, seed=1)
    return prompts, run_staggered(engine_from(pair, enabled=False), prompts)


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("windows", ["full", "threshold", "adaptive"])
def test_dspark_greedy_is_lossless(pair: tuple[Path, Path], reference_outputs: tuple,
                                   gamma: int, windows: str) -> None:
    """Every request verifying its whole block, the confidence threshold's prefix, and the
    adaptive budget's windows: the target's own greedy output."""
    prompts, expected = reference_outputs
    engine = engine_from(pair, gamma=gamma, adaptive=windows == "adaptive",
                         confidence_threshold=0.6 if windows == "threshold" else 0.0)
    assert run_staggered(engine, prompts) == expected
    stats = engine.stats()
    assert stats["spec_verify_ct"] > 0
    if windows == "threshold":
        # The confidence schedule verified fewer drafts than gamma per step on average.
        assert stats["spec_proposed_drafts"] < gamma * stats["spec_verify_ct"] or gamma == 1
    if windows == "adaptive":
        # It decided every decode step (a plan, or no draft where none paid: with the random
        # tiny draft, gamma 7 never does).
        assert stats["spec_budget_speculative_steps"] + stats["spec_budget_plain_steps"] > 0


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("mode", ["oracle", "partial"])
def test_test_proposers_exercise_full_partial_and_zero_acceptance(
    target: KimiForCausalLM, reference_outputs: tuple, gamma: int, mode: str
) -> None:
    prompts, expected = reference_outputs
    rng = random.Random(gamma)
    correct = None if mode == "oracle" else (lambda: rng.randint(0, gamma))
    engine = engine_with(target, OracleProposer(target, gamma, correct))
    assert run_staggered(engine, prompts) == expected
    hist = engine.stats()["spec_correct_drafts_histogram"]
    if mode == "oracle":
        # Every block fully accepted, except where max_tokens capped the verify width.
        assert hist[gamma] > 0 and sum(hist[:gamma]) <= len(prompts)
    else:
        assert (hist[0] > 0 and hist[gamma] > 0 and sum(hist[1:gamma]) > 0) or gamma == 1


# --- exact sampling ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory
                ) -> Callable[[str], KimiForCausalLM | PagedK3]:
    """16-token targets by kind, built once: the K2 layout ("k2"), and the K3 hybrid with each
    way its verify rolls the KDA state back ("k3-scratch", "k3-replay")."""
    built: dict[str, KimiForCausalLM | PagedK3] = {}

    def target(kind: str) -> KimiForCausalLM | PagedK3:
        if kind not in built:
            folder = tmp_path_factory.mktemp("v16")
            if kind == "k2":
                built[kind] = load_kimi(write_tiny_pair(folder, seed=3, vocab_size=16)[0])
            else:
                path, _ = write_random_k3_pair(folder, tiny_k3_config(16), seed=3)
                built[kind] = PagedK3(load_k3(path).eval(), 600, kind.removeprefix("k3-"))
        return built[kind]

    return target


# Whole blocks on each family; ragged windows (drawn at random per request and step) on each
# family and with both KDA rollbacks. Each K3 case costs ~20-40 s: not the full product.
EXACT_CASES = [("k2", "full"), ("k3-replay", "full"), ("k2", "random"),
               ("k3-scratch", "random"), ("k3-replay", "random")]


@pytest.mark.parametrize(("kind", "windows"), EXACT_CASES)
def test_speculative_sampling_matches_the_target_distribution(small_vocab: Any, kind: str,
                                                              windows: str) -> None:
    """Whole blocks, and ragged windows chosen at random per request and step (any choice
    made before the target's verdict keeps the output exact)."""
    prompt = [1, 2, 3]
    target = small_vocab(kind)
    p2, p3 = exact_marginals(target, prompt, SAMPLED)
    engine = engine_with(target, SkewedProposer(16, gamma=3), max_batch_size=500,
                         windows=windows)
    outs = sample_many(engine, prompt, SAMPLED, 3000)
    assert engine.stats()["spec_accepted_drafts"] > 0  # some drafts were accepted...
    assert min(engine.stats()["spec_correct_drafts_histogram"][:1]) > 0  # ...and some rejected
    if windows == "random":
        hist = engine.budget.draft_histogram  # ragged: plain rows and several widths ran
        assert hist[0] > 0 and sum(n > 0 for n in hist) >= 3
    assert chi2_pvalue([o[1] for o in outs], p2) > 1e-3
    assert chi2_pvalue([o[2] for o in outs], p3) > 1e-3


@pytest.mark.parametrize(("kind", "windows"), [("k2", "full"), ("k3-replay", "full"),
                                               ("k3-scratch", "random")])
def test_a_wrong_rejection_rule_is_caught(small_vocab: Any, kind: str, windows: str) -> None:
    prompt = [1, 2, 3]
    target = small_vocab(kind)
    p2, _ = exact_marginals(target, prompt, SAMPLED)
    # Wrong: at a rejection, resample from p instead of normalize(max(p - q, 0)).
    engine = engine_with(target, SkewedProposer(16, gamma=3), max_batch_size=500,
                         residual_rule=lambda p, q: p, windows=windows)
    # Random windows reject less often (a fifth of the rows get no draft, a third of the rest
    # none at the first position): twice the samples keep the test's power (measured over two
    # disjoint 3,000-sample slices: largest p-value 1.1e-16, K2; K3 1.4e-19).
    outs = sample_many(engine, prompt, SAMPLED,
                       WRONG_RULE_SAMPLES * (2 if windows == "random" else 1))
    assert chi2_pvalue([o[1] for o in outs], p2) < 1e-6


def test_seeded_sampling_is_reproducible(pair: tuple[Path, Path]) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, seed=123,
                            ignore_eos=True)
    a = engine_from(pair).generate([[5, 6, 7]], params)[0].token_ids
    b = engine_from(pair).generate([[5, 6, 7]], params)[0].token_ids
    assert a == b and len(a) == 16


# --- stops ---------------------------------------------------------------------------------------


def test_stop_string_inside_an_accepted_block(target: KimiForCausalLM) -> None:
    prompt = [3, 1, 4, 1, 5]
    full = greedy_continuation(target, prompt, 24)
    text = detok(full)
    stop = text[9:11]
    cut = text.find(stop)
    engine = engine_with(target, OracleProposer(target, 7), detokenize=detok)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=(stop,),
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == full[: cut + len(stop)]
    assert out.spec is not None and out.spec["spec_verify_ct"] == 2  # 1 + 8 tokens, then the stop


def test_max_tokens_inside_a_block_and_streamed_text(target: KimiForCausalLM) -> None:
    prompt = [9, 8, 7]
    full = greedy_continuation(target, prompt, 12)
    engine = engine_with(target, OracleProposer(target, 7), detokenize=detok)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    pieces, outs = [], []
    while engine.has_work:
        for o in engine.step():
            assert o.request_id == rid
            pieces.append(o.text)
            outs.append(o)
    assert [t for o in outs for t in o.token_ids] == full[:6]
    assert "".join(pieces) == detok(full[:6])
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 6


def test_eos_as_the_bonus_token(target: KimiForCausalLM) -> None:
    prompt = [2, 7, 1, 8]
    full = greedy_continuation(target, prompt, 30)
    gamma = 3
    # The first verify commits full[1:5]; its bonus is full[4]. Make that token the EOS.
    j = next(j for j in range(4, 30, gamma + 1) if full[j] not in full[:j])
    engine = engine_with(target, OracleProposer(target, gamma))
    engine.eos_token_ids = frozenset({full[j]})
    for seq in engine.sequences.values():
        seq.eos_token_ids = engine.eos_token_ids
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:j]


# --- KV capacity ---------------------------------------------------------------------------------


def test_over_capacity_request_refused_while_others_continue(target: KimiForCausalLM) -> None:
    engine = engine_with(target, OracleProposer(target, 3), capacity=256)
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    with pytest.raises(KVCapacityError, match=r"needs 336 KV tokens .* KV capacity is 256"):
        engine.add_request(list(range(20)) * 14 + [1], SamplingParams(max_tokens=40))
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert next(o for o in outs if o.finished).request_id == a
    assert engine.capacity()["kv_tokens_used"] == 0


def test_requests_wait_for_capacity_and_abort_frees(target: KimiForCausalLM) -> None:
    engine = engine_with(target, OracleProposer(target, 3), capacity=256)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    first = engine.add_request(list(range(1, 31)), params)
    second = engine.add_request(list(range(1, 31)), params)  # 134 + 134 > 256: must wait
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == [first]
    assert engine.capacity()["kv_tokens_used"] > 0
    assert engine.abort(first)
    assert engine.capacity()["kv_tokens_used"] == 0
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == [second]
    assert engine.abort(second) and not engine.abort(second)
    slots = engine.scheduler.slots_total
    assert engine.capacity() == {"kv_tokens_total": 256, "kv_tokens_used": 0,
                                 "kv_tokens_evictable": 0,
                                 "kv_tokens_free": 256, "kv_tokens_reserved": 0,
                                 "state_slots_total": slots, "state_slots_used": 0,
                                 "state_slots_free": slots, "state_slots_reserved": 0}


def test_chunked_prefill_keeps_decodes_moving(pair: tuple[Path, Path]) -> None:
    # The long prompt may take the whole 8-token budget of a step (the per-request cap is
    # tested below); the short request is decoding beside it.
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, prefill_chunk_tokens=8,
                                max_prefill_tokens_per_request=8)
    engine = build_engine(build_runner(*pair, cfg), cfg)
    short = engine.add_request([4, 5], GREEDY)
    engine.step()
    long_prompt = list(range(1, 60))
    long = engine.add_request(long_prompt, GREEDY)
    short_progress = []
    while engine.sequences[long].num_cached < len(long_prompt):
        outs = engine.step()
        short_progress.append(sum(len(o.token_ids) for o in outs if o.request_id == short))
    assert len(short_progress) >= 7  # the 59-token prompt took several 8-token chunks
    assert all(n > 0 for n in short_progress[:-1])
    while engine.has_work:
        engine.step()
    unchunked = engine_from(pair, enabled=False).generate([long_prompt], GREEDY)[0].token_ids
    assert engine.totals.completion_tokens == 2 * GREEDY.max_tokens
    assert unchunked == engine_from(pair).generate([long_prompt], GREEDY)[0].token_ids


def first_token_steps(pair: tuple[Path, Path], cap: int | None, long_prompt: list[int],
                      short_prompt: list[int]) -> tuple[int, dict[str, list[int]]]:
    """Steps from the short prompt's arrival (one step into the long prefill) to its first
    token, and both requests' tokens."""
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, prefill_chunk_tokens=64,
                                max_prefill_tokens_per_request=cap)
    engine = build_engine(build_runner(*pair, cfg), cfg)
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    engine.add_request(long_prompt, GREEDY, "long")
    engine.step()
    engine.add_request(short_prompt, GREEDY, "short")
    steps = 0
    while engine.has_work:
        outs = engine.step()
        if not tokens["short"]:
            steps += 1
        for o in outs:
            tokens[o.request_id] += o.token_ids
    return steps, tokens


def test_a_short_prompt_is_not_queued_behind_a_long_prefill(pair: tuple[Path, Path]) -> None:
    long_prompt = [(7 * i) % 60 + 1 for i in range(400)]
    short_prompt = [4, 5, 6]
    # Default cap: 64 // 4 = 16 prompt tokens per request and step.
    capped, tokens = first_token_steps(pair, None, long_prompt, short_prompt)
    assert capped <= 2
    # The whole budget to the oldest (the old behaviour): the short prompt waits it out.
    uncapped, old_tokens = first_token_steps(pair, 64, long_prompt, short_prompt)
    assert uncapped >= (len(long_prompt) - 64) // 64
    # Chunking never changes what greedy decoding produces.
    alone = engine_from(pair).generate([long_prompt, short_prompt], GREEDY)
    assert tokens == old_tokens == {"long": alone[0].token_ids, "short": alone[1].token_ids}


def test_prefill_order_oldest_first_then_fewest_remaining() -> None:
    from serve_app.engines.reference.scheduler import Scheduler

    scheduler = Scheduler(10_000, 8, prefill_chunk_tokens=20, headroom_tokens=1,
                          max_prefill_tokens_per_request=8)
    seqs = {name: Sequence(name, [1] * n, GREEDY)
            for name, n in [("old", 30), ("big", 50), ("mid", 5), ("twelve", 12), ("tiny", 3)]}
    for seq in seqs.values():
        scheduler.add(seq)
    scheduler.admit()

    def plan() -> list[tuple[str, int, int]]:
        chunks = scheduler.schedule().prefill
        for c in chunks:
            c.seq.num_cached = c.end
        return [(c.seq.request_id, c.start, c.end) for c in chunks]

    # The oldest first; then fewest prompt tokens left; at most 8 each; 20 in all.
    assert plan() == [("old", 0, 8), ("tiny", 0, 3), ("mid", 0, 5), ("twelve", 0, 4)]
    for name in ("tiny", "mid"):
        seqs[name].status = seqs[name].status.DECODING
    assert plan() == [("old", 8, 16), ("twelve", 4, 12), ("big", 0, 4)]
    seqs["twelve"].status = seqs["twelve"].status.DECODING
    # Work-conserving: the 4 tokens the caps left over go to the oldest.
    assert plan() == [("old", 16, 28), ("big", 4, 12)]
    seqs["old"].status = seqs["old"].status.DECODING
    assert plan() == [("big", 12, 32)]  # alone, a prompt gets the whole step
    assert [s.request_id for s in scheduler.schedule().decode] == ["old", "mid", "twelve", "tiny"]


def test_prefill_cap_settings() -> None:
    from pydantic import ValidationError

    from serve_app.engines.reference.scheduler import Scheduler

    with pytest.raises(ValidationError, match="max_prefill_tokens_per_request=9 must be <= "
                       "prefill_chunk_tokens=8"):
        ReferenceEngineConfig(prefill_chunk_tokens=8, max_prefill_tokens_per_request=9)
    with pytest.raises(ValidationError, match="max_prefill_tokens_per_request"):
        ReferenceEngineConfig(max_prefill_tokens_per_request=0)
    with pytest.raises(ValueError, match="max_prefill_tokens_per_request=0"):
        Scheduler(100, 1, 8, 1, max_prefill_tokens_per_request=0)
    assert Scheduler(100, 1, 512, 1).max_prefill_tokens_per_request == 128
    assert Scheduler(100, 1, 3, 1).max_prefill_tokens_per_request == 1


# --- statistics ----------------------------------------------------------------------------------


def test_statistics_match_a_hand_counted_run(target: KimiForCausalLM) -> None:
    script = [3, 0, 7, 2, 5, 1]
    gamma, max_tokens = 7, 25
    it: Iterator[int] = iter(script)
    engine = engine_with(target, OracleProposer(target, gamma, lambda: next(it)))
    out = engine.generate([[6, 6, 6]], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True))[0]
    # By hand: 1 token from prefill, then each verify commits accepted + 1:
    # 3+1, 0+1, 7+1, 2+1, 5+1, and the last step may verify only 1 draft (25 - 23 - 1).
    assert max_tokens == 1 + 4 + 1 + 8 + 3 + 6 + 2
    assert out.spec == {
        "spec_verify_ct": 6,
        "spec_accept_length": 25 / 6,
        "spec_accept_rate": (3 + 0 + 7 + 2 + 5 + 1) / (7 + 7 + 7 + 7 + 7 + 1),
        "spec_correct_drafts_histogram": [1, 1, 1, 1, 0, 1, 0, 1],
        "spec_proposed_drafts": 36,
        "spec_accepted_drafts": 18,
    }
    assert out.token_ids == greedy_continuation(target, [6, 6, 6], max_tokens)


def test_engine_without_draft_and_bad_requests(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, draft=False)
    assert engine.stats()["speculative"] is False
    out = engine.generate([[1, 2]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.spec is None
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's context length 2048"):
        engine.add_request([1] * 2040, GREEDY)
    with pytest.raises(ValueError, match="max_tokens=0 must be an int > 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request([1], SamplingParams(stop=("x",)))


# --- tensor parallel -----------------------------------------------------------------------------



def _tp_job(engine: EngineCore, prompts: list[list[int]]) -> tuple:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)], engine.stats()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shared memory", "gloo"])
def test_tp2_matches_tp1(pair: tuple[Path, Path], transport: str) -> None:
    """Over the ranks' shared memory (on one host) and over gloo (across hosts)."""
    prompts = random_prompts(4, 64, seed=9)
    single = engine_from(pair)
    expected = [o.token_ids for o in single.generate(prompts, GREEDY)]
    tokens, stats = run_tensor_parallel(pair, ReferenceEngineConfig(kv_capacity_tokens=4096), 2,
                                        _tp_job, (prompts,),
                                        host_memory=transport == "shared memory")
    assert tokens == expected
    # The sharded draft proposes the same tokens, so acceptance is identical too.
    reference = single.stats()
    for key in ("spec_verify_ct", "spec_correct_drafts_histogram", "spec_accepted_drafts"):
        assert stats[key] == reference[key]


def test_generated_request_ids_are_unique(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, enabled=False)
    ids = {engine.add_request([1], GREEDY) for _ in range(5)}
    assert len(ids) == 5 and all(i.startswith("req-") for i in ids)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], GREEDY, request_id=next(iter(ids)))


@pytest.mark.parametrize("vocab", [4096, 163_840])
@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
@pytest.mark.parametrize("shape", ["plain", "ties", "top_k_zeros"])
def test_top_p_by_values_keeps_what_the_full_sort_keeps(vocab: int, scale: float,
                                                        shape: str) -> None:
    """The CPU top-p path (numpy's sort of the values, the cut by value) against torch's full
    sort, on the embedded pair's and K3's vocabularies: flat to peaked rows, a block of tied
    maxima, rows whose upper half top-k removed, top_p from the smallest double to almost 1.
    The same tokens kept where no probabilities tie; with ties, as many tokens and the same
    values (which of several equal probabilities is kept is arbitrary on either path)."""
    from serve_app.engines.reference.sampling import _top_p_by_sort, _top_p_by_values

    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(4, vocab, generator=g) * scale
    if shape == "ties":
        logits[:, : vocab // 160] = logits[:, :1].clone()
    if shape == "top_k_zeros":
        logits[:, vocab // 2:] = float("-inf")
    probs = torch.softmax(logits, -1)
    for top_p in (5e-324, 0.1, 0.5, 0.95, 0.999999):
        by_sort, by_values = _top_p_by_sort(probs, top_p), _top_p_by_values(probs, top_p)
        if shape == "plain":
            assert torch.equal(by_sort, by_values), top_p
        assert torch.equal(by_sort.sum(-1), by_values.sum(-1)), top_p
        assert torch.equal((probs * by_sort).sort(-1).values,
                           (probs * by_values).sort(-1).values), top_p


def test_a_batch_walks_each_request_as_it_would_walk_alone() -> None:
    """`verify_batch` (the engine's verify) gives each request exactly the verdict
    `verify_drafts` gives it alone from the same generator state, and the generator ends in the
    same state: the walks share the target's rows and draws, not randomness. The batch mixes
    greedy and sampled requests, sampling settings, ragged windows (0-7 drafts), one-hot and
    NaN draft rows, a draft that is not a token, a grammar mask, and one request whose logits
    are not finite, which fails alone."""
    from serve_app.engines.reference.sampling import (
        SamplingError,
        verify_batch,
        verify_drafts,
    )

    vocab = 64
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.6,
                                                                           top_p=0.95),
                SamplingParams(temperature=0.7, top_k=5)]
    for trial in range(40):
        rng = random.Random(trial)
        gen = torch.Generator().manual_seed(trial)
        batch = []
        for b in range(rng.randint(1, 9)):
            k = rng.randint(0, 7)
            logits = torch.randn(k + 1, vocab, generator=gen) * rng.choice([0.5, 2.0, 6.0])
            q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, -1)
            # Drafts the draft's q would propose, mostly: some rows accepted deep.
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            if k and rng.random() < 0.5:
                drafts = [int(t) for t in logits[:k].argmax(-1)]
            kind = rng.random()
            q_in: torch.Tensor | None = q
            allowed = None
            if kind < 0.1:
                q_in = None  # one-hot proposals
            elif kind < 0.2 and k:
                q_in = q.clone()
                q_in[rng.randrange(k)] = float("nan")
            elif kind < 0.3 and k:
                drafts[rng.randrange(k)] = vocab + 3  # not a token
            elif kind < 0.4:
                allowed = torch.rand(k + 1, vocab, generator=gen) < 0.7
                allowed[:, 0] = True
            elif kind < 0.45:
                logits[rng.randrange(k + 1)] = float("nan")
            batch.append((logits, drafts, q_in, rng.choice(settings), 1000 * trial + b, allowed))
        alone, alone_state = [], []
        for logits, drafts, q, params, seed, allowed in batch:
            g = torch.Generator().manual_seed(seed)
            try:
                alone.append(verify_drafts(logits, drafts, q, params, g, allowed=allowed))
            except SamplingError as exc:
                alone.append(exc)
            alone_state.append(g.get_state())
        generators = [torch.Generator().manual_seed(seed) for *_, seed, _ in batch]
        together = verify_batch([x[0] for x in batch], [x[1] for x in batch],
                                [x[2] for x in batch], [x[3] for x in batch], generators,
                                allowed=[x[5] for x in batch])
        for a, t, state, g in zip(alone, together, alone_state, generators, strict=True):
            if isinstance(a, Exception):
                assert isinstance(t, SamplingError)
            else:
                assert isinstance(t, type(a)) and (t.tokens, t.accepted) == (a.tokens, a.accepted)
            assert torch.equal(g.get_state(), state)
