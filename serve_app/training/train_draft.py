"""Train the DSpark draft on the target's own hidden states and distributions, for the way K3
is served.

Data: every step mixes windows of the training corpus with sequences the target generated
itself from training-corpus prompts, half of them chat requests in K3's format, in the three ways
a request decodes: greedy, and K3's two sampling modes (thinking T 1.0, instant T 0.6, both
top_p 0.95). The generated part is what the draft meets when the engine decodes, so it is where
most anchors are drawn; the context features always come from the target's taps over the whole
sequence, exactly what the inference path appends to the draft's cache.

On-policy anchors: the engine starts a block where the previous one was rejected. Half of a
step's generated sequences are carried from the step before, their anchors moved to where the
engine's next block would start after each of that step's blocks (`next_anchors`: the walk
through the draft's own acceptance, drawn from this draft), so the draft trains on the contexts
its own rejections lead to; the other half start fresh with uniform anchors.

Objective (DistillSpec: the acceptance of speculative sampling is 1 - TV(p, q); SpecForge's
DSpark loss weights): per block row k,
    0.1 * CE(logits, target's argmax) + 1.8 * mean_T TV(q_T, p_T) + 1.0 * BCE(conf, accept)
where p_T is the target's distribution at temperature T truncated to its top_p 0.95 nucleus
(what the engine verifies against) and q_T the draft's at T (what it samples from), for T in
K3's 1.0 and 0.6; the CE on the target's argmax is the greedy term; accept is the row's mean
acceptance over greedy and both modes. Rows are weighted by exp(-k / gamma); the Markov head is
teacher-forced with the sequence's tokens; each block sees the context strictly before its
anchor.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from serve_app.engines.reference.sampling import SamplingParams, target_probs
from serve_app.models.dspark import DSparkDraft, save_dspark
from serve_app.models.dspark_config import DSparkConfig
from serve_app.models.k3 import K3ForCausalLM, K3State
from serve_app.models.k3_weights import load_k3
from serve_app.tokenizer import HFTokenizer
from serve_app.training.common import (
    Progress,
    ThreadTuner,
    conversation_ids,
    cosine_lr,
    encode_documents,
    optimizer_step,
    random_windows,
    running_mean,
    seed_everything,
)
from serve_app.training.conversations import conversations
from serve_app.training.corpus import SourceFile

GAMMA = 7
# 1.8 x TV is SpecForge's 0.9 x L1 (L1 = 2 TV).
LOSS_WEIGHTS = {"ce": 0.1, "tv": 1.8, "bce": 1.0}
# How a request decodes: greedy (temperature 0), K3 thinking and K3 instant, with K3's top_p
# (chat/parameters.py: K3_TEMPERATURE, K3_TOP_P). Mode i of the generated pool is MODES[i].
MODES: tuple[tuple[float, float], ...] = ((0.0, 1.0), (1.0, 0.95), (0.6, 0.95))
SAMPLED_MODES = MODES[1:]
# The draft's size, chosen from this CPU's measurements (docs/embedded-models.md): trained for
# the same 6 minutes, 1 and 2 layers reached the same engine acceptance (1.58 / 1.54 macro on
# the held-out prompts), and 1 layer drafts a block in 2.7 ms against 4.0 ms (0.18 / 0.23 of a
# target decode forward; 3 layers 4.6 ms). The Markov rank was not swept.
DRAFT_LAYERS = 1
MARKOV_RANK = 32


def tap_layers(target: K3ForCausalLM) -> tuple[int, ...]:
    """K3's convention in SGLang: 0-based layer outputs, no +1 shift, spread over the depth
    and ending near the top ([7, 23, 51, 67, 83] of K3's 93). For the mini's 8 layers: every
    other layer, so both MLA layers (3, 7) and the last (through the output read)."""
    n = target.config.num_hidden_layers
    return tuple(range(1, n, 2))


def mini_draft_config(target: K3ForCausalLM, tok: HFTokenizer, layers: int = DRAFT_LAYERS,
                      markov_rank: int = MARKOV_RANK) -> DSparkConfig:
    """The published DSpark layout (a Qwen3-style block drafter with the Markov and confidence
    heads, K3's rms eps) at the target's width."""
    t = target.config
    return DSparkConfig.from_dict({
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
        "hidden_size": t.hidden_size, "intermediate_size": 2 * t.hidden_size + 128,
        "num_hidden_layers": layers, "num_attention_heads": 6, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "block_size": GAMMA, "num_target_layers": t.num_hidden_layers,
        "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.pad_token_id, "dtype": "bfloat16",
        "dflash_config": {
            "target_layer_ids": list(tap_layers(target)), "mask_token_id": tok.mask_token_id,
            "markov_rank": markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True,
            "target_hidden_size": t.hidden_size,
        },
    }, "mini draft")


def init_draft(draft: DSparkDraft, std: float = 0.02) -> None:
    layers = draft.config.num_hidden_layers
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.startswith("confidence_head"):
                p.zero_()  # starts at 0.5 everywhere
            elif name == "markov_head.markov_w2.weight":
                p.zero_()  # the bigram correction starts neutral
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0, std / math.sqrt(2 * layers))
            else:
                p.normal_(0, std)


def truncated_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution the engine samples and verifies with at K3's parameters (softmax at
    `temperature`, then the top_p nucleus, renormalised), over the last dimension."""
    return target_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))


