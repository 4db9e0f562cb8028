"""Our K3 tensor table (`k3_layer_tensors` / `k3_tensor_shapes`) against what SGLang 0.5.23's
K3 loader (`sglang/srt/models/kimi_k3.py`) registers and accepts, read from the committed extract
`tests/data/sglang_k3_names_0_5_23.json` (tools/extract_sglang_k3_names.py). CPU only.

Regenerate the extract: python tools/extract_sglang_k3_names.py SGLANG_SRC -o tests/data/...
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from sglang_source import SGLANG_SRC, sglang_file

from serve_app.models.k3_config import K3Config, k3_layer_tensors, k3_tensor_shapes

ROOT = Path(__file__).resolve().parent.parent
EXTRACT = ROOT / "tests" / "data" / "sglang_k3_names_0_5_23.json"
CONFIGS = {"real": ROOT / "capacity" / "data" / "kimi-k3-config.json",
           "mini": ROOT / "tests" / "data" / "mini-k3-config.json"}

# Every `if` test guarding a parameter in the extract, as a function of our config. A new SGLang
# condition fails `test_every_condition_is_known` until it is mapped here.
CONDITIONS: dict[str, Callable[[K3Config], bool]] = {
    "self.use_full_rank_gate": lambda c: c.kda_full_rank_gate,
    "self.use_output_gate": lambda c: c.mla_use_output_gate,
    "self.q_lora_rank is not None": lambda c: c.q_lora_rank is not None,
    # MoEGate(config, quant_config=None, prefix=...) at kimi_k3.py:484: is_hash_moe and
    # vl_correction_bias keep their False defaults.
    "config.topk_method == 'noaux_tc' and (not is_hash_moe)":
        lambda c: c.topk_method == "noaux_tc",
    "vl_correction_bias": lambda c: False,
    "self.num_shared_experts is not None and self.num_shared_experts > 0":
        lambda c: bool(c.num_shared_experts),
    "self.use_latent_moe": lambda c: c.is_latent_moe,
    "config.latent_moe_use_norm": lambda c: c.latent_moe_use_norm,
    "self.use_attn_residuals": lambda c: c.uses_attn_res,
    "config.attn_res_block_size is not None": lambda c: c.uses_attn_res,
    # One pipeline stage holds everything; no GGUF split-K/V quantization.
    "self.pp_group.is_first_rank": lambda c: True,
    "self.pp_group.is_last_rank": lambda c: True,
    "split_gguf_kv_b": lambda c: False,
}
# Runtime choices (quantization, DP attention) that change SGLang's fused params but must not
# change the checkpoint names it takes: the test runs every combination.
RUNTIME = ("self.do_fuse_qkvbfg",)

# Our names SGLang does not register, and SGLang's required names we lack, each with a reason.
OURS_ONLY: dict[str, str] = {}
SGLANG_ONLY: dict[str, str] = {}


@pytest.fixture(scope="module")
def extract() -> dict[str, Any]:
    return json.loads(EXTRACT.read_text())


# The mini config with every optional branch flipped (low-rank KDA gate, no q LoRA, no MLA
# output gate, no latent MoE, no shared experts, plain residual, tied embeddings), so SGLang's
# other branches are compared too.
FLIPPED = {"q_lora_rank": None, "mla_use_output_gate": False, "routed_expert_hidden_size": None,
           "latent_moe_use_norm": False, "num_shared_experts": 0, "attn_res_block_size": None,
           "tie_word_embeddings": True}


def _config(which: str) -> K3Config:
    if which != "mini-flipped":
        return K3Config.from_file(CONFIGS[which])
    raw = json.loads(CONFIGS["mini"].read_text())
    raw.pop("tie_word_embeddings", None)
    text = raw.get("text_config", raw)
    text.update(FLIPPED)
    text["linear_attn_config"] = {**text["linear_attn_config"], "use_full_rank_gate": False}
    return K3Config.from_dict(raw)


def _required(extract: dict[str, Any], kind: str, c: K3Config, runtime: dict[str, bool],
              num_experts: int) -> set[str]:
    """Checkpoint names (kind-relative, with the kind's prefix) SGLang registers for `kind`."""
    env = {**{k: f(c) for k, f in CONDITIONS.items()}, **runtime}
    prefix = extract["prefixes"][kind]
    names: set[str] = set()
    for row in extract["kinds"][kind]:
        if all(env[w["test"]] == w["value"] for w in row["when"]):
            for ckpt in row["checkpoint"]:
                ids = range(num_experts) if "{e}" in ckpt else [None]
                names |= {prefix + ckpt.replace("{e}", str(i)) for i in ids}
    return names


def _ours_by_kind(c: K3Config, layer: int) -> dict[str, set[str]]:
    stem = f"model.layers.{layer}."
    out: dict[str, set[str]] = {"layer": set(), "attn_res": set(), "attn": set(), "ffn": set()}
    for name, _shape in k3_layer_tensors(c, layer):
        assert name.startswith(stem), name
        suffix = name[len(stem):]
        kind = ("attn" if suffix.startswith("self_attn.") else "ffn" if suffix.startswith(
            "mlp.") else "attn_res" if "_res_" in suffix else "layer")
        out[kind].add(suffix)
    return out


def _runtime_envs() -> list[dict[str, bool]]:
    return [dict(zip(RUNTIME, values, strict=True))
            for values in product((False, True), repeat=len(RUNTIME))]


def test_every_condition_is_known(extract: dict[str, Any]) -> None:
    tests = {w["test"] for rows in extract["kinds"].values() for r in rows for w in r["when"]}
    assert tests <= set(CONDITIONS) | set(RUNTIME), tests - set(CONDITIONS) - set(RUNTIME)


def test_extract_prefixes_and_mappings(extract: dict[str, Any]) -> None:
    assert extract["sglang_version"] == "0.5.23"
    assert extract["prefixes"] == {"kda": "self_attn.", "mla": "self_attn.", "moe": "mlp.",
                                   "dense_mlp": "mlp.", "layer": "", "attn_res": "", "top": ""}
    expert = extract["expert_params_mapping"]
    assert (expert["ckpt_gate_proj_name"], expert["ckpt_up_proj_name"],
            expert["ckpt_down_proj_name"]) == ("w1", "w3", "w2")


@pytest.mark.parametrize("which", [*sorted(CONFIGS), "mini-flipped"])
def test_layer_tensor_names_match_sglang(extract: dict[str, Any], which: str) -> None:
    c = _config(which)
    for runtime in _runtime_envs():
        for layer in range(c.num_hidden_layers):
            ours = _ours_by_kind(c, layer)
            attn = "kda" if c.is_kda(layer) else "mla"
            ffn = "moe" if c.is_moe(layer) else "dense_mlp"
            for mine, kind in (("layer", "layer"), ("attn_res", "attn_res"), ("attn", attn),
                               ("ffn", ffn)):
                theirs = _required(extract, kind, c, runtime, c.num_experts)
                extra = ours[mine] - theirs - set(OURS_ONLY)
                missing = theirs - ours[mine] - set(SGLANG_ONLY)
                assert not extra and not missing, (
                    f"{which} layer {layer} {kind} {runtime}: ours only {sorted(extra)[:8]}, "
                    f"SGLang only {sorted(missing)[:8]}")


@pytest.mark.parametrize("which", [*sorted(CONFIGS), "mini-flipped"])
def test_top_level_names_match_sglang(extract: dict[str, Any], which: str) -> None:
    c = _config(which)
    ours = {n for n, _ in k3_tensor_shapes(c) if not n.startswith("model.layers.")}
    theirs = _required(extract, "top", c, {}, 0)
    if c.tie_word_embeddings:  # SGLang registers lm_head and ties it to the embedding
        theirs.discard("lm_head.weight")
    assert ours == theirs


@pytest.mark.parametrize("which", [*sorted(CONFIGS), "mini-flipped"])
def test_names_survive_the_loader_rewrites(extract: dict[str, Any], which: str) -> None:
    """None of our names is dropped by a `continue` skip, caught by a stray substring rewrite,
    or (for experts) missed by the `_EXPERT_WEIGHT_NAME` match the loader keys experts on."""
    c = _config(which)
    regex = re.compile(extract["expert_params_mapping"]["regex"])
    skips = [s["substring"] for s in extract["skips"] if s["substring"] != "mlp.experts."]
    for name, _shape in k3_tensor_shapes(c):
        assert not any(s in name for s in skips), name
        assert ("weight_packed" not in name and "language_model." not in name
                and "block_sparse_moe" not in name), name
        if ".experts." in name:
            assert regex.search(name), name


def test_vendored_extract_matches_the_wheel_source(tmp_path: Path) -> None:
    sglang_file("srt/models/kimi_k3.py")
    spec = importlib.util.spec_from_file_location(
        "extract_k3", ROOT / "tools" / "extract_sglang_k3_names.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "names.json"
    assert module.main([str(SGLANG_SRC), "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(EXTRACT.read_text())
