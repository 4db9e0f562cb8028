"""Build the tiny random transformers `KimiLinearForCausalLM` fixture that
`tests/test_k3_parity.py` checks our K3 model against (K3 with every K3-only feature off).

The fixture lives in `tests/data/kimi-linear-tiny/`:
  - `config.json`, `model.safetensors`: `save_pretrained` output (fp32). transformers writes the
    original checkpoint names there (routed experts as `w1`/`w3`/`w2`, the conv split into
    `q_conv1d`/`k_conv1d`/`v_conv1d`, `A_log` as [1, 1, h, 1], `block_sparse_moe.` for every
    FFN, the forget gate's tensors directly under `self_attn.`).
  - `expected.safetensors`: `input_ids` [1, T] (the fixed prompt), `logits` [1, T, V] of one
    full forward, `hidden_states` [L+1, 1, T, H] (the embedding, then each layer's output; the
    last one is after the final norm, as transformers returns it), and `generated` [1, T + N],
    the prompt and N greedy tokens from `generate` (which decodes one token at a time through
    the transformers hybrid cache), and `step_logits` [1, N, V], the logits each of those N
    greedy choices was taken from (the prefill's last position, then each cached decode step).
  - `meta.json`: the transformers / torch versions, the seed and the prompt.

The model is random (seeded) with distinct widths so that a transposed or mis-split tensor
cannot load silently: a mix of KDA and MLA layers (the last layer MLA), a dense first layer and
MoE after it with a few experts, a grouped router and shared experts. Widths are multiples of 4
(transformers' CPU `grouped_mm` experts path needs 16-byte strides).

One patch is applied before running: transformers hard-codes the MLA
`q_a_layernorm` / `kv_a_layernorm` eps to 1e-6, while SGLang (and our K3MLA) use
`rms_norm_eps`; both are set to `rms_norm_eps` (1e-5). Everything else is transformers as
shipped. The conv activation follows `hidden_act`, which is "silu" here, as our KDA always is.

Regenerate (transformers is never installed into the project's venv):

    python3.11 -m venv --system-site-packages /tmp/tfenv
    /tmp/tfenv/bin/pip install transformers==5.23.0 torch==2.13.0
    /tmp/tfenv/bin/python tools/make_kimi_linear_fixture.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "kimi-linear-tiny"
SEED = 1234
PROMPT = [3, 17, 250, 42, 99, 7, 128, 64, 200, 5, 31, 77]
NEW_TOKENS = 8

# 1-based, as published: layers 0, 1, 3 (0-based) are KDA; 2 and 4 are MLA.
KDA_LAYERS = [1, 2, 4]
FULL_ATTN_LAYERS = [3, 5]
NUM_LAYERS = 5
FIRST_K_DENSE = 1


def tiny_config() -> KimiLinearConfig:
    layer_types = [
        "linear_attention" if (i + 1) in KDA_LAYERS else "full_attention"
        for i in range(NUM_LAYERS)
    ]
    mlp_types = ["dense" if i < FIRST_K_DENSE else "sparse" for i in range(NUM_LAYERS)]
    return KimiLinearConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=40,
        moe_intermediate_size=20,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=3,
        num_key_value_heads=3,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        kv_lora_rank=12,
        q_lora_rank=20,
        qk_rope_head_dim=4,
        v_head_dim=12,
        qk_nope_head_dim=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        num_local_experts=8,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        attn_implementation="eager",
    )


@torch.no_grad()
def randomize(model: KimiLinearForCausalLM, gen: torch.Generator) -> None:
    """Weights large enough that the logits are far from uniform (distinct greedy tokens):
    matrices ~ N(0, 1/fan_in), norms 1 + 0.1·N, a small random router bias. A_log and dt_bias
    keep transformers' FLA-style init."""
    for name, p in model.named_parameters():
        if name.endswith("A_log") or name.endswith("dt_bias"):
            continue
        if p.dim() == 1:  # RMSNorm weights
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    config = tiny_config()
    model = KimiLinearForCausalLM(config).float().eval()
    randomize(model, gen)
    # Patch: MLA latent norms use rms_norm_eps, as SGLang / our K3MLA do.
    for layer in model.model.layers:
        attn = layer.self_attn
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            if getattr(attn, norm, None) is not None:
                getattr(attn, norm).variance_epsilon = config.rms_norm_eps

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, pad_token_id=0,
            return_dict_in_generate=True, output_logits=True,
        )
    step_logits = torch.stack(generated.logits, dim=1).float()  # [1, N, V]
    generated = generated.sequences
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    save_file(
        {
            "input_ids": ids.contiguous(),
            "logits": out.logits.float().contiguous(),
            "hidden_states": torch.stack(out.hidden_states).float().contiguous(),
            "generated": generated.contiguous(),
            "step_logits": step_logits.contiguous(),
        },
        args.out / "expected.safetensors",
    )
    import transformers

    (args.out / "meta.json").write_text(json.dumps({
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
        "patched": "q_a_layernorm / kv_a_layernorm variance_epsilon = rms_norm_eps",
    }, indent=2) + "\n")
    print("generated", generated.tolist())
    for f in sorted(args.out.iterdir()):
        print(f.name, f.stat().st_size)


if __name__ == "__main__":
    main()