@torch.no_grad()
def generate(target: K3ForCausalLM, prompts: torch.Tensor, new_tokens: int,
             temperature: float, gen: torch.Generator, top_p: float = 1.0) -> torch.Tensor:
    """Continue every prompt row ([N, P], equal lengths) by `new_tokens` with the dense state
    (KDA recurrent states and MLA latents), greedy at temperature 0; returns
    [N, P + new_tokens]."""
    logits, state = target(prompts)
    logits = logits[:, -1]
    out = [prompts]
    for i in range(new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(truncated_probs(logits, temperature, top_p), 1, generator=gen)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < new_tokens:
            logits, state = target(nxt, state)
            logits = logits[:, -1]
    return torch.cat(out, dim=1)


def generation_prompts(tok: HFTokenizer, stream: torch.Tensor, files: list[SourceFile],
                       n: int, length: int, rng: random.Random,
                       gen: torch.Generator) -> torch.Tensor:
    """[n, length] prompts: corpus windows, and (half of them) a chat request in K3's format,
    ending with its generation prompt, placed after a document separator at the end of a corpus
    window, the way a chat prompt starts fresh."""
    rows = random_windows(stream, n, length, gen)
    for i, c in enumerate(conversations(files, n // 2, rng)):
        ids = [tok.bos_token_id, *conversation_ids(tok, c)[0]]
        if len(ids) < length:
            rows[i, length - len(ids):] = torch.tensor(ids)
    return rows[torch.randperm(n, generator=gen)]


# Log-probability buckets of nucleus_mask: 512 over 30 decades, 0.135 nats (14%) wide.
NUCLEUS_BUCKETS = 512
_NUCLEUS_SPAN = 30 * math.log(10)


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top_p nucleus of every row of `probs` [..., V] to within one log-probability
    bucket, without a sort: the engine's nucleus (`sampling.target_probs`) is the most likely
    tokens whose mass before each is below top_p; here whole buckets, kept while the mass of
    the buckets above is below top_p. Measured on [2688, 4096] rows: 0.28 s against 1.8 s for
    the sort (which made the loss most of a training step), within 0.8% of the exact nucleus's
    mass."""
    shape, vocab = probs.shape, probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    bucket = (flat.clamp_min(1e-30).log() * (-NUCLEUS_BUCKETS / _NUCLEUS_SPAN)).long()
    bucket = bucket.clamp_(max=NUCLEUS_BUCKETS - 1)  # 0: the most likely
    rows = len(flat)
    index = (bucket + torch.arange(rows)[:, None] * NUCLEUS_BUCKETS).flatten()
    mass = torch.bincount(index, weights=flat.flatten().double(),
                          minlength=rows * NUCLEUS_BUCKETS).view(rows, NUCLEUS_BUCKETS)
    cut = (mass.cumsum(-1) - mass < top_p).sum(-1)
    return (bucket < cut[:, None]).view(shape)


def mode_acceptance(out_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[len(MODES), ...] per block row: the chance the engine accepts the draft's token in each
    mode, given the row's context. Greedy: the draft's argmax is the target's. Sampled:
    sum_x min(p_T(x), q_T(x)) = 1 - TV, p_T the target's truncated distribution and q_T the
    draft's at T (the engine samples the draft at the request's temperature, without top_p)."""
    rows = [(out_logits.argmax(-1) == target_logits.argmax(-1)).float()]
    for temperature, top_p in SAMPLED_MODES:
        p = torch.softmax(target_logits.float() / temperature, -1)
        p = p * nucleus_mask(p, top_p)
        p = p / p.sum(-1, keepdim=True)
        q = torch.softmax(out_logits / temperature, -1)
        rows.append(torch.minimum(p, q).sum(-1))
    return torch.stack(rows)


def draft_loss(out_logits: torch.Tensor, confidence: torch.Tensor | None,
               target_logits: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """All [B, A, gamma, ...]; returns (loss, parts, per-mode acceptance [len(MODES), B, A,
    gamma], detached: the greedy row is the draft's agreement with the target's argmax)."""
    gamma = out_logits.shape[2]
    weights = torch.exp(-torch.arange(gamma, dtype=torch.float32) / gamma)
    weights = weights / weights.sum()
    accept = mode_acceptance(out_logits, target_logits)
    tv = (1 - accept[1:]).mean(0)  # differentiable through q (p is the target's, fixed)
    ce = F.cross_entropy(out_logits.flatten(0, 2), target_logits.argmax(-1).flatten(),
                         reduction="none").view_as(tv)
    per_row = LOSS_WEIGHTS["ce"] * ce + LOSS_WEIGHTS["tv"] * tv
    accept = accept.detach()
    bce = torch.zeros_like(tv)
    if confidence is not None:
        bce = F.binary_cross_entropy(confidence.float().clamp(1e-6, 1 - 1e-6),
                                     accept.mean(0).clamp(0, 1), reduction="none")
        per_row = per_row + LOSS_WEIGHTS["bce"] * bce
    loss = (per_row * weights).sum(-1).mean()
    parts = {k: float(v.detach().mean()) for k, v in (("ce", ce), ("tv", tv), ("bce", bce))}
    return loss, parts, accept


def next_anchors(anchors: torch.Tensor, accept: torch.Tensor, gen: torch.Generator
                 ) -> torch.Tensor:
    """Where the engine's next block starts after each block ([..., A] anchors, [..., A, gamma]
    per-row acceptance): p + j + 1, j the drafts a walk accepts (row k survives with its
    acceptance, the walk ends at the first rejection), the correction or bonus token the new
    anchor."""
    survive = torch.cumprod((torch.rand(accept.shape, generator=gen) < accept).long(), -1)
    return anchors + survive.sum(-1) + 1


def expected_accept_length(agree_by_row: torch.Tensor) -> float:
    """Greedy acceptance length implied by per-row agreement rates, if rows were independent
    given the previous ones: 1 + sum_k prod_{j<=k} a_j (an estimate; the engine measures)."""
    return 1.0 + float(torch.cumprod(agree_by_row, 0).sum())


@dataclass
class DraftResult:
    config: DSparkConfig
    params: int
    steps: int
    generated_sequences: int
    wall_s: float
    loss: float
    heldout_agreement: list[float]
    heldout_expected_accept: float
    heldout_thinking_acceptance: list[float]
    heldout_thinking_expected_accept: float


def _batch(target: K3ForCausalLM, ids: torch.Tensor, anchors: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's taps (what the engine appends to the draft's cache) and, per block row,
    its logits and the sequence's next tokens."""
    layers = tap_layers(target)
    with torch.no_grad():
        h_final, _, by_layer = target.model(ids, K3State(), layers)
        rows = anchors[:, :, None] + torch.arange(GAMMA)  # positions p..p+g-1: row k scores p+k+1
        b, a = anchors.shape
        # Target logits only where a block row needs them: the lm_head over every token was
        # a third of a training step.
        h_rows = h_final.gather(1, rows.view(b, -1, 1).expand(-1, -1, h_final.shape[-1]))
        tlogits = target.logits(h_rows).view(b, a, GAMMA, -1)
        taps = torch.cat([by_layer[i] for i in layers], dim=-1)
    labels = ids.gather(1, (rows + 1).view(b, -1)).view(b, a, GAMMA)
    return taps, tlogits, labels


def train_draft(
    tok: HFTokenizer,
    train_files: list[SourceFile],
    heldout_files: list[SourceFile],
    target_dir: Path,
    out: Path,
    seed: int,
    budget_s: float,
    threads: int = 2,
    provenance: dict[str, Any] | None = None,
    eval_prompts: int | None = None,
    layers: int | None = None,
    markov_rank: int | None = None,
    max_steps: int | None = None,
    prompt_len: int = 128,
    new_tokens: int | None = None,
    batch_corpus: int = 4,
    batch_generated: int = 12,
    anchors_per_seq: int = 24,
    peak_lr: float = 1.5e-3,
) -> DraftResult:
    torch.set_num_threads(threads)
    seed_everything(seed)
    start = time.monotonic()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    new_tokens = new_tokens or 128
    # The shipped target (bf16 weights, computed in fp32), as the engine will run it.
    target = load_k3(target_dir, dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    stream = encode_documents(tok, train_files, seed + 1)
    held = encode_documents(tok, heldout_files, seed + 1, conversation_fraction=0.0)
    seq_len = prompt_len + new_tokens

    # 1. The target's own continuations (a fixed share of the budget), in each of MODES in
    # turn: chat users sample at K3's parameters, and sampled continuations are where a draft
    # that only learned the target's argmax falls short.
    gen_budget = 0.18 * budget_s
    pool: list[torch.Tensor] = []
    modes: list[int] = []
    progress = Progress("generate", gen_budget)
    gen_tuner = ThreadTuner(threads, every_s=60.0, trial=1)
    # A step budget generates in proportion: one 32-sequence batch per 16 steps.
    batches = 66 if max_steps is None else max(1, max_steps // 16)
    while not pool or (progress.elapsed < gen_budget and len(pool) < batches):
        t_batch = time.monotonic()
        mode = len(pool) % len(MODES)
        temperature, top_p = MODES[mode]
        prompts = generation_prompts(tok, stream, train_files, 32, prompt_len, rng, gen)
        pool.append(generate(target, prompts, new_tokens, temperature, gen, top_p=top_p))
        modes.extend([mode] * 32)
        gen_tuner.record(time.monotonic() - t_batch)
        progress.update(sequences=32 * len(pool))
    generated = torch.cat(pool)
    generated_modes = torch.tensor(modes)
    progress.update(force=True, sequences=len(generated))
    sample = tok.decode(generated[0, prompt_len - 24:].tolist(), skip_special_tokens=False)
    print("generate: sample continuation:\n" + sample[:600], flush=True)
    # The held-out generations the saved draft is measured on, greedy and at K3 thinking; a
    # step-budget run (CI's) measures on a quarter of them, as it generates in proportion.
    held_rows = 16 if max_steps is None else 4
    held_prompts = random_windows(held, held_rows, prompt_len,
                                  torch.Generator().manual_seed(seed + 7))
    held_gen = {mode: generate(target, held_prompts, new_tokens, MODES[mode][0], gen,
                               top_p=MODES[mode][1])
                for mode in (0, 1)}

    # 2. The draft.
    config = mini_draft_config(target, tok, layers or DRAFT_LAYERS, markov_rank or MARKOV_RANK)
    draft = DSparkDraft(config)
    init_draft(draft)
    params = sum(p.numel() for p in draft.parameters())
    print(f"draft: {params:,} parameters, taps {list(tap_layers(target))}, gamma {GAMMA}, "
          f"{len(generated)} generated sequences", flush=True)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    decay = [p for p in draft.parameters() if p.ndim == 2]
    no_decay = [p for p in draft.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    # Keep time for saving, the held-out measurement and the engine's after the loop.
    loop_budget = budget_s - (time.monotonic() - start) - min(75.0, 0.1 * budget_s)
    progress = Progress("draft", loop_budget, max_steps=max_steps)
    tuner = ThreadTuner(threads)
    step, ema = 0, float("nan")
    accept_ema = torch.zeros(len(MODES), GAMMA)
    hi = seq_len - 1 - GAMMA
    carried = batch_generated // 2
    carry_pick = torch.empty(0, dtype=torch.long)
    carry_anchors = torch.empty(0, anchors_per_seq, dtype=torch.long)
    while not progress.finished(step):
        lr = cosine_lr(progress.share(step), step, peak_lr, warmup=min(30, max_steps or 30))
        for g in opt.param_groups:
            g["lr"] = lr
        t_step = time.monotonic()
        fresh = torch.randint(0, len(generated), (batch_generated - len(carry_pick),),
                              generator=gen)
        pick = torch.cat([carry_pick, fresh])
        ids = torch.cat([random_windows(stream, batch_corpus, seq_len, gen), generated[pick]])
        # Corpus rows: anchors anywhere; fresh generated rows: mostly in the generated part;
        # carried rows: where the engine's next blocks start, uniform where that ran past the
        # sequence.
        lo = torch.tensor([1] * batch_corpus + [prompt_len - 8] * batch_generated)
        u = torch.rand(len(ids), anchors_per_seq, generator=gen)
        anchors = (lo[:, None] + u * (hi - lo[:, None] + 1)).long().clamp(max=hi)
        if len(carry_pick):
            rows = slice(batch_corpus, batch_corpus + len(carry_pick))
            anchors[rows] = torch.where(carry_anchors <= hi, carry_anchors, anchors[rows])
        taps, tlogits, _ = _batch(target, ids, anchors)
        res = draft.forward_train(taps, ids, anchors, embed, lm_head)
        loss, parts, accept = draft_loss(res.logits, res.confidence, tlogits)
        optimizer_step(opt, loss, draft.parameters())
        tuner.record(time.monotonic() - t_step)
        step += 1
        # The next step carries half of these sequences on, each block's walk through the
        # acceptance of the mode it was generated in.
        keep = torch.randperm(batch_generated, generator=gen)[:carried]
        carry_pick = pick[keep]
        g_rows = batch_corpus + keep
        own = accept[generated_modes[carry_pick], g_rows]  # [carried, A, gamma]
        carry_anchors = next_anchors(anchors[g_rows], own, gen)
        value = float(loss.detach())
        ema = running_mean(ema, value)
        rows_now = accept[:, batch_corpus:].mean(dim=(1, 2))  # [modes, gamma]
        accept_ema = rows_now if step == 1 else 0.95 * accept_ema + 0.05 * rows_now
        progress.update(step=step, loss=ema, lr=lr, tv=parts["tv"],
                        est_accept_greedy=expected_accept_length(accept_ema[0]),
                        est_accept_thinking=expected_accept_length(accept_ema[1]),
                        threads=tuner.current)
    progress.update(force=True, step=step, loss=ema)

    # 3. Save bf16 and measure, teacher-forced, on held-out generations: agreement with the
    # target's argmax on greedy ones and K3 thinking's acceptance (1 - TV) on thinking ones.
    draft.eval()
    draft.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_dspark(draft, out)
    draft.float()
    by_mode = {}
    with torch.no_grad():
        anchors = torch.arange(prompt_len - 1, hi + 1)[None].expand(held_rows, -1)
        for mode, seqs in held_gen.items():
            taps, tlogits, _ = _batch(target, seqs, anchors)
            res = draft.forward_train(taps, seqs, anchors, embed, lm_head)
            _, _, accept = draft_loss(res.logits, res.confidence, tlogits)
            by_mode[mode] = accept[mode].mean(dim=(0, 1))
    est = expected_accept_length(by_mode[0])
    est_thinking = expected_accept_length(by_mode[1])
    wall = time.monotonic() - start
    print(f"draft: {step} steps, held-out greedy agreement by row "
          f"{[round(float(a), 3) for a in by_mode[0]]}, estimated accept length {est:.2f}; "
          f"K3 thinking acceptance by row {[round(float(a), 3) for a in by_mode[1]]}, "
          f"estimated accept length {est_thinking:.2f}, {wall / 60:.1f} min", flush=True)
    result = DraftResult(config, params, step, len(generated), wall, ema,
                         [round(float(a), 4) for a in by_mode[0]], est,
                         [round(float(a), 4) for a in by_mode[1]], est_thinking)
    metrics = {**_metrics(result), "provenance": provenance or {}}
    # What the engine measures on the fixed held-out prompts (after the training wall time).
    metrics.update(evaluate_pair(target_dir, out, tok, eval_prompts, short=max_steps is not None))
    (out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return result


def evaluate_pair(target_dir: Path, draft_dir: Path, tok: HFTokenizer,
                  eval_prompts: int | None = None, short: bool = False) -> dict[str, Any]:
    """The engine's measurements of a trained pair, as the draft's training_metrics.json keeps
    them: greedy acceptance on the held-out code prompts, and the held-out conversations at
    K3's parameters without and with the grammar. `short` (a step-budget run, CI's) decodes
    fewer tokens per conversation."""
    from serve_app.embedded import heldout_prompt_ids, heldout_prompts
    from serve_app.training.evaluate import measure_acceptance, measure_conversations

    metrics: dict[str, Any] = {}
    metrics["engine_heldout_greedy"] = measure_acceptance(
        target_dir, draft_dir, heldout_prompt_ids(tok)[:eval_prompts])
    print(f"draft: engine, held-out greedy: {metrics['engine_heldout_greedy']}", flush=True)
    held_conversations = heldout_prompts()["conversations"][:eval_prompts]
    for grammar in (False, True):
        key = "engine_heldout_conversations" + ("_grammar" if grammar else "")
        # The grammar run constrains as deployments/local.yaml serves (every tool strict).
        metrics[key] = measure_conversations(target_dir, draft_dir, tok, held_conversations,
                                             max_tokens=48 if short else 384,
                                             grammar=grammar, tool_strict_level="parameter")
        print(f"draft: engine, held-out conversations at K3's parameters"
              f"{' with the grammar' if grammar else ''}: {metrics[key]}", flush=True)
    return metrics


def _metrics(r: DraftResult) -> dict[str, Any]:
    return {"parameters": r.params, "steps": r.steps,
            "generated_sequences": r.generated_sequences, "wall_s": round(r.wall_s, 1),
            "train_loss_ema": round(r.loss, 4),
            "heldout_teacher_forced_agreement_by_row": r.heldout_agreement,
            "heldout_estimated_accept_length": round(r.heldout_expected_accept, 3),
            "heldout_thinking_acceptance_by_row": r.heldout_thinking_acceptance,
            "heldout_thinking_estimated_accept_length":
                round(r.heldout_thinking_expected_accept, 3)}
