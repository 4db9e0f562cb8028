"""The draft's training forward computes exactly what its inference path computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import write_tiny_pair

from serve_app.models.dspark import DSparkDraft, block_attention_mask, load_dspark
from serve_app.models.kimi import KimiForCausalLM
from serve_app.models.kimi_weights import load_kimi
from serve_app.training.common import cosine_lr
from serve_app.training.train_draft import (
    MODES,
    draft_loss,
    expected_accept_length,
    mode_acceptance,
    next_anchors,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[KimiForCausalLM, DSparkDraft]:
    t, d = write_tiny_pair(tmp_path_factory.mktemp("train_pair"), seed=5)
    return load_kimi(t), load_dspark(d)


def target_taps(target: KimiForCausalLM, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The target's taps of a whole sequence: one cached prefill, as the engine computes them."""
    cache = target.new_cache(256)
    cache.add(0)
    out = target(ids, cache, [0], torch.tensor([ids.shape[1]]), capture_layers=layers)
    assert out.taps is not None
    return out.taps


def test_draft_forward_train_matches_draft_at_every_anchor(pair: tuple) -> None:
    """Several anchors in one training forward, each equal to an inference draft step whose
    cache holds exactly the context rows before that anchor."""
    target, draft = pair
    gamma = draft.config.block_size
    layers = list(draft.config.target_layer_ids)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    g = torch.Generator().manual_seed(1)
    anchors = [3, 11, 19]
    ids = torch.randint(0, 60, (1, 40), generator=g)
    # Inference first; then write each block's greedy drafts into the sequence after its
    # anchor, so the teacher-forced Markov inputs of training equal inference's choices.
    expected_logits, expected_conf = [], []
    for p in anchors:
        taps = target_taps(target, ids, layers)
        cache = draft.new_cache(128)
        cache.add(0)
        draft.append_context(cache, [0], [taps[0, :p]])
        out = draft.draft(cache, [0], ids[:, p], embed, head)
        ids[0, p + 1:p + gamma] = out.tokens[0, : gamma - 1]
        expected_logits.append(out.logits[0])
        expected_conf.append(out.confidence[0])
    # Later anchors' blocks were written after earlier ones: recompute every expectation on
    # the final sequence (the blocks do not overlap, so earlier drafts are unchanged).
    taps = target_taps(target, ids, layers)
    for i, p in enumerate(anchors):
        cache = draft.new_cache(128)
        cache.add(0)
        draft.append_context(cache, [0], [taps[0, :p]])
        out = draft.draft(cache, [0], ids[:, p], embed, head)
        expected_logits[i], expected_conf[i] = out.logits[0], out.confidence[0]
    res = draft.forward_train(taps, ids, torch.tensor([anchors]), embed, head)
    for i in range(len(anchors)):
        torch.testing.assert_close(res.logits[0, i], expected_logits[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(res.confidence[0, i], expected_conf[i], rtol=1e-4, atol=1e-4)


def test_block_mask_sees_context_before_the_anchor_and_its_own_block() -> None:
    mask = block_attention_mask(torch.tensor([[2, 5]]), context_len=8, gamma=3)[0, 0]
    assert mask.shape == (6, 8 + 6)
    assert mask[0, :8].tolist() == [True, True] + [False] * 6
    assert mask[4, :8].tolist() == [True] * 5 + [False] * 3
    assert mask[0, 8:].tolist() == [True] * 3 + [False] * 3
    assert mask[5, 8:].tolist() == [False] * 3 + [True] * 3


def test_draft_loss_when_the_draft_equals_the_target() -> None:
    """A draft with the target's logits agrees greedily everywhere; sampled, it still loses the
    mass it puts outside the target's top_p nucleus (q samples without top_p), which is what
    the TV term trains away, so its acceptance is below 1 but at least top_p."""
    logits = torch.randn(2, 3, 7, 11)
    loss, parts, accept = draft_loss(logits, torch.full((2, 3, 7), 0.999), logits)
    assert accept.shape == (len(MODES), 2, 3, 7)
    assert bool((accept[0] == 1).all())
    assert bool((accept[1:] >= 0.95 - 1e-5).all()) and bool((accept[1:] < 1).any())
    assert 0 < parts["tv"] <= 0.05 + 1e-5
    assert expected_accept_length(torch.ones(7)) == 8.0
    assert expected_accept_length(torch.zeros(7)) == 1.0
    assert loss > 0  # the CE term remains


def test_the_trained_acceptance_is_the_engines_acceptance() -> None:
    """mode_acceptance's sampled rows are the chance the engine's rejection rule
    (`verify_drafts`) accepts a draft token drawn from the draft's q at the mode's temperature,
    against the target's truncated p: measured over 4,000 verifications per mode, within 4
    binomial standard deviations."""
    from serve_app.engines.reference.sampling import SamplingParams, verify_drafts

    gen = torch.Generator().manual_seed(11)
    target = torch.randn(1, 1, 1, 9, generator=gen) * 2
    draft = torch.randn(1, 1, 1, 9, generator=gen) * 2
    accept = mode_acceptance(draft, target)
    assert accept[0].item() == float(draft.argmax() == target.argmax())
    n = 4000
    for mode, (temperature, top_p) in enumerate(MODES[1:], start=1):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        q = torch.softmax(draft[0, 0] / temperature, -1)  # [1, 9]
        tokens = torch.multinomial(q[0], n, replacement=True, generator=gen).tolist()
        rows = torch.cat([target[0, 0], torch.zeros(1, 9)])  # row 1: the bonus row
        hits = sum(verify_drafts(rows, [t], q, params, gen).accepted for t in tokens)
        a = accept[mode].item()
        assert abs(hits / n - a) <= 4 * (a * (1 - a) / n) ** 0.5 + 1e-9, (mode, hits / n, a)


def test_next_anchors_walk_the_engines_acceptance() -> None:
    """A block's next anchor is p + accepted + 1: every draft accepted gives p + gamma + 1,
    none p + 1, and a sure first row then a sure rejection p + 2."""
    anchors = torch.tensor([[5, 10, 20]])
    accept = torch.tensor([[[1.0] * 7, [0.0] * 7, [1.0] + [0.0] * 6]])
    assert next_anchors(anchors, accept, torch.Generator()).tolist() == [[13, 11, 22]]


def test_lr_schedule_warms_up_then_decays() -> None:
    assert cosine_lr(0.0, 0, 1.0, warmup=10) == pytest.approx(0.1)
    assert cosine_lr(0.5, 50, 1.0, warmup=10) == pytest.approx(0.55)
    assert cosine_lr(1.0, 99, 1.0, warmup=10) == pytest.approx(0.1)


def test_heldout_split_is_stable() -> None:
    from serve_app.training.corpus import is_heldout

    assert [is_heldout(f"m{i}.py") for i in range(3)] == [is_heldout(f"m{i}.py") for i in range(3)]


def test_draft_batch_targets_equal_the_full_forward() -> None:
    """_batch reads the K3 target's taps by K3's convention and computes its logits only at
    block rows; both equal the serving forward's (capture_layers)."""
    from tiny_models import random_k3, tiny_k3_config

    from serve_app.training import train_draft as td

    target = random_k3(tiny_k3_config(), seed=3)
    layers = td.tap_layers(target)
    assert layers == (1, 3, 5, 7)  # both MLA layers (3, 7), the last one included
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[1, 9], [4, 16]])
    taps, tlogits, labels = td._batch(target, ids, anchors)
    logits, _, full_taps = target.capture_layers(ids, layers)
    rows = anchors[:, :, None] + torch.arange(td.GAMMA)
    for b in range(2):
        torch.testing.assert_close(tlogits[b], logits[b, rows[b]])
        assert labels[b].tolist() == ids[b, rows[b] + 1].tolist()
    torch.testing.assert_close(taps, full_taps)


