"""Build the tiny random K3 vision fixture that `tests/test_moonvit.py` checks
`serve_app.models.moonvit` against, by running SGLang 0.5.23's own K3 tower and projector.

    mkdir -p /tmp/moonvit_ref
    cp <sglang 0.5.23>/srt/models/kimi_k3_vl.py <sglang 0.5.23>/srt/models/kimi_vl_moonvit.py \
        /tmp/moonvit_ref/
    OMP_NUM_THREADS=1 python tools/make_moonvit_fixture.py /tmp/moonvit_ref/kimi_k3_vl.py \
        /tmp/moonvit_ref/kimi_vl_moonvit.py

The reference is a saved copy of SGLang's `kimi_k3_vl.py` (KimiK3VisionTower,
KimiK3MultiModalProjector: a port of the checkpoint's modeling_kimi_k3.py whose math is the
same), executed unchanged except for its imports: SGLang is not importable on a CPU machine, so
its GPU-only modules (fused RoPE kernel, attention backends, CUDA-graph runner, environment
flags) are stubbed with the answers a CPU run gets anyway (no fused RoPE, the "sdpa" backend,
which is also what `_resolve_mm_attention_backend` picks off-GPU). `tpool_patch_merger` is taken
from a saved `kimi_vl_moonvit.py` (only that function is executed; the rest of that module
imports SGLang). Nothing of the reference is copied into the repository.

The fixture, `tests/data/vision/moonvit-tiny/`:
  - `config.json`: a `kimi_k3` wrapper whose `vision_config` has K3's structure at toy sizes
    (3 blocks, hidden 64, qkv width 96 != hidden, 2 heads of 48, MLP 128, an 8x8 position
    table, a 2x2 merge, text hidden 80) and a `text_config` giving hidden_size only;
  - `model.safetensors`: the random weights (fp32) under the checkpoint's names;
  - `cases.safetensors`: per case `pixels.<case>` (uint8 patches [P, 3, 14, 14], normalised as
    K3 does, (x/255 - 0.5)/0.5), `ref64.<case>` / `ref32.<case>` (the reference's output run in
    float64 / float32 from the same fp32 weights); the metadata holds each case's grids (JSON)
    and the measured spread max|ref32 - ref64| over all cases.
Cases: single images with grids equal to, smaller than and larger than the 8x8 table,
non-square both ways, the 2x2 minimum; and "packed", several images in one call.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "vision" / "moonvit-tiny"
SEED = 20261219
VISION_CONFIG = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_height": 8,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 8,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_hidden_size": 64,
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "qkv_hidden_size": 96,
    "text_hidden_size": 80,
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 3,
}
# (t, h, w) per image: the table's own size (no interpolation), larger and non-square (wide),
# smaller and non-square (wide), taller than wide crossing the table (shrink h, grow w... here
# h > table, w < table), and the 2x2 minimum.
CASES: dict[str, list[tuple[int, int, int]]] = {
    "table": [(1, 8, 8)],
    "larger_wide": [(1, 10, 14)],
    "smaller_wide": [(1, 4, 6)],
    "tall_mixed": [(1, 12, 4)],
    "minimum": [(1, 2, 2)],
    "packed": [(1, 10, 14), (1, 4, 6), (1, 12, 4)],
}


def _stub(name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _install_stubs(merger_source: Path) -> None:
    """The sglang modules kimi_k3_vl.py imports, as a CPU run sees them."""
    for pkg in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention",
                "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
                "sglang.srt.models", "sglang.srt.multimodal"):
        _stub(pkg, __path__=[])

    def no_fused(*args: object, **kwargs: object) -> bool:
        return False

    def fused_rope(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused RoPE kernel is GPU-only")

    _stub("sglang.kernels.ops.attention.vision_rope",
          apply_fused_qk_complex_rope=fused_rope, can_use_fused_qk_complex_rope=no_fused,
          precompile_fused_qk_complex_rope=no_fused)
    flag = types.SimpleNamespace(get=lambda: False)
    _stub("sglang.srt.environ", envs=types.SimpleNamespace(SGLANG_VIT_ENABLE_CUDA_GRAPH=flag))

    def metadata(cu_seqlens: torch.Tensor, device: object = None, **kwargs: object
                 ) -> types.SimpleNamespace:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return types.SimpleNamespace(cu_seqlens=cu_seqlens, max_seqlen=max(lengths))

    _stub("sglang.srt.layers.attention.vision", FLASHINFER_WORKSPACE_SIZE_BYTES=0,
          QKV_BACKEND_IMPL={}, VisionAttentionMetadata=types.SimpleNamespace,
          prepare_flashinfer_cudnn_vision_attention_metadata=metadata,
          prepare_vision_attention_metadata=metadata)

    def get_mm() -> None:
        raise ValueError("no multimodal config published (as at import time)")

    _stub("sglang.srt.runtime_context", get_mm=get_mm)
    _stub("sglang.srt.utils", get_bool_env_var=lambda name, default="false": False,
          is_hip=lambda: False, print_info_once=lambda *a, **k: None)
    _stub("sglang.srt.multimodal.mm_utils",
          concat_or_single=lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs))

    # Only tpool_patch_merger of kimi_vl_moonvit.py (its other code imports SGLang).
    tree = ast.parse(merger_source.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)
             and n.name == "tpool_patch_merger"]
    if len(funcs) != 1:
        raise SystemExit(f"{merger_source}: no tpool_patch_merger function")
    namespace: dict[str, object] = {}
    exec("from typing import List, Optional, Sequence\nimport torch\n", namespace)
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(merger_source), "exec"), namespace)
    _stub("sglang.srt.models.kimi_vl_moonvit", tpool_patch_merger=namespace["tpool_patch_merger"])


def _load_reference(vl_source: Path) -> types.ModuleType:
    module = types.ModuleType("kimi_k3_vl_reference")
    module.__file__ = str(vl_source)
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    exec(compile(vl_source.read_text(), str(vl_source), "exec"), module.__dict__)
    return module


def random_weights(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Checkpoint-named fp32 tensors: linears ~ N(0, 1/in), norms 1 + N(0, 0.1^2) (so a swapped
    or transposed norm weight shows), the position table ~ N(0, 0.5^2)."""
    c = VISION_CONFIG
    d, q, i = c["vt_hidden_size"], c["qkv_hidden_size"], c["vt_intermediate_size"]
    m, text = 4 * d, c["text_hidden_size"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=generator) / in_f**0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=generator)

    w = {
        "vision_tower.patch_embed.proj.weight":
            torch.randn(d, 3, 14, 14, generator=generator) / (3 * 14 * 14) ** 0.5,
        "vision_tower.patch_embed.pos_emb.weight":
            0.5 * torch.randn(c["init_pos_emb_height"], c["init_pos_emb_width"], d,
                              generator=generator),
    }
    for b in range(c["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        w[p + "norm0.weight"] = norm(d)
        w[p + "norm1.weight"] = norm(d)
        w[p + "wqkv.weight"] = linear(3 * q, d)
        w[p + "wo.weight"] = linear(d, q)
        w[p + "mlp.fc0.weight"] = linear(i, d)
        w[p + "mlp.fc1.weight"] = linear(d, i)
    w["vision_tower.encoder.final_layernorm.weight"] = norm(d)
    w["mm_projector.proj.0.weight"] = linear(m, m)
    w["mm_projector.proj.2.weight"] = linear(text, m)
    w["mm_projector.post_norm.weight"] = norm(text)
    return w


def normalise(patches: torch.Tensor) -> torch.Tensor:
    """K3's (x/255 - mean)/std with mean = std = 0.5, in float32 (what the test does too)."""
    return (patches.float() / 255.0 - 0.5) / 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kimi_k3_vl", type=Path, help="a saved copy of SGLang's kimi_k3_vl.py")
    parser.add_argument("kimi_vl_moonvit", type=Path,
                        help="a saved copy of SGLang's kimi_vl_moonvit.py (tpool_patch_merger)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _install_stubs(args.kimi_vl_moonvit)
    ref = _load_reference(args.kimi_k3_vl)

    generator = torch.Generator().manual_seed(SEED)
    weights = random_weights(generator)
    vc = types.SimpleNamespace(**{k: (tuple(v) if isinstance(v, list) else v)
                                  for k, v in VISION_CONFIG.items()})

    def build(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
        tower = ref.KimiK3VisionTower(vc)
        projector = ref.KimiK3MultiModalProjector(vc)
        tower.load_state_dict({k.removeprefix("vision_tower."): v for k, v in weights.items()
                               if k.startswith("vision_tower.")}, strict=True)
        projector.load_state_dict({k.removeprefix("mm_projector."): v for k, v in weights.items()
                                   if k.startswith("mm_projector.")}, strict=True)
        return tower.to(dtype).eval(), projector.to(dtype).eval()

    runs = {dtype: build(dtype) for dtype in (torch.float32, torch.float64)}
    cases: dict[str, torch.Tensor] = {}
    spread = 0.0
    for name, grids in CASES.items():
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randint(0, 256, (patches, 3, 14, 14), generator=generator,
                               dtype=torch.uint8)
        cases[f"pixels.{name}"] = pixels
        outs = {}
        for dtype, (tower, projector) in runs.items():
            with torch.no_grad():
                merged = tower(normalise(pixels).to(dtype), torch.tensor(grids))
                outs[dtype] = projector(merged)
        cases[f"ref64.{name}"] = outs[torch.float64].contiguous()
        cases[f"ref32.{name}"] = outs[torch.float32].contiguous()
        diff = (outs[torch.float32].double() - outs[torch.float64]).abs().max().item()
        print(f"{name}: grids {grids} -> {tuple(outs[torch.float64].shape)}, "
              f"max|ref32 - ref64| = {diff:.3e}")
        spread = max(spread, diff)

    args.out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
              "text_config": {"hidden_size": VISION_CONFIG["text_hidden_size"]},
              "vision_config": VISION_CONFIG}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(args.out / "model.safetensors"))
    meta = {"grids": json.dumps({k: [list(g) for g in v] for k, v in CASES.items()}),
            "spread_ref32_ref64": repr(spread), "seed": str(SEED),
            "reference": "sglang 0.5.23 srt/models/kimi_k3_vl.py", "torch": torch.__version__}
    save_file(cases, str(args.out / "cases.safetensors"), metadata=meta)
    print(f"spread (max over cases) {spread:.3e}; wrote {args.out}")


if __name__ == "__main__":
    main()
