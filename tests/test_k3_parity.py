"""Parity with a peer: with every K3-only feature switched
off, our K3ForCausalLM loads a tiny random transformers-5.23 `KimiLinearForCausalLM` checkpoint
and reproduces its logits and its greedy continuation through the cache.

The fixture (`tests/data/kimi-linear-tiny/`, made by `tools/make_kimi_linear_fixture.py`) holds
the checkpoint as `save_pretrained` wrote it plus the transformers outputs; transformers itself
is never imported here.

The K3-only switches, all off (where SGLang's kimi_k3.py falls back to plain
KimiLinear): `attn_res_block_size` null (plain pre-norm residual), `routed_expert_hidden_size`
null (hidden-space experts), `hidden_act` "silu" (no SiTU), `mla_use_output_gate` false,
`linear_attn_config.use_full_rank_gate` false (low-rank g_a/g_b output gate), no
`linear_attn_config.gate_lower_bound` (softplus forget gate). The two places where transformers
differs from SGLang are handled in the fixture (MLA latent-norm eps patched to rms_norm_eps) and
here (A_log [1, 1, h, 1] -> [h]; the conv kept as q/k/v_conv1d or split from `conv1d`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from serve_app.models.k3 import K3ForCausalLM, K3State
from serve_app.models.k3_config import K3Config, k3_tensor_shapes

FIXTURE = Path(__file__).parent / "data" / "kimi-linear-tiny"
ATOL = 1e-4


def k3_config_from_hf(hf: dict[str, Any]) -> K3Config:
    """A K3 text_config (published K3 field names) from a transformers KimiLinear config.json,
    with every K3-only feature off."""
    layer_types = hf["layer_types"]
    mlp_types = hf["mlp_layer_types"]
    first_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    assert all(t == "sparse" for t in mlp_types[first_dense:]), mlp_types
    return K3Config.from_dict({
        "hidden_size": hf["hidden_size"],
        "vocab_size": hf["vocab_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "max_position_embeddings": hf["model_max_length"],
        "tie_word_embeddings": hf["tie_word_embeddings"],
        "intermediate_size": hf["intermediate_size"],
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "hidden_act": hf["hidden_act"],  # "silu": no SiTU
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layer_types)
                                 if t == "full_attention"],
            "num_heads": hf["linear_num_heads"],
            "head_dim": hf["linear_head_dim"],
            "short_conv_kernel_size": hf["linear_conv_kernel_dim"],
            # no gate_lower_bound: the softplus gate
            "use_full_rank_gate": False,
        },
        "num_attention_heads": hf["num_attention_heads"],
        "num_key_value_heads": hf["num_key_value_heads"],
        "q_lora_rank": hf["q_lora_rank"],
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "mla_use_nope": True,
        "mla_use_output_gate": False,
        "num_experts": hf["num_experts"],
        "num_experts_per_token": hf["num_experts_per_token"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "routed_expert_hidden_size": None,
        "latent_moe_use_norm": False,
        "num_shared_experts": hf["num_shared_experts"],
        "moe_renormalize": hf["moe_renormalize"],
        "routed_scaling_factor": hf["routed_scaling_factor"],
        "num_expert_group": hf["num_expert_group"],
        "topk_group": hf["topk_group"],
        "attn_res_block_size": None,
        "bos_token_id": hf["bos_token_id"],
        "eos_token_id": hf["eos_token_id"],
        "pad_token_id": hf["pad_token_id"],
        "dtype": "float32",
    })


def hf_to_k3(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One transformers KimiLinear tensor -> our (SGLang K3) names. Both the names
    `save_pretrained` writes (the original checkpoint's) and transformers' runtime names are
    accepted."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    if name.endswith(".self_attn.A_log"):
        return [(name, t.reshape(-1))]  # [1, 1, h, 1] -> [h]
    if name.endswith(".self_attn.conv1d.weight"):  # runtime: q|k|v stacked on dim 0
        prefix = name.removesuffix("conv1d.weight")
        return [(f"{prefix}{p}_conv1d.weight", c) for p, c in zip("qkv", t.chunk(3), strict=True)]
    if name.endswith(".mlp.experts.gate_up_proj"):  # runtime: [E, 2I, H] = cat(w1, w3) dim 1
        prefix = name.removesuffix("gate_up_proj")
        out = []
        for e, w in enumerate(t):
            w1, w3 = w.chunk(2)
            out += [(f"{prefix}{e}.w1.weight", w1), (f"{prefix}{e}.w3.weight", w3)]
        return out
    if name.endswith(".mlp.experts.down_proj"):  # runtime: [E, H, I]
        prefix = name.removesuffix("down_proj")
        return [(f"{prefix}{e}.w2.weight", w) for e, w in enumerate(t)]
    return [(name, t)]


def map_state_dict(hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors.items():
        for new, v in hf_to_k3(name, t):
            assert new not in out, f"{new} produced twice (second time from {name})"
            out[new] = v.contiguous()
    return out


@pytest.fixture(scope="module")
def peer() -> tuple[K3ForCausalLM, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    hf_config = json.loads((FIXTURE / "config.json").read_text())
    assert hf_config["model_type"] == "kimi_linear"
    config = k3_config_from_hf(hf_config)
    hf_tensors = load_file(FIXTURE / "model.safetensors")
    mapped = map_state_dict(hf_tensors)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).float().eval()
    model.load_state_dict(mapped, strict=True)
    return model, mapped, load_file(FIXTURE / "expected.safetensors")


def test_config_has_every_k3_switch_off(peer) -> None:
    c = peer[0].config
    assert not c.uses_attn_res and not c.is_latent_moe and c.hidden_act == "silu"
    assert not c.mla_use_output_gate and not c.kda_full_rank_gate
    assert c.kda_gate_lower_bound is None
    assert c.kda_layers and c.mla_layers and c.dense_layers and c.moe_layers


def test_every_checkpoint_tensor_used_exactly_once(peer) -> None:
    model, mapped, _ = peer
    expected = dict(k3_tensor_shapes(model.config))
    assert {k: tuple(v.shape) for k, v in mapped.items()} == expected
    ours = model.state_dict()
    assert set(ours) == set(mapped)
    for k, v in mapped.items():
        assert torch.equal(ours[k], v), k


def test_logits_and_hidden_states_match(peer) -> None:
    model, _, exp = peer
    ids = exp["input_ids"]
    n = model.config.num_hidden_layers
    with torch.no_grad():
        logits, _ = model(ids)
        h_final, _, taps = model.model(ids, K3State(), capture_layers=range(n))
    hidden = exp["hidden_states"]  # [emb, layer 0 .. L-2 outputs, norm(layer L-1 output)]
    assert hidden.shape[0] == n + 1
    torch.testing.assert_close(model.model.embed_tokens(ids), hidden[0], atol=ATOL, rtol=0)
    for i in range(n - 1):
        torch.testing.assert_close(taps[i], hidden[i + 1], atol=ATOL, rtol=0,
                                   msg=lambda m, i=i: f"layer {i}: {m}")
    torch.testing.assert_close(h_final, hidden[n], atol=ATOL, rtol=0)
    diff = (logits - exp["logits"]).abs().max().item()
    print(f"max |logit diff| = {diff:.3g}")
    assert diff <= ATOL


def test_greedy_continuation_through_state(peer) -> None:
    """Prefill the prompt, then decode one token at a time through K3State: the greedy tokens
    equal transformers' `generate` (its hybrid cache), and so do the logits of every step."""
    model, _, exp = peer
    ids, generated, step_logits = exp["input_ids"], exp["generated"], exp["step_logits"]
    steps = step_logits.shape[1]
    with torch.no_grad():
        logits, state = model(ids)
        out = [logits[:, -1]]
        tokens = [int(logits[0, -1].argmax())]
        for _ in range(steps - 1):
            logits, state = model(torch.tensor([[tokens[-1]]]), state)
            out.append(logits[:, -1])
            tokens.append(int(logits[0, -1].argmax()))
    assert state.length == ids.shape[1] + steps - 1
    assert tokens == generated[0, ids.shape[1]:].tolist()
    ours = torch.stack(out, dim=1)
    diff = (ours - step_logits).abs().max().item()
    print(f"max |decode logit diff| = {diff:.3g}")
    assert diff <= ATOL