def test_loop_detection_tells_a_loop_from_code() -> None:
    from serve_app.training.evaluate import is_looping, repeated_ngram_coverage

    loop = [5, 6, 7, 8, 9] * 6 + [1, 2]
    assert is_looping(loop) and repeated_ngram_coverage(loop) > 0.9
    varied = [*range(40), 3, 4, 5, 6, *range(100, 116)]  # one repeated 4-gram
    assert repeated_ngram_coverage(varied) == pytest.approx(8 / 60)
    assert not is_looping(varied)
    assert not is_looping([1, 1, 1])  # too short to say


@pytest.mark.slow
def test_the_recipe_runs_end_to_end(tmp_path: Path) -> None:
    """The committed training command, short: the same code (`all`: the K3 target, then its
    vision tower, then its DSpark draft, then the cards) on 24 training files for 6
    steps each. It must learn (held-out perplexity clearly under its initial ~4,200), write
    loadable folders that record how they were made, and yield a lossless speculative pair and
    a target whose tower loads and was measured on the held-out images."""
    import json
    import shutil
    import subprocess
    import sys

    from serve_app.embedded import DRAFT, TARGET, TOKENIZER
    from serve_app.models.dspark import load_dspark
    from serve_app.models.k3_weights import load_k3
    from serve_app.training.train_draft import tap_layers

    shutil.copytree(TOKENIZER, tmp_path / TOKENIZER.name)
    # A step budget (the wall-time one far away), so what is checked does not depend on the
    # machine's speed: 6 steps measured held-out perplexity 2,957 (seed 3, 30% of the tokens
    # K3 conversations; the held-out file's 2,966 tokens in 5 windows), against ~4,200 at
    # initialisation.
    # One thread: beside the other xdist workers a second one mostly spins (measured alone:
    # 41 s wall / 66 CPU-s at 2 threads, 55 s / 55 CPU-s at 1; the same perplexity).
    # The draft trains on continuations a quarter as long (32 new tokens, not 128): the
    # target generates them, and the draft's steps and held-out measurement run on them (the
    # command alone, back to back: 73 s at 128 new tokens, 62 s at 32).
    argv = ["all", "--budget-minutes", "20", "--max-steps", "6", "--max-files", "24",
            "--eval-prompts", "2", "--vision-heldout-per-kind", "2", "--draft-new-tokens", "32",
            "--seed", "3", "--threads", "1", "--out", str(tmp_path)]
    run = subprocess.run([sys.executable, "-m", "serve_app.training", *argv],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "target   [" in run.stdout and "draft    [" in run.stdout  # the progress bars
    tm = json.loads((tmp_path / TARGET.name / "training_metrics.json").read_text())
    dm = json.loads((tmp_path / DRAFT.name / "training_metrics.json").read_text())
    assert tm["steps"] == dm["steps"] == 6 and tm["train_tokens_per_s"] > 0
    assert tm["heldout_perplexity"] < 3400  # at initialisation ~4,200 (uniform: 4,096)
    for m in (tm, dm):
        assert m["provenance"]["command"] == "python -m serve_app.training " + " ".join(argv)
        assert m["provenance"]["torch"] == torch.__version__
    target = load_k3(tmp_path / TARGET.name)
    draft = load_dspark(tmp_path / DRAFT.name)
    assert tuple(draft.config.target_layer_ids) == tap_layers(target)
    assert dm["engine_heldout_greedy"]["identical_to_target_only"] is True
    # Measured at K3 thinking too, on held-out thinking generations, one value per block row.
    thinking = dm["heldout_thinking_acceptance_by_row"]
    assert len(thinking) == draft.config.block_size and all(0 < a < 1 for a in thinking)
    card = (tmp_path / TARGET.name / "MODEL_CARD.md").read_text()
    assert tm["provenance"]["command"] in card and str(tm["heldout_perplexity"]) in card
    from serve_app.models.moonvit import load_k3_vision

    vm = tm["vision"]
    assert "vision   [" in run.stdout and vm["steps"] == 6
    assert vm["provenance"]["command"] == tm["provenance"]["command"]
    for mode, temperature in (("thinking", 1.0), ("instant", 0.6)):
        held = vm["heldout"][mode]
        assert (held["temperature"], held["top_p"]) == (temperature, 0.95)
        assert held["questions_by_kind"] == {"colour": 2, "shape": 2, "digit": 2, "word": 2}
    vision = load_k3_vision(tmp_path / TARGET.name)
    assert vision is not None and vision.config.text_hidden_size == target.config.hidden_size
    config = json.loads((tmp_path / TARGET.name / "config.json").read_text())
    assert config["media_placeholder_token_id"] == 4092
    assert (tmp_path / TARGET.name / "preprocessor_config.json").exists()
    assert "## Vision" in card


def test_thread_tuner_keeps_the_faster_count() -> None:
    from serve_app.training.common import ThreadTuner

    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, every_s=10.0, trial=2)
        assert tuner.current == 2
        tuner.record(1.0)
        tuner.record(1.0)  # 2 steps timed at 2 threads: the first trial (1 thread) starts
        assert tuner.trying == 1 and torch.get_num_threads() == 1
        tuner.record(0.5)
        tuner.record(0.5)  # 1 thread is faster (a busy machine): keep it
        assert tuner.current == 1 and tuner.trying is None and torch.get_num_threads() == 1
        for _ in range(19):
            tuner.record(0.5)  # 9.5 s of steps: no trial yet
        assert tuner.trying is None
        tuner.record(0.5)  # 10 s: try 2 threads again
        assert tuner.trying == 2
        tuner.record(5.0)  # far slower: the trial ends after one step, and backs off
        assert tuner.trying is None and tuner.current == 1 and torch.get_num_threads() == 1
        assert tuner.every_s == 20.0
    finally:
        torch.set_num_threads(before)
