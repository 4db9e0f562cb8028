"""The reference engine on the Kimi K3 hybrid (KDA + MLA): lossless speculation with KDA state
rollback by both strategies, state slots as a resource, and TP 2. (Exact sampling on the
hybrid: test_reference_engine.py's chi-square tests run on both families.)

The pair is a random K3-layout target at test-suite widths (tiny_models.tiny_k3_config: the mini
K3's 8-layer layout, AttnRes, latent MoE) and a DSpark draft tapping it by K3's convention."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from spec_helpers import (
    GREEDY,
    OracleProposer,
    engine_from,
    engine_with,
    random_prompts,
    run_staggered,
    run_tensor_parallel,
)
from tiny_models import tiny_k3_config, write_random_k3_pair

from capacity.families import descriptor_from_config
from serve_app.config import ReferenceEngineConfig
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.models.k3 import kda_sizes
from serve_app.models.k3_paged import PagedK3
from serve_app.models.k3_weights import load_k3
from serve_app.models.kda import KDAState, KimiDeltaAttention

ROLLBACKS = ["scratch", "replay"]
VOCAB = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_random_k3_pair(tmp_path_factory.mktemp("k3pair"), tiny_k3_config(VOCAB))


def hybrid(pair: tuple[Path, Path], rollback: str, slots: int = 64) -> PagedK3:
    return PagedK3(load_k3(pair[0]).eval(), slots, rollback)  # type: ignore[arg-type]


def prompts_crossing_chunks() -> list[list[int]]:
    """Short prompts and three that cross KDA chunks (kda.KDA_CHUNK = 16 tokens) inside and
    across 40-token prefill steps, so chunked prefill carries the state over boundaries of both
    kinds."""
    rng = random.Random(5)
    long = [[rng.randrange(VOCAB - 3) for _ in range(n)] for n in (70, 131, 90)]
    return random_prompts(5, VOCAB - 2, seed=1) + long


CHUNKED = {"prefill_chunk_tokens": 40, "max_prefill_tokens_per_request": 40}


@pytest.fixture(scope="module")
def reference_outputs(pair: tuple[Path, Path]) -> tuple[list[list[int]], list[list[int]]]:
    prompts = prompts_crossing_chunks()
    return prompts, run_staggered(engine_from(pair, enabled=False, engine=CHUNKED), prompts)


def test_the_builder_serves_the_hybrid_target(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, engine={"state_slots": 5})
    assert isinstance(engine.runner.target, PagedK3)
    assert engine.capacity()["state_slots_total"] == 5
    # The draft taps K3's layers by SGLang's convention (0-based ids, the last via the
    # output read): its context rows were fed from the target's taps of those layers.
    draft = json.loads((pair[1] / "config.json").read_text())
    assert engine.runner.proposer.tap_layers == tuple(draft["dflash_config"]["target_layer_ids"])


def test_a_chunked_prefill_equals_one_forward_of_the_whole_prompt(pair: tuple[Path, Path]
                                                                 ) -> None:
    prompt = prompts_crossing_chunks()[-2]  # 131 tokens: chunks 0-40-80-120-131
    whole = engine_from(pair, enabled=False).generate([prompt], GREEDY)[0].token_ids
    chunked = engine_from(pair, enabled=False, engine=CHUNKED).generate([prompt], GREEDY)
    assert chunked[0].token_ids == whole


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_dspark_greedy_is_lossless_on_the_hybrid(pair: tuple[Path, Path],
                                                 reference_outputs: tuple, rollback: str,
                                                 gamma: int, threshold: float) -> None:
    prompts, expected = reference_outputs
    engine = engine_from(pair, engine=CHUNKED, gamma=gamma, confidence_threshold=threshold,
                         kda_rollback=rollback)
    assert engine.runner.target.rollback == rollback
    assert run_staggered(engine, prompts) == expected
    assert engine.stats()["spec_verify_ct"] > 0


def test_a_batch_above_the_speculation_limit_decodes_plainly_and_stays_exact(
        pair: tuple[Path, Path],
        reference_outputs: tuple[list[list[int]], list[list[int]]]) -> None:
    """speculation.max_batch_size 2: while more than 2 requests decode, a step proposes nothing
    and decodes plainly, capturing the taps the draft's context needs; when the batch shrinks,
    speculation resumes from a complete context. Outputs equal target-only's."""
    prompts, expected = reference_outputs
    engine = engine_from(pair, engine=CHUNKED, max_batch_size=2)
    runner, proposer = engine.runner, engine.runner.proposer
    assert proposer is not None
    proposed: list[int] = []
    decoded: list[int] = []
    propose, decode = runner.propose, engine._decode

    def counting_propose(seqs):  # type: ignore[no-untyped-def]
        proposed.append(len(seqs))
        return propose(seqs)

    def checking_decode(seqs):  # type: ignore[no-untyped-def]
        decoded.append(len(seqs))
        ok = decode(seqs)
        # The draft's context holds every committed token but the anchor (its taps come
        # with the next forward), after plain steps and speculative ones alike: written as
        # rows, or held until it next drafts for the request.
        for seq in ok:
            held = sum(len(t) for t in proposer.held.get(seq.request_id, []))
            assert held == proposer.held_tokens.get(seq.request_id, 0)
            assert proposer.cache.length(seq.request_id) + held == seq.num_cached
        return ok

    runner.propose = counting_propose  # type: ignore[method-assign]
    engine._decode = checking_decode  # type: ignore[method-assign]
    assert run_staggered(engine, prompts) == expected
    assert max(proposed) <= 2 < max(decoded)  # both kinds of step ran
    stats = engine.stats()
    assert stats["spec_verify_ct"] > len(proposed)  # plain steps count as target steps


