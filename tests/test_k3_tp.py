"""Tensor parallelism of the K3 model (serve_app.models.k3 with kimi.py's TPContext): two gloo
ranks (torch.multiprocessing) load the same saved mini-K3 checkpoint (fp32, and FP8 block, whose
shards are dequantized from sliced blocks) with TP=2 and reproduce the
one-rank model's logits (atol 1e-4) for a prefill, decode steps through K3State and a verify
window; each rank holds its own KDA / MLA heads, MLP widths and routed experts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from spec_helpers import run_ranks
from tiny_models import random_k3

from serve_app.engines.reference.builder import release_tensor_parallel
from serve_app.models.k3 import K3ForCausalLM, K3State
from serve_app.models.k3_config import K3Config
from serve_app.models.k3_weights import load_k3, save_k3
from serve_app.models.kimi import TPContext
from serve_app.netutil import free_port

MINI = Path(__file__).parent / "data" / "mini-k3-config.json"
DECODE_STEPS = 3


def build(config: K3Config) -> K3ForCausalLM:
    return random_k3(config)


def prompts(vocab: int) -> torch.Tensor:
    """Two equal-length requests: 9 prompt tokens + DECODE_STEPS decode tokens + a 3-token
    verify window."""
    return torch.randint(0, vocab, (2, 9 + DECODE_STEPS + 3),
                         generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def schedule(model: K3ForCausalLM) -> list[torch.Tensor]:
    """Logits of a prefill, DECODE_STEPS one-token decodes, then a verify window, committed at
    step 1 and followed by one more decode."""
    ids = prompts(model.config.vocab_size)
    out = []
    logits, state = model(ids[:, :9])
    out.append(logits)
    for t in range(9, 9 + DECODE_STEPS):
        logits, state = model(ids[:, t : t + 1], state)
        out.append(logits)
    start = 9 + DECODE_STEPS
    logits, windows, _ = model.verify(ids[:, start : start + 3], state)
    out.append(logits)
    state = windows.at(1)
    assert isinstance(state, K3State) and state.length == start + 2
    logits, _ = model(ids[:, start + 2 : start + 3], state)
    out.append(logits)
    return out


def _tp_worker(rank: int, world: int, port: int, folders: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    try:
        for i, folder in enumerate(folders):
            _tp_rank_run(load_k3(folder, tp=TPContext(rank, world, None)),
                         os.path.join(out_dir, f"rank{rank}_{i}.pt"))
    finally:
        release_tensor_parallel()


def _tp_rank_run(model: K3ForCausalLM, path: str) -> None:
    c = model.config
    kda = model.model.layers[c.linear_attn_config.kda_layers[0] - 1].self_attn
    mla = model.model.layers[c.linear_attn_config.full_attn_layers[0] - 1].self_attn
    moe = model.model.layers[c.first_k_dense_replace].mlp
    dense = model.model.layers[0].mlp
    torch.save({
        "logits": schedule(model),
        "experts": sorted(int(e) for e in moe.experts),
        "kda_heads": kda.num_heads,
        "A_log": kda.A_log.detach().clone(),
        "mla_heads": mla.num_heads,
        "dense_width": dense.gate_proj.weight.shape[0],
        "shared_width": moe.shared_experts.gate_proj.weight.shape[0],
    }, path)


def test_tp2_matches_tp1(tmp_path: Path) -> None:
    config = K3Config.from_file(MINI)
    lin = config.linear_attn_config
    for n in (config.kda_num_heads, config.num_attention_heads, config.num_experts,
              config.shared_intermediate_size, config.intermediate_size):
        assert n % 2 == 0
    folders = [tmp_path / "fp32", tmp_path / "fp8"]
    model = build(config)
    save_k3(model, folders[0])
    save_k3(model, folders[1], fp8=True)
    run_ranks(_tp_worker, (2, free_port(), [str(f) for f in folders], str(tmp_path)))
    for i, folder in enumerate(folders):
        single = load_k3(folder)
        expected = schedule(single)
        kda_full = single.model.layers[lin.kda_layers[0] - 1].self_attn
        for rank in range(2):
            _check_rank(torch.load(tmp_path / f"rank{rank}_{i}.pt"), rank, config,
                        kda_full.A_log, expected)


def _check_rank(got: dict[str, Any], rank: int, config: K3Config, full_A_log: torch.Tensor,
                expected: list[torch.Tensor]) -> None:
    per_rank = config.num_experts // 2
    assert got["experts"] == list(range(rank * per_rank, (rank + 1) * per_rank))
    assert got["kda_heads"] == config.kda_num_heads // 2
    h = config.kda_num_heads // 2
    torch.testing.assert_close(got["A_log"], full_A_log[rank * h : (rank + 1) * h],
                               rtol=0, atol=0)
    assert got["mla_heads"] == config.num_attention_heads // 2
    assert got["dense_width"] == config.intermediate_size // 2
    assert got["shared_width"] == config.shared_intermediate_size // 2
    assert len(got["logits"]) == len(expected)
    for a, b in zip(got["logits"], expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tp1_context_is_the_plain_model(tmp_path: Path) -> None:
    config = K3Config.from_file(MINI)
    folder = tmp_path / "ckpt"
    save_k3(build(config), folder)
    plain, one = load_k3(folder), load_k3(folder, tp=TPContext())
    assert plain.state_dict().keys() == one.state_dict().keys()
    ids = prompts(config.vocab_size)[:, :6]
    with torch.no_grad():
        torch.testing.assert_close(one(ids)[0], plain(ids)[0], rtol=0, atol=0)


def test_indivisible_tp_is_refused() -> None:
    config = K3Config.from_file(MINI)  # 6 KDA / MLA heads
    with torch.device("meta"), pytest.raises(ValueError, match="divisible"):
        K3ForCausalLM(config, TPContext(0, 4))
    with torch.device("meta"):
        shard = K3ForCausalLM(config, TPContext(1, 2))
    with pytest.raises(ValueError, match="full model"):
        save_k3(shard, "/nonexistent")