def test_runtime_names_map_the_same(peer) -> None:
    """transformers' in-memory names (conv1d stacked, forget_gate., experts merged into
    gate_up_proj / down_proj, mlp.) map to the same tensors as the saved checkpoint names."""
    model, mapped, _ = peer
    saved = load_file(FIXTURE / "model.safetensors")
    runtime: dict[str, torch.Tensor] = {}
    for name, t in saved.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            name = name.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
        runtime[name] = t
    for layer in model.config.kda_layers:
        a = f"model.layers.{layer}.self_attn."
        runtime[a + "conv1d.weight"] = torch.cat(
            [runtime.pop(f"{a}{p}_conv1d.weight") for p in "qkv"])
    for layer in model.config.moe_layers:
        m = f"model.layers.{layer}.mlp.experts."
        e = range(model.config.num_experts)
        runtime[m + "gate_up_proj"] = torch.stack([
            torch.cat([runtime.pop(f"{m}{i}.w1.weight"), runtime.pop(f"{m}{i}.w3.weight")])
            for i in e])
        runtime[m + "down_proj"] = torch.stack([runtime.pop(f"{m}{i}.w2.weight") for i in e])
    again = map_state_dict(runtime)
    assert set(again) == set(mapped)
    for k, v in again.items():
        assert torch.equal(v, mapped[k]), k