@pytest.mark.parametrize("rollback", ROLLBACKS)
@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("mode", ["oracle", "partial"])
def test_full_partial_and_zero_acceptance_roll_the_state_back_exactly(
    pair: tuple[Path, Path], reference_outputs: tuple, rollback: str, gamma: int, mode: str
) -> None:
    prompts, expected = reference_outputs
    if mode == "oracle":  # full acceptance needs few steps to show; two short, two long
        prompts, expected = prompts[3:7], expected[3:7]
    target = hybrid(pair, rollback)
    rng = random.Random(gamma)
    correct = None if mode == "oracle" else (lambda: rng.randint(0, gamma))
    engine = engine_with(target, OracleProposer(target, gamma, correct), **CHUNKED)
    assert run_staggered(engine, prompts) == expected
    hist = engine.stats()["spec_correct_drafts_histogram"]
    if mode == "oracle":
        # Every block fully accepted, except where max_tokens capped the verify width.
        assert hist[gamma] > 0 and sum(hist[:gamma]) <= len(prompts)
    else:
        assert (hist[0] > 0 and hist[gamma] > 0 and sum(hist[1:gamma]) > 0) or gamma == 1


def test_lazy_window_commits_the_state_the_scratch_keeps() -> None:
    """The lazy window (outputs from the chunk form, only the accepted state formed at commit)
    gives the outputs and, for every accepted prefix, the state that keeping every position's
    state gives. Different association orders: measured at most 2.7e-7 of the largest value
    apart (20 seeds), hence the 1e-5 bound; the conv windows are slices, equal."""
    torch.manual_seed(0)
    attn = KimiDeltaAttention(kda_sizes(tiny_k3_config()))
    state = KDAState(torch.randn(2, 3, 3 * attn.sizes.projection_size),
                     torch.randn(2, attn.num_heads, attn.head_dim, attn.head_dim))
    x = torch.randn(2, 8, attn.sizes.hidden_size)
    with torch.no_grad():
        y_scratch, windows = attn.forward_window(x, state)
        y_lazy, log = attn.forward_logged(x, state)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())

    assert close(y_lazy, y_scratch)
    for row in range(2):
        for step in range(8):
            replayed = log.replay(torch.tensor([row]), state.ssm[row:row + 1],
                                  torch.tensor([step]))
            assert close(replayed.ssm[0], windows.ssm[row, step])
            assert torch.equal(replayed.conv[0], windows.conv[row, step])
    # Both requests at once, each at its own accepted position.
    both = log.replay(torch.tensor([1, 0]), state.ssm[[1, 0]], torch.tensor([2, 6]))
    assert close(both.ssm, torch.stack([windows.ssm[1, 2], windows.ssm[0, 6]]))
    assert torch.equal(both.conv, torch.stack([windows.conv[1, 2], windows.conv[0, 6]]))
    # A wrong position is not close: the check can fail.
    assert not close(log.replay(torch.tensor([0]), state.ssm[:1], torch.tensor([5])).ssm[0],
                     windows.ssm[0, 6])


