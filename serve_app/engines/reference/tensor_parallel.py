"""Tensor parallelism for the DSpark draft, gpt-fast style: shard the linears, all-reduce after
the row-parallel ones. (The target shards itself at load time: see models/k3_weights.py.)

Attention heads are split across ranks; when there are more ranks than KV heads (K3's draft has
16 KV heads, a TP32 group would have more ranks) each rank keeps the one KV head its query heads
use. MLPs are split column-wise (gate/up) and row-wise (down).
"""

from __future__ import annotations

import torch
from torch import nn

from serve_app.models.dspark import DSparkDraft
from serve_app.models.target import Collectives, TPContext


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _keep_cols(linear: nn.Linear, start: int, stop: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone(), requires_grad=False)
    linear.in_features = stop - start


def _all_reduce_output(module: nn.Module, tp: TPContext) -> None:
    def hook(_m: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(output)

    module.register_forward_hook(hook)


def shard_dspark(
    draft: DSparkDraft, tp_rank: int, tp_size: int, group: Collectives | None = None
) -> DSparkDraft:
    """Keep this rank's shard of every layer, in place. fc, norms and heads stay replicated."""
    if tp_size == 1:
        return draft
    cfg = draft.config
    cfg.validate_tp(tp_size)
    tp = TPContext(tp_rank, tp_size, group)
    hd = cfg.head_dim
    heads = cfg.num_attention_heads // tp_size
    if cfg.num_key_value_heads >= tp_size:
        kv_heads = cfg.num_key_value_heads // tp_size
        kv_first = tp_rank * kv_heads
    else:
        kv_heads = 1
        kv_first = tp_rank * cfg.num_key_value_heads // tp_size
    inter = cfg.intermediate_size // tp_size
    for layer in draft.layers:
        attn = layer.self_attn
        _keep_rows(attn.q_proj, tp_rank * heads * hd, (tp_rank + 1) * heads * hd)
        _keep_rows(attn.k_proj, kv_first * hd, (kv_first + kv_heads) * hd)
        _keep_rows(attn.v_proj, kv_first * hd, (kv_first + kv_heads) * hd)
        _keep_cols(attn.o_proj, tp_rank * heads * hd, (tp_rank + 1) * heads * hd)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        _all_reduce_output(attn.o_proj, tp)
        mlp = layer.mlp
        _keep_rows(mlp.gate_proj, tp_rank * inter, (tp_rank + 1) * inter)
        _keep_rows(mlp.up_proj, tp_rank * inter, (tp_rank + 1) * inter)
        _keep_cols(mlp.down_proj, tp_rank * inter, (tp_rank + 1) * inter)
        _all_reduce_output(mlp.down_proj, tp)
    return draft
