"""Train the mini Kimi target (MLA + MoE, DeepseekV3 layout) as a language model on the corpus."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.kimi import KimiForCausalLM, KimiMoE
from serve_app.models.kimi_config import KimiConfig
from serve_app.models.kimi_weights import load_kimi, save_kimi
from serve_app.tokenizer import ChatTokenizer
from serve_app.training.common import (
    Progress,
    ThreadTuner,
    cosine_lr,
    encode_documents,
    fixed_windows,
    random_windows,
    seed_everything,
)
from serve_app.training.corpus import SourceFile

# Shards under 8 MiB: the repository keeps every committed file small.
ASSET_SHARD_BYTES = 7 * 2**20


def mini_target_config(tok: ChatTokenizer) -> KimiConfig:
    """A few million parameters with every K2 feature the engine serves: MLA with q/kv LoRA and
    a decoupled rope key, a dense first layer, sigmoid-routed top-2 of 8 experts plus a shared
    expert (noaux_tc router bias)."""
    return KimiConfig.from_dict({
        "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 8,
        "q_lora_rank": 96, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-6,
        "vocab_size": tok.vocab_size, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "torch_dtype": "bfloat16",
    }, "mini target")


def init_weights(model: KimiForCausalLM, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0, std / math.sqrt(2 * layers))
            else:
                p.normal_(0, std)


def count_params(model: nn.Module) -> dict[str, int]:
    """Total parameters and those active per token (routed experts count top-k of E)."""
    c = model.config  # type: ignore[attr-defined]
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * c.num_experts_per_tok // c.n_routed_experts
    return {"total": total, "active_per_token": active}


def balance_router(model: KimiForCausalLM, counts: list[list[int]], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias up when
    it is under-loaded and down when over-loaded."""
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, KimiMoE)]
    with torch.no_grad():
        for moe, c in zip(moes, counts, strict=True):
            load = torch.tensor(c, dtype=torch.float32)
            moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def heldout_perplexity(model: KimiForCausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model.forward_train(w[:, :-1]).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        n += w[:, 1:].numel()
    return math.exp(total / n)


def to_storage_dtype(model: KimiForCausalLM) -> KimiForCausalLM:
    """bf16 weights (half the bytes); the router bias stays fp32 (its spread decides top-k)."""
    for name, p in model.named_parameters():
        if not name.endswith("e_score_correction_bias"):
            p.data = p.data.to(torch.bfloat16)
    return model


@dataclass
class TargetResult:
    config: KimiConfig
    params: dict[str, int]
    steps: int
    tokens: int
    wall_s: float
    train_loss: float
    heldout_ppl: float
    heldout_tokens: int


def train_target(
    tok: ChatTokenizer,
    train_files: list[SourceFile],
    heldout_files: list[SourceFile],
    out: Path,
    seed: int,
    budget_s: float,
    batch: int = 8,
    seq_len: int = 512,
    peak_lr: float = 3e-3,
    threads: int = 2,
) -> TargetResult:
    torch.set_num_threads(threads)
    seed_everything(seed)
    start = time.monotonic()
    stream = encode_documents(tok, train_files, seed)
    held = encode_documents(tok, heldout_files, seed, chat_fraction=0.0)
    eval_windows = fixed_windows(held, 48, seq_len + 1)
    print(f"target: {len(stream):,} training tokens, {len(held):,} held-out tokens "
          f"({len(train_files)} / {len(heldout_files)} files)", flush=True)

    config = mini_target_config(tok)
    model = KimiForCausalLM(config)
    init_weights(model)
    params = count_params(model)
    print(f"target: {params['total']:,} parameters, {params['active_per_token']:,} active "
          "per token", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "e_score" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 and "e_score" not in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    # Keep time for the held-out evaluation and the save after the loop.
    loop_budget = budget_s - (time.monotonic() - start) - 60
    progress = Progress("target", loop_budget)
    tuner = ThreadTuner(threads)
    model.train()
    step, tokens, ema = 0, 0, float("nan")
    while progress.elapsed < loop_budget:
        lr = cosine_lr(progress.fraction, step, peak_lr, warmup=40)
        for g in opt.param_groups:
            g["lr"] = lr
        t_step = time.monotonic()
        w = random_windows(stream, batch, seq_len + 1, gen)
        counts: list[list[int]] = []
        # fp32: bf16 autocast measured no faster here (small matmuls, cast overhead).
        logits = model.forward_train(w[:, :-1], expert_counts=counts).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_router(model, counts, rate=1e-3)
        tuner.record(time.monotonic() - t_step)
        step += 1
        tokens += w[:, 1:].numel()
        value = float(loss.detach())
        ema = value if math.isnan(ema) else 0.95 * ema + 0.05 * value
        progress.update(step=step, loss=ema, lr=lr, tok_s=int(tokens / progress.elapsed),
                        threads=tuner.current)
    progress.update(force=True, step=step, loss=ema)

    model.eval()
    to_storage_dtype(model)
    out.mkdir(parents=True, exist_ok=True)
    save_kimi(model, out, max_shard_bytes=ASSET_SHARD_BYTES)
    # Measure what ships: the saved bf16 weights, loaded the way the engine loads them.
    shipped = load_kimi(out, dtype=torch.float32)
    ppl = heldout_perplexity(shipped, eval_windows)
    wall = time.monotonic() - start
    print(f"target: {step} steps, {tokens:,} tokens, held-out perplexity {ppl:.2f}, "
          f"{wall / 60:.1f} min", flush=True)
    result = TargetResult(config, params, step, tokens, wall, ema, ppl,
                          eval_windows[:, 1:].numel())
    (out / "training_metrics.json").write_text(json.dumps(_metrics(result), indent=2) + "\n")
    return result


def _metrics(r: TargetResult) -> dict[str, Any]:
    return {"parameters": r.params, "steps": r.steps, "train_tokens": r.tokens,
            "wall_s": round(r.wall_s, 1), "train_loss_ema": round(r.train_loss, 4),
            "heldout_perplexity": round(r.heldout_ppl, 3), "heldout_tokens": r.heldout_tokens}