def test_a_ragged_verify_runs_its_position_wise_parts_on_real_tokens_only(
        pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged verify (windows of 8, 1 and 3 tokens, right-padded to 8) keeps its residual
    stream packed: every layer's MLP or MoE and both attention kinds' projections run over its
    12 real tokens, not 24 rows x width; each real position's logits are the padded batch's
    (the blocks are position-wise: same math, other matmul shapes, so within 1e-4 of the
    largest logit; measured identical on this CPU). Both KDA rollbacks."""
    from serve_app.models import kv_cache

    prompts = random_prompts(3, VOCAB - 2, seed=9)
    windows = [[5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16]]
    ids = torch.zeros(3, 8, dtype=torch.long)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(w)
    counts = torch.tensor([len(w) for w in windows])

    def run(rollback: str) -> tuple[torch.Tensor, set[tuple[str, int]]]:
        target = hybrid(pair, rollback)
        cache = target.new_cache(1024)
        for r, prompt in enumerate(prompts):
            cache.add(r)
            target(torch.tensor([prompt]), cache, [r], torch.tensor([len(prompt)]))
        sizes: set[tuple[str, int]] = set()
        hooks = [module.register_forward_pre_hook(
                     lambda m, args, _n=name: sizes.add((_n, args[0].shape[:-1].numel())))
                 for layer in target.model.model.layers
                 for name, module in (("mlp", layer.mlp), ("attention", layer.self_attn.o_proj))]
        try:
            logits = target(ids, cache, [0, 1, 2], counts, verify=True).logits
        finally:
            for hook in hooks:
                hook.remove()
        return logits, sizes

    original = kv_cache.PagedKVCache.batch

    def unpacked(self: kv_cache.PagedKVCache, *args: object) -> kv_cache.PagedBatch:
        batch = original(self, *args)  # type: ignore[arg-type]
        batch.packed = None
        return batch

    for rollback in ("scratch", "replay"):
        packed, sizes = run(rollback)
        assert sizes == {("mlp", 12), ("attention", 12)}, sizes
        with monkeypatch.context() as m:
            m.setattr(kv_cache.PagedKVCache, "batch", unpacked)
            padded, sizes = run(rollback)
        assert sizes == {("mlp", 24), ("attention", 24)}, sizes  # the padded layout: 3 x 8
        scale = float(padded.abs().max())
        for b, w in enumerate(windows):
            gap = float((packed[b, : len(w)] - padded[b, : len(w)]).abs().max())
            assert gap <= 1e-4 * scale, (rollback, b, gap)


# --- state slots ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_state_slot_is_what_the_planner_says_a_request_holds(pair: tuple[Path, Path],
                                                               dtype: str) -> None:
    engine = engine_from(pair, engine={"dtype": dtype, "state_slots": 3}, enabled=False)
    pool = engine.runner.cache.states
    allocated = sum(s.conv.nbytes + s.ssm.nbytes for s in pool.layers.values())
    planner = descriptor_from_config(json.loads((pair[0] / "config.json").read_text()),
                                     "tiny K3", str(pair[0]))
    conv_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    assert allocated == 3 * planner.kda_state_bytes(conv_bytes=conv_bytes, ssm_bytes=4)
    assert pool.bytes_per_slot == planner.kda_state_bytes(conv_bytes=conv_bytes)


def test_abort_mid_stream_frees_the_slot_and_pages_at_once(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, engine={"state_slots": 2})
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    rid = engine.add_request([5, 6, 7], long)
    for _ in range(3):
        engine.step()
    cap = engine.capacity()
    assert cap["state_slots_used"] == 1 and cap["kv_tokens_used"] > 0
    assert engine.runner.cache.states.used == 1
    assert engine.abort(rid)
    cap = engine.capacity()
    assert cap["state_slots_used"] == 0 and cap["kv_tokens_used"] == 0
    assert engine.runner.cache.states.used == 0 and engine.runner.proposer.cache.allocator.used_tokens == 0


def test_a_request_with_kv_room_but_no_slot_waits_for_one(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, engine={"state_slots": 1})
    first = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True))
    second = engine.add_request([8, 9], GREEDY)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == [first]
    cap = engine.capacity()
    assert cap["kv_tokens_free"] > 1000 and cap["state_slots_free"] == 0
    finished = []
    while engine.has_work:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [first, second]
    expected = engine_from(pair, enabled=False).generate([[8, 9]], GREEDY)[0].token_ids
    assert engine.generate([[8, 9]], GREEDY)[0].token_ids == expected


def test_slots_are_never_over_committed_under_a_burst(pair: tuple[Path, Path]) -> None:
    engine = engine_from(pair, engine={"state_slots": 3, "max_batch_size": 8})
    prompts = random_prompts(12, VOCAB - 2, seed=4)
    params = SamplingParams(temperature=0.7, max_tokens=6, seed=1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: set[str] = set()
    peak = 0
    while engine.has_work:
        done |= {o.request_id for o in engine.step() if o.finished}
        cap = engine.capacity()
        peak = max(peak, cap["state_slots_used"])
        assert cap["state_slots_used"] == engine.runner.cache.states.used <= 3
    assert done == set(ids) and peak == 3 and engine.runner.cache.states.used == 0


# --- tensor parallel -----------------------------------------------------------------------------


def _tp_job(engine: EngineCore, prompts: list[list[int]]) -> tuple:
    outs = engine.generate(prompts, GREEDY)
    stats = engine.stats()
    # Again: prefix-cache hits, whose matches, snapshots and copies every rank makes.
    again = engine.generate(prompts, GREEDY)
    return ([o.token_ids for o in outs], stats, engine.runner.cache.states.bytes_per_slot,
            [o.token_ids for o in again], [o.cached_tokens for o in again])


@pytest.mark.slow
def test_tp2_matches_tp1_on_the_hybrid(pair: tuple[Path, Path]) -> None:
    prompts = prompts_crossing_chunks()[3:7]
    # Fixed windows: the statistics are compared across engines, and the adaptive budget's
    # windows follow each engine's measured step times (CI: 92 verifies against 91).
    single = engine_from(pair, engine=CHUNKED, kda_rollback="replay", adaptive=False)
    expected = [o.token_ids for o in single.generate(prompts, GREEDY)]
    cfg = ReferenceEngineConfig(kv_capacity_tokens=4096, **CHUNKED,
                                speculation={"kda_rollback": "replay",  # type: ignore[arg-type]
                                             "adaptive": False},
                                prefix_cache={"enabled": True, "snapshot_interval": 32,
                                              "decode_snapshot_interval": 32})
    tokens, stats, slot_bytes, again, cached = run_tensor_parallel(pair, cfg, 2, _tp_job,
                                                                   (prompts,))
    assert tokens == expected and again == expected
    assert sum(cached) > 0
    for key in ("spec_verify_ct", "spec_correct_drafts_histogram", "spec_accepted_drafts"):
        assert stats[key] == single.stats()[key]
    # Each rank holds half of every KDA layer's heads.
    assert 2 * slot_bytes == single.runner.cache.states.bytes_per_slot


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_the_hybrid_on_cuda_is_lossless(pair: tuple[Path, Path],
                                        reference_outputs: tuple, rollback: str) -> None:
    """fp32 on CUDA: the staggered batch equals the CUDA target-only run. bf16: per request
    at batch 1, since in bf16 a target-only output already depends on what it is batched with
    (on CPU too: a 5-request batch changed one request's 20th token with speculation off)."""
    prompts, _ = reference_outputs
    cuda = {**CHUNKED, "device": "cuda"}
    expected = run_staggered(engine_from(pair, enabled=False, engine=cuda), prompts)
    engine = engine_from(pair, engine=cuda, kda_rollback=rollback)
    assert engine.runner.cache.device.type == "cuda"
    assert run_staggered(engine, prompts) == expected
    bf16 = {**cuda, "dtype": "bfloat16"}
    plain = engine_from(pair, enabled=False, engine=bf16)
    spec = engine_from(pair, engine=bf16, kda_rollback=rollback)
    for prompt in prompts:
        assert (spec.generate([prompt], GREEDY)[0].token_ids
                == plain.generate([prompt], GREEDY)[0].token_ids)


def test_the_draft_holds_a_plain_steps_taps_as_views_and_a_windows_accepted_rows_copied(
        pair: tuple[Path, Path]) -> None:
    """What the runner hands the draft at commit (ModelRunner.commit): a plain step's taps as
    views of the step's one tensor (no copy per request), and of a verify window the accepted
    rows, copied unless they are the whole window (the rejected rows are not kept with them)."""
    runner = engine_from(pair).runner
    proposer = runner.proposer
    for rid in ("a", "b"):
        runner.add(rid)
    runner.forward([[5] * 6, [7] * 6], ["a", "b"], capture=True)
    runner.commit(["a", "b"], [6, 6], [6, 6])
    runner.forward([[1] * 8, [2] * 8], ["a", "b"], capture=True, verify=True)
    runner.commit(["a", "b"], [9, 14], [3, 8])
    partial, whole = proposer.held["a"][-1], proposer.held["b"][-1]
    assert partial.shape[0] == 3 and partial.untyped_storage().nbytes() == partial.nbytes
    assert whole.shape[0] == 8 and whole.untyped_storage().nbytes() == 2 * whole.nbytes
    runner.forward([[3], [4]], ["a", "b"], capture=True)
    runner.commit(["a", "b"], [10, 15], [1, 1])
    a_row, b_row = proposer.held["a"][-1], proposer.held["b"][-1]
    assert a_row.shape[0] == b_row.shape[0] == 1
    assert a_row.untyped_storage().data_ptr() == b_row.untyped_storage().data_ptr()
