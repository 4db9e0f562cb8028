"""Kimi K3's image encoder in plain PyTorch: the MoonViT-V2 vision tower (`vision_tower.*`) and
the patchmergerv2 projector (`mm_projector.*`), loaded strictly from a K3 checkpoint folder.

What SGLang 0.5.23 computes in `srt/models/kimi_k3_vl.py` (KimiK3VisionTower,
KimiK3MultiModalProjector) and the checkpoint's own `modeling_kimi_k3.py`
(MoonViT3dPretrainedModel, PatchMergerMLPV2); facts in /work/shared/reference/kimi-k3-vision.md.
For an image of grid (1, h, w) (P = h*w patches of 14x14, row-major):

    x = patch_embed.proj(pixels).view(P, D) + pos(h, w)            # Conv2d 3->D, k=s=14, no bias
    pos(h, w) = pos_emb.weight [H0, W0, D], F.interpolate to (h, w) (config's mode, bilinear for
                K3, align_corners=False, no antialias, also when shrinking); the table itself at
                (h, w) == (H0, W0)
    per block:  q, k, v = wqkv(norm0(x)).view(P, 3, heads, hd)     # 3-major; hd = qkv_hidden/heads
                q, k = rope2d(q), rope2d(k)                         # fp32, cast back
                x = x + wo(SDPA(q, k, v))                           # non-causal, one image only
                x = x + mlp.fc1(gelu_tanh(mlp.fc0(norm1(x))))
    x = encoder.final_layernorm(x)
    merged token (i, j) = cat(x[2i, 2j], x[2i, 2j+1], x[2i+1, 2j], x[2i+1, 2j+1])  # [h/2*w/2, 4D]
    features = mm_projector.post_norm(proj.2(gelu_exact(proj.0(merged))))          # [.., text D]

2D RoPE: for i < hd/4, f_i = 10000^(-4i/hd); q and k are viewed as hd/2 complex numbers over
INTERLEAVED pairs (2c, 2c+1); complex pair 2i rotates by the patch's column x*f_i and pair 2i+1
by its row y*f_i (both sources' code; the checkpoint's docstring says height first, its code does
not). The rotation table is built in fp32 per grid, never cast (a complex64 table cast to bf16
would lose its imaginary part). Both sources bound the grid at 512x512 (their precomputed table);
so does `forward`.

Norms: every encoder RMSNorm uses float32's machine epsilon (torch's nn.RMSNorm with eps=None
computes in fp32 and takes that epsilon in torch 2.13, for fp32 and bf16 inputs alike);
`post_norm` uses `projector_ln_eps`. All are computed in fp32 and cast back.

Packing: `K3Vision.forward` takes several images' patches concatenated ([sum P_i, 3, 14, 14])
and their grids. Attention runs image by image over the images' row ranges (cu_seqlens),
not as one call with a block-diagonal mask: what SGLang's sdpa path does, memory proportional
to the largest image's P^2 rather than (sum P_i)^2 (four 4096-patch images would need a
16k x 16k mask per head), and unmasked SDPA may use the fused flash / memory-efficient kernels
that an arbitrary mask rules out. Consecutive images of the same patch count go in one batched
SDPA call (the same attention, one kernel launch instead of one per image: a batch of 32
84-pixel images trains ~1.5x faster); a run of n images of P patches holds n x P^2 scores
where unbatched SDPA held P^2 at a time, still n times less than one masked call's (nP)^2.
Everything else (linears, norms, MLP) is per-token and
runs over the whole pack at once.

Only still images (t == 1) are supported; a video grid (t > 1, whose time embedding and
temporal pooling this module does not implement) is refused with a ValueError.

Tensor parallelism: none; the tower and projector are REPLICATED on every rank that needs them.
They hold ~447M parameters (~0.9 GB in bf16) next to a ~1T-parameter text model, and an image
costs a fraction of a prefill chunk's FLOPs, so splitting heads across ranks would add two
all-reduces per block (54 per image) for memory no rank is short of. SGLang also runs the K3
tower data-parallel (`use_data_parallel=True`), not tensor-parallel.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.models.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    TensorSpec,
    load_tensors,
    read_index,
    save_tensors,
    uninitialised,
)
from serve_app.models.layers import RMSNorm

__all__ = [
    "PROJECTOR_PREFIX",
    "ROPE_MAX_SIDE",
    "TOWER_PREFIX",
    "VISION_SHARD",
    "K3Vision",
    "MoonViT2",
    "PatchMergerV2",
    "VisionConfig",
    "VisionConfigError",
    "is_vision_tensor",
    "k3_vision_tensors",
    "load_k3_vision",
    "merged_tokens",
    "rope_2d_table",
    "save_k3_vision",
    "vision_checkpoint_specs",
    "vision_flops_per_image",
    "vision_params",
]

TOWER_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "mm_projector."
VISION_SHARD = "model-vision.safetensors"  # save_k3_vision's shard beside the text shards
ROPE_MAX_SIDE = 512  # both sources precompute the 2D RoPE table for 512 x 512 patches
ROPE_THETA = 10000.0
_ENCODER_NORM_EPS = torch.finfo(torch.float32).eps
GridTHW = tuple[int, int, int]


class VisionConfigError(ValueError):
    """A `vision_config` this module cannot build: every bad or missing key is named."""


# --- config --------------------------------------------------------------------------------------

# Keys a vision_config must give (sizes: nothing sensible to default to).
_REQUIRED_INTS = ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "vt_hidden_size",
                  "vt_num_hidden_layers", "vt_num_attention_heads", "qkv_hidden_size",
                  "vt_intermediate_size", "text_hidden_size")
# Structural keys: the value K3 publishes is both sources' config-class default; only it (or the
# listed alternatives) is implemented here.
_CHOICES: dict[str, tuple[Any, ...]] = {
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic"),
    "norm_type": ("rmsnorm",),
    "mlp_type": ("mlp2",),
    "activation_func": ("gelu_pytorch_tanh",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmergerv2",),
    "projector_hidden_act": ("gelu",),
    "attn_bias": (False,),
    "linear_bias": (False,),
    "patch_embed_proj_bias": (False,),
}


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config`, by its published key names. Keys this module does not read
    (`_attn_implementation`, a runtime choice; `video_attn_type`) are ignored."""

    patch_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    vt_hidden_size: int
    vt_num_hidden_layers: int
    vt_num_attention_heads: int
    qkv_hidden_size: int
    vt_intermediate_size: int
    text_hidden_size: int
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    activation_func: str = "gelu_pytorch_tanh"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_type: str = "sd2_tpool"
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None  # None: vt_hidden_size (the sources' rule)
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        problems = _config_problems(self)
        if problems:
            raise VisionConfigError("invalid vision_config:\n  - " + "\n  - ".join(problems))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VisionConfig:
        """Parse a `vision_config` object; one VisionConfigError names every bad key."""
        if not isinstance(data, Mapping):
            raise VisionConfigError(f"vision_config must be a JSON object, got {type(data).__name__}")
        problems: list[str] = []
        values: dict[str, Any] = {}
        for key in _REQUIRED_INTS:
            if key not in data:
                problems.append(f"{key}: missing")
            elif not _is_int(data[key]):
                problems.append(f"{key}: expected an integer, got {data[key]!r}")
            else:
                values[key] = data[key]
        for key in ("init_pos_emb_time", "mm_hidden_size"):
            if key in data and data[key] is not None:
                if _is_int(data[key]):
                    values[key] = data[key]
                else:
                    problems.append(f"{key}: expected an integer, got {data[key]!r}")
        for key, choices in _CHOICES.items():
            if key not in data:
                continue
            if _is_choice(data[key], choices):
                values[key] = data[key]
            elif isinstance(choices[0], bool) and not isinstance(data[key], bool):
                problems.append(f"{key}: expected a boolean, got {data[key]!r}")
            else:
                problems.append(f"{key}: {data[key]!r} is not supported (supported: "
                                f"{', '.join(repr(c) for c in choices)})")
        if "merge_kernel_size" in data:
            mk = data["merge_kernel_size"]
            if isinstance(mk, (list, tuple)) and len(mk) == 2 and all(_is_int(v) for v in mk):
                values["merge_kernel_size"] = (int(mk[0]), int(mk[1]))
            else:
                problems.append(f"merge_kernel_size: expected two integers, got {mk!r}")
        if "projector_ln_eps" in data:
            eps = data["projector_ln_eps"]
            if isinstance(eps, (int, float)) and not isinstance(eps, bool):
                values["projector_ln_eps"] = float(eps)
            else:
                problems.append(f"projector_ln_eps: expected a number, got {eps!r}")
        if problems:
            raise VisionConfigError("invalid vision_config:\n  - " + "\n  - ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The published `vision_config` object (what `from_dict` reads back)."""
        d = asdict(self)
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        d["mm_hidden_size"] = self.merge_input_size
        return d

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_input_size(self) -> int:
        """mm_hidden_size: the width of one patch entering the merge (= vt_hidden_size)."""
        return self.vt_hidden_size if self.mm_hidden_size is None else self.mm_hidden_size

    @property
    def merged_size(self) -> int:
        """The projector's input width: merge_kernel_size patches concatenated."""
        kh, kw = self.merge_kernel_size
        return self.merge_input_size * kh * kw


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_choice(v: Any, choices: tuple[Any, ...]) -> bool:
    # By type too: 0 == False, and a config's `attn_bias: 0` is not K3's `false`.
    return any(type(v) is type(c) and v == c for c in choices)


def _config_problems(c: VisionConfig) -> list[str]:
    problems = []
    for key in (*_REQUIRED_INTS, "init_pos_emb_time"):
        v = getattr(c, key)
        if not _is_int(v) or v < 1:
            problems.append(f"{key}={v!r} must be a positive integer")
    for key, choices in _CHOICES.items():
        if not _is_choice(getattr(c, key), choices):
            problems.append(f"{key}={getattr(c, key)!r} is not supported (supported: "
                            f"{', '.join(repr(x) for x in choices)})")
    if problems:
        return problems  # the relations below need valid sizes
    if c.qkv_hidden_size % c.vt_num_attention_heads:
        problems.append(f"qkv_hidden_size={c.qkv_hidden_size} must be a multiple of "
                        f"vt_num_attention_heads={c.vt_num_attention_heads}")
    elif c.head_dim % 4:
        problems.append(f"head dim qkv_hidden_size/vt_num_attention_heads={c.head_dim} must be "
                        "a multiple of 4 (2D RoPE rotates hd/4 column and hd/4 row pairs)")
    if c.mm_hidden_size is not None and c.mm_hidden_size != c.vt_hidden_size:
        problems.append(f"mm_hidden_size={c.mm_hidden_size} must equal "
                        f"vt_hidden_size={c.vt_hidden_size} (the projector takes the tower's "
                        "merged patches)")
    if len(c.merge_kernel_size) != 2 or any(not _is_int(k) or k < 1 for k in c.merge_kernel_size):
        problems.append(f"merge_kernel_size={c.merge_kernel_size!r} must be two positive integers")
    if not c.projector_ln_eps > 0:
        problems.append(f"projector_ln_eps={c.projector_ln_eps} must be > 0")
    return problems


# --- sizes -------------------------------------------------------------------------------------


def merged_tokens(config: VisionConfig, grid_thw: Sequence[int]) -> int:
    """How many features (prompt pad tokens) an image of this grid yields."""
    _, h, w = (int(v) for v in grid_thw)
    kh, kw = config.merge_kernel_size
    return (h // kh) * (w // kw)


def vision_params(config: VisionConfig) -> int:
    """Parameters of the tower + projector (every tensor the checkpoint holds for them)."""
    return sum(math.prod(spec.shape) for spec in vision_checkpoint_specs(config).values())


def vision_flops_per_image(config: VisionConfig, grid_thw: Sequence[int]) -> int:
    """Forward FLOPs (2 per multiply-add) of one image through tower + projector: the patch
    embedding, every block's linears and its attention (QK^T and AV over the image's P patches),
    and the projector. Norms, RoPE, GELU, softmax and the position-table interpolation (O(P*D)
    each) are left out."""
    t, h, w = (int(v) for v in grid_thw)
    p = t * h * w
    d, q, i = config.vt_hidden_size, config.qkv_hidden_size, config.vt_intermediate_size
    embed = p * 3 * config.patch_size**2 * d
    linears = p * (d * 3 * q + q * d + 2 * d * i)
    attention = 2 * p * p * q  # scores + weighted sum, over all heads
    n = merged_tokens(config, grid_thw)
    projector = n * config.merged_size * (config.merged_size + config.text_hidden_size)
    return 2 * (embed + config.vt_num_hidden_layers * (linears + attention) + projector)


# --- modules -----------------------------------------------------------------------------------


def _check_grids(grid_thws: Sequence[Sequence[int]], patches: int, config: VisionConfig
                 ) -> list[GridTHW]:
    grids: list[GridTHW] = []
    kh, kw = config.merge_kernel_size
    for n, g in enumerate(grid_thws):
        if len(g) != 3:
            raise ValueError(f"grid_thws[{n}]={tuple(g)} is not a (t, h, w) triple")
        t, h, w = (int(v) for v in g)
        if t != 1:
            raise ValueError(f"grid_thws[{n}]=({t}, {h}, {w}): only still images (t == 1) are "
                             "supported; video grids are not implemented")
        if h < 1 or w < 1 or h % kh or w % kw:
            raise ValueError(f"grid_thws[{n}]=({t}, {h}, {w}): h and w must be positive "
                             f"multiples of merge_kernel_size {config.merge_kernel_size}")
        if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
            raise ValueError(f"grid_thws[{n}]=({t}, {h}, {w}): at most {ROPE_MAX_SIDE} patches "
                             "a side (the 2D RoPE table's bound)")
        grids.append((t, h, w))
    total = sum(t * h * w for t, h, w in grids)
    if total != patches:
        raise ValueError(f"grid_thws cover {total} patches but pixel_values holds {patches}")
    return grids


def rope_2d_table(head_dim: int, h: int, w: int, device: torch.device | None = None
                  ) -> torch.Tensor:
    """complex64 [h*w, head_dim/2]: row-major patch (y, x) -> entry 2i = cis(x * f_i) (column),
    entry 2i+1 = cis(y * f_i) (row), f_i = 10000^(-4i/head_dim), computed in fp32 as both
    sources do (so the angles are the same floats)."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4]
                                  .float() / head_dim))
    flat = torch.arange(h * w, device=device).float()
    x_angles = torch.outer(flat % w, freqs)
    y_angles = torch.outer(torch.div(flat, w, rounding_mode="floor"), freqs)
    x_cis = torch.polar(torch.ones_like(x_angles), x_angles)
    y_cis = torch.polar(torch.ones_like(y_angles), y_angles)
    return torch.stack([x_cis, y_cis], dim=-1).reshape(h * w, head_dim // 2)


def _apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [P, heads, hd] rotated over interleaved pairs in fp32, returned in x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * table.unsqueeze(-2)).flatten(-2).to(x.dtype)


class PatchEmbed(nn.Module):
    """`vision_tower.patch_embed`: proj (Conv2d, one 14x14 patch -> D) + the position table."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        d = config.vt_hidden_size
        self.proj = nn.Conv2d(3, d, kernel_size=config.patch_size, stride=config.patch_size,
                              bias=False)
        self.pos_emb = PositionTable(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        x = self.proj(pixel_values).view(pixel_values.shape[0], -1)
        return x + torch.cat([self.pos_emb(h, w) for _, h, w in grids])


class PositionTable(nn.Module):
    """`patch_embed.pos_emb.weight` [H0, W0, D] ("divided_fixed"), resized to each grid."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.mode = config.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.empty(config.init_pos_emb_height,
                                               config.init_pos_emb_width, config.vt_hidden_size))

    def forward(self, h: int, w: int) -> torch.Tensor:
        """[h*w, D] for a (h, w) grid, row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        # [1, D, H0, W0] -> [1, D, h, w]; align_corners=False and no antialias, as both sources.
        table = self.weight.permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(table, size=(h, w), mode=self.mode, align_corners=False)
        return resized.squeeze(0).permute(1, 2, 0).flatten(0, 1)


class MLP2(nn.Module):
    """`mlp`: fc1(gelu_tanh(fc0(x))), no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


def _equal_runs(bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Consecutive images' row ranges merged where their lengths are equal: (start, end,
    length of each image)."""
    runs: list[tuple[int, int, int]] = []
    for start, end in bounds:
        if runs and runs[-1][2] == end - start:
            runs[-1] = (runs[-1][0], end, end - start)
        else:
            runs.append((start, end, end - start))
    return runs


class EncoderBlock(nn.Module):
    """`encoder.blocks.N`: pre-norm attention (wqkv, wo) and MLP2, both residual."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d, q = config.vt_hidden_size, config.qkv_hidden_size
        self.heads = config.vt_num_attention_heads
        self.head_dim = config.head_dim
        self.norm0 = RMSNorm(d, eps=_ENCODER_NORM_EPS)
        self.norm1 = RMSNorm(d, eps=_ENCODER_NORM_EPS)
        self.wqkv = nn.Linear(d, 3 * q, bias=False)
        self.wo = nn.Linear(q, d, bias=False)
        self.mlp = MLP2(d, config.vt_intermediate_size)

    def attention(self, x: torch.Tensor, rope: torch.Tensor, bounds: Sequence[tuple[int, int]]
                  ) -> torch.Tensor:
        p = x.shape[0]
        # 3-major: the projection's rows are [q heads..., k heads..., v heads...].
        q, k, v = self.wqkv(x).view(p, 3, self.heads, self.head_dim).unbind(1)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        runs = []
        # No attention across images: each run of equal-length images is one batch of SDPA,
        # [images, heads, n, hd], non-causal, scale 1/sqrt(hd) (SDPA's default).
        for start, end, n in _equal_runs(bounds):
            qkv = [t[start:end].view(-1, n, self.heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, v)]
            runs.append(F.scaled_dot_product_attention(*qkv).transpose(1, 2)
                        .reshape(end - start, -1))
        return self.wo(runs[0] if len(runs) == 1 else torch.cat(runs))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, bounds: Sequence[tuple[int, int]]
                ) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), rope, bounds)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    """`vision_tower.encoder`: the blocks and `final_layernorm` (an RMSNorm despite its name)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(config.vt_hidden_size, eps=_ENCODER_NORM_EPS)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, bounds: Sequence[tuple[int, int]]
                ) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, rope, bounds)
        return self.final_layernorm(x)


class MoonViT2(nn.Module):
    """The tower (checkpoint prefix `vision_tower.`): patches -> merged patch groups
    [sum (h/kh)*(w/kw), kh*kw*D], images in the order given."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: Sequence[Sequence[int]]
                ) -> torch.Tensor:
        c = self.config
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, c.patch_size,
                                                                         c.patch_size):
            raise ValueError(f"pixel_values must be [P, 3, {c.patch_size}, {c.patch_size}], "
                             f"got {list(pixel_values.shape)}")
        grids = _check_grids(grid_thws, pixel_values.shape[0], c)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(weight.dtype), grids)
        rope = torch.cat([rope_2d_table(c.head_dim, h, w, x.device) for _, h, w in grids])
        bounds, start = [], 0
        for t, h, w in grids:
            bounds.append((start, start + t * h * w))
            start += t * h * w
        x = self.encoder(x, rope, bounds)
        return torch.cat([self.merge(x[s:e], h, w) for (s, e), (_, h, w) in zip(bounds, grids,
                                                                                 strict=True)])

    def merge(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """sd2_tpool for t == 1: [h*w, D] -> [(h/kh)*(w/kw), kh*kw*D], each group's patches
        concatenated row by row (x(2i,2j), x(2i,2j+1), x(2i+1,2j), x(2i+1,2j+1) for 2x2)."""
        kh, kw = self.config.merge_kernel_size
        d = x.shape[-1]
        groups = x.view(h // kh, kh, w // kw, kw, d).permute(0, 2, 1, 3, 4)
        return groups.reshape((h // kh) * (w // kw), kh * kw * d)


class PatchMergerV2(nn.Module):
    """The projector (checkpoint prefix `mm_projector.`): post_norm(proj.2(GELU(proj.0(x)))),
    the exact (erf) GELU, no biases, no pre-norm; post_norm eps = projector_ln_eps."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        m = config.merged_size
        # A Sequential so the names are the checkpoint's `proj.0` / `proj.2`.
        self.proj = nn.Sequential(nn.Linear(m, m, bias=False), nn.GELU(),
                                  nn.Linear(m, config.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))


class K3Vision(nn.Module):
    """Tower + projector: `forward(pixel_values [P, 3, 14, 14] normalised, grid_thws)` ->
    [sum (h/2)*(w/2), text_hidden_size], image i's features in rows
    [sum_{j<i} n_j, sum_{j<=i} n_j), n_j = merged_tokens(config, grid_thws[j]). The state dict
    uses the checkpoint's names (`vision_tower.*`, `mm_projector.*`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT2(config)
        self.mm_projector = PatchMergerV2(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_tower.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thws: Sequence[Sequence[int]]
                ) -> torch.Tensor:
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))


# --- checkpoints -------------------------------------------------------------------------------


def is_vision_tensor(name: str) -> bool:
    """A checkpoint tensor of the tower or projector (the text loader skips these)."""
    return name.startswith((TOWER_PREFIX, PROJECTOR_PREFIX))


def vision_checkpoint_specs(config: VisionConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint holds for the tower and projector, by name and shape."""
    with torch.device("meta"):
        model = K3Vision(config)
    return {k: TensorSpec(tuple(v.shape)) for k, v in model.state_dict().items()}


def _read_vision_config(folder: Path) -> VisionConfig | None:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(folder, ["no config.json"]) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(folder, [f"config.json is not valid JSON ({exc})"]) from None
    if not isinstance(raw, dict) or raw.get("vision_config") is None:
        return None
    try:
        config = VisionConfig.from_dict(raw["vision_config"])
    except VisionConfigError as exc:
        raise CheckpointError(folder, [f"config.json: {exc}"]) from None
    text = raw.get("text_config")
    text_hidden = text.get("hidden_size") if isinstance(text, dict) else None
    if text_hidden is not None and text_hidden != config.text_hidden_size:
        # SGLang silently takes text_config's; the checkpoint's code would build a projector
        # that does not fit the text model. Neither is a checkpoint to serve.
        raise CheckpointError(folder, [
            f"config.json: vision_config.text_hidden_size={config.text_hidden_size} differs "
            f"from text_config.hidden_size={text_hidden}"])
    return config


def load_k3_vision(folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> K3Vision | None:
    """The tower + projector of a K3 checkpoint folder, or None when its config.json has no
    vision_config. Strict: the `vision_tower.*` / `mm_projector.*` tensors of the folder (read
    through its safetensors index, as the text loader does) must be exactly the model's, each
    of its shape; every missing, unexpected or misshaped one is named in ONE CheckpointError.
    Text-model tensors are not read."""
    folder = Path(folder)
    config = _read_vision_config(folder)
    if config is None:
        return None
    with uninitialised():
        model = K3Vision(config)
    expected = vision_checkpoint_specs(config)
    views = load_tensors(folder, expected, prefixes=(),
                         rename=lambda name: name if is_vision_tensor(name) else None)
    state = {name: views[name].to(device=device, dtype=dtype) for name in expected}
    # Zero-copy views at odd offsets of the mapped file take other CPU kernel paths; copy.
    state = {k: (v.clone() if v.data_ptr() % 64 else v) for k, v in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def k3_vision_tensors(model: K3Vision) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name (what `save_k3_vision` writes)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def save_k3_vision(model: K3Vision, folder: str | os.PathLike[str]) -> Path:
    """Write the tower + projector into a checkpoint folder as `model-vision.safetensors`, list
    its tensors in the folder's `model.safetensors.index.json` (created when absent, covering a
    lone `model.safetensors` too) and set config.json's `vision_config` (config.json created when
    absent). A folder save_k3 wrote then loads with both load_k3 and load_k3_vision. Returns the
    shard's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = k3_vision_tensors(model)
    index_path = folder / INDEX_FILE
    weight_map: dict[str, str] = {}
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    elif (folder / SINGLE_FILE).exists():
        weight_map = dict.fromkeys(read_index(folder / SINGLE_FILE), SINGLE_FILE)
    weight_map = {k: v for k, v in weight_map.items() if v != VISION_SHARD}
    clash = sorted(set(weight_map) & set(tensors))
    if clash:
        raise CheckpointError(folder, [f"tensor {n!r} already stored in {weight_map[n]}"
                                       for n in clash])
    tmp = folder / ".vision-save"
    save_tensors(tmp, tensors)
    shard = folder / VISION_SHARD
    (tmp / SINGLE_FILE).replace(shard)
    tmp.rmdir()
    weight_map.update(dict.fromkeys(tensors, VISION_SHARD))
    total = sum(info.end - info.start for f in set(weight_map.values())
                for info in read_index(folder / f).values())
    index_path.write_text(json.dumps({"metadata": {"total_size": total},
                                      "weight_map": weight_map}, indent=2))
    config_path = folder / "config.json"
    raw = json.loads(config_path.read_text()) if config_path.exists() else {}
    raw["vision_config"] = model.config.to_dict()
    config_path.write_text(json.dumps(raw, indent=2) + "\n")
    return shard
