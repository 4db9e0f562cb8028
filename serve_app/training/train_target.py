"""Train the mini Kimi K3 target (KDA + NoPE MLA hybrid, latent MoE, SiTU, Attention Residual;
K3's config.json layout) as a language model on the corpus."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.k3 import K3ForCausalLM
from serve_app.models.k3_blocks import LatentMoE
from serve_app.models.k3_config import K3Config
from serve_app.models.k3_weights import is_fp32_tensor, load_k3, save_k3
from serve_app.tokenizer import HFTokenizer
from serve_app.training.common import (
    Progress,
    ThreadTuner,
    cosine_lr,
    encode_documents,
    fixed_windows,
    optimizer_step,
    random_windows,
    running_mean,
    seed_everything,
)
from serve_app.training.corpus import SourceFile

# Shards under 8 MiB: the repository keeps every committed file small.
ASSET_SHARD_BYTES = 7 * 2**20


def mini_target_config(tok: HFTokenizer) -> K3Config:
    """K3's layout at a few million parameters: 8 layers, KDA except the 4th and 8th (K3's 3:1
    ratio, 1-based `full_attn_layers` as in its config), AttnRes blocks of 3, a dense first
    layer then latent MoE (16 experts, top-4 plus 2 shared, sigmoid noaux_tc router), SiTU.
    Width 192: on this 2-core CPU it trains at ~1,500 tokens/s against ~820 at width 256
    (12.0 M parameters), and at a budget of an hour more tokens beat more width."""
    raw: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": tok.vocab_size, "hidden_size": 192, "num_hidden_layers": 8,
        "intermediate_size": 512, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "attn_res_block_size": 3,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 4,
            "head_dim": 48, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 128, "latent_moe_use_norm": True, "num_shared_experts": 2,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    }
    return K3Config.from_dict(raw, "mini K3 target")


# Parameters that keep the modules' own initialisation: the KDA decay parameters (Mamba-style
# A in [1, 16] and dt_bias) and the depthwise convs.
_KEEP_INIT = ("A_log", "dt_bias", "conv1d.weight")
# Residual-stream writers, scaled down with depth (GPT-2).
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", "w2.weight", "routed_expert_up_proj.weight")


def init_weights(model: K3ForCausalLM, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers); norms
    at 1, the router bias at 0, and the AttnRes pseudo-queries at 0 (every read starts as the
    uniform mixture of its sources, as in the Attention Residuals paper)."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_KEEP_INIT):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("e_score_correction_bias", "res_proj.weight")):
                p.zero_()
            elif name.endswith(_RESIDUAL_OUT):
                p.normal_(0, std / math.sqrt(2 * layers))
            else:
                p.normal_(0, std)


def count_params(model: nn.Module) -> dict[str, int]:
    """Total parameters and those active per token (routed experts count top-k of E)."""
    c = model.config  # type: ignore[attr-defined]
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * c.num_experts_per_token // c.num_experts
    return {"total": total, "active_per_token": active}


class ExpertLoad:
    """Counts, per MoE layer, how many tokens each expert was routed in the last forward (a
    hook on each router: the model's forward stays the serving one)."""

    def __init__(self, model: K3ForCausalLM) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        self.counts: list[torch.Tensor] = [torch.zeros(0)] * len(self.moes)
        for i, moe in enumerate(self.moes):
            moe.gate.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Callable[..., None]:
        def record(_module: nn.Module, _inputs: Any, out: tuple[torch.Tensor, ...]) -> None:
            self.counts[i] = torch.bincount(out[1].flatten(),
                                            minlength=self.moes[i].config.num_experts)
        return record

    def balance(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias up
        when it is under-loaded and down when over-loaded."""
        with torch.no_grad():
            for moe, c in zip(self.moes, self.counts, strict=True):
                load = c.float()
                moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def lm_loss(model: K3ForCausalLM, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of windows [B, T + 1] (the model reads the first T)."""
    logits, _ = model(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction=reduction)


def heldout_windows(tok: HFTokenizer, files: list[SourceFile], seed: int,
                    seq_len: int = 512) -> torch.Tensor:
    """The held-out perplexity's windows: up to 48 of seq_len + 1 tokens of the held-out files
    (plain text, no conversations), evenly spaced."""
    held = encode_documents(tok, files, seed, conversation_fraction=0.0)
    return fixed_windows(held, 48, seq_len + 1)


@torch.no_grad()
def heldout_perplexity(model: K3ForCausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    total = sum(float(lm_loss(model, windows[i:i + batch], "sum"))
                for i in range(0, len(windows), batch))
    return math.exp(total / windows[:, 1:].numel())


def to_storage_dtype(model: K3ForCausalLM) -> K3ForCausalLM:
    """bf16 weights (half the bytes); the tensors SGLang keeps fp32 stay fp32 (KDA A_log,
    dt_bias, convs; the router bias, whose spread decides top-k)."""
    for name, p in model.named_parameters():
        if not is_fp32_tensor(name):
            p.data = p.data.to(torch.bfloat16)
    return model


@dataclass
class TargetResult:
    config: K3Config
    params: dict[str, int]
    steps: int
    tokens: int
    wall_s: float
    train_loss: float
    heldout_ppl: float
    heldout_tokens: int


def train_target(
    tok: HFTokenizer,
    train_files: list[SourceFile],
    heldout_files: list[SourceFile],
    out: Path,
    seed: int,
    budget_s: float,
    batch: int = 4,
    seq_len: int = 512,
    peak_lr: float = 2.5e-3,
    threads: int = 2,
    provenance: dict[str, Any] | None = None,
    max_steps: int | None = None,
) -> TargetResult:
    torch.set_num_threads(threads)
    seed_everything(seed)
    start = time.monotonic()
    stream = encode_documents(tok, train_files, seed)
    eval_windows = heldout_windows(tok, heldout_files, seed, seq_len)
    print(f"target: {len(stream):,} training tokens, {eval_windows[:, 1:].numel():,} held-out tokens "
          f"({len(train_files)} / {len(heldout_files)} files)", flush=True)

    config = mini_target_config(tok)
    model = K3ForCausalLM(config)
    init_weights(model)
    load = ExpertLoad(model)
    params = count_params(model)
    print(f"target: {params['total']:,} parameters, {params['active_per_token']:,} active "
          "per token", flush=True)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if p.ndim >= 2 and not n.endswith("conv1d.weight")]
    no_decay = [p for n, p in trained if p.ndim < 2 or n.endswith("conv1d.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    # Keep time for the held-out evaluation and the save after the loop.
    loop_budget = budget_s - (time.monotonic() - start) - min(60.0, 0.1 * budget_s)
    progress = Progress("target", loop_budget, max_steps=max_steps)
    tuner = ThreadTuner(threads)
    model.train()
    step, tokens, ema = 0, 0, float("nan")
    while not progress.finished(step):
        lr = cosine_lr(progress.share(step), step, peak_lr, warmup=min(40, max_steps or 40))
        for g in opt.param_groups:
            g["lr"] = lr
        t_step = time.monotonic()
        w = random_windows(stream, batch, seq_len + 1, gen)
        # fp32: bf16 autocast measured no faster here (small matmuls, cast overhead).
        loss = lm_loss(model, w)
        optimizer_step(opt, loss, model.parameters())
        load.balance(rate=1e-3)
        tuner.record(time.monotonic() - t_step)
        step += 1
        tokens += w[:, 1:].numel()
        value = float(loss.detach())
        ema = running_mean(ema, value)
        progress.update(step=step, loss=ema, lr=lr, tok_s=int(tokens / progress.elapsed),
                        threads=tuner.current)
    progress.update(force=True, step=step, loss=ema)
    loop_tok_s = tokens / progress.elapsed

    model.eval()
    to_storage_dtype(model)
    out.mkdir(parents=True, exist_ok=True)
    save_k3(model, out, max_shard_bytes=ASSET_SHARD_BYTES)
    # Measure what ships: the saved bf16 weights, loaded the way the engine loads them.
    shipped = load_k3(out, dtype=torch.float32)
    ppl = heldout_perplexity(shipped, eval_windows)
    wall = time.monotonic() - start
    print(f"target: {step} steps, {tokens:,} tokens, held-out perplexity {ppl:.2f}, "
          f"{wall / 60:.1f} min", flush=True)
    result = TargetResult(config, params, step, tokens, wall, ema, ppl,
                          eval_windows[:, 1:].numel())
    metrics = {**_metrics(result), "train_tokens_per_s": round(loop_tok_s),
               "provenance": provenance or {}}
    (out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return result


def _metrics(r: TargetResult) -> dict[str, Any]:
    return {"parameters": r.params, "steps": r.steps, "train_tokens": r.tokens,
            "wall_s": round(r.wall_s, 1), "train_loss_ema": round(r.train_loss, 4),
            "heldout_perplexity": round(r.heldout_ppl, 3), "heldout_tokens": r.heldout_tokens}
