"""Kimi K3's image path as the planner prices it: the MoonViT-V2 tower + patchmergerv2 projector
(weights, activation peak, FLOPs per image, from `vision_config`) and the image -> tokens rule
(NaViT resize under `media_proc_cfg`'s limits, from preprocessor_config.json).

How SGLang 0.5.23 serves the tower (models/kimi_k3.py, KimiK3ForConditionalGeneration):
- Replicated, not sharded: `use_data_parallel = True`, the tower and projector are plain
  `nn.Linear`/`nn.Conv2d` modules built on every rank (models/kimi_k3_vl.py), so every GPU of
  every pipeline stage holds all of them; they are built even with `language_only`.
- Not quantised: no quant_config reaches them, and K3's checkpoint lists `vision_tower` and
  `mm_projector` in its quantization `ignore`; they load in the checkpoint dtype (BF16).
- Work is split image-wise: run_dp_sharded_mrope_vision_model (multimodal/mm_utils.py) gives
  each attention-TP rank whole images, balanced by patch count (largest first to the least
  loaded rank), then all-gathers the merged features; the projector runs on all of them on
  every rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from capacity.config import Images
from capacity.errors import CapacityError
from capacity.model import Component, MediaLimits, ModelDescriptor, TensorGroup, VisionTower

PACKAGED_MEDIA = "kimi-k3-preprocessor-config.json"


def load_media_limits(folder: Path | None) -> MediaLimits:
    """A checkpoint folder's preprocessor_config.json, else the packaged published K3 values."""
    if folder is not None and (folder / "preprocessor_config.json").is_file():
        path = folder / "preprocessor_config.json"
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CapacityError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        source = str(path)
    else:
        raw = json.loads(resources.files("capacity.data").joinpath(PACKAGED_MEDIA).read_text())
        source = f"packaged:{PACKAGED_MEDIA}"
    cfg = raw.get("media_proc_cfg") if isinstance(raw, dict) else None
    if not isinstance(cfg, dict):
        raise CapacityError(f"{source}: has no media_proc_cfg object")
    return MediaLimits.from_dict(cfg, source)


@dataclass(frozen=True)
class ImageGrid:
    """One image after K3's NaViT resize and pad: its patch grid and its prompt tokens."""

    width: int  # as uploaded
    height: int
    new_width: int  # after the resize, before the pad
    new_height: int
    grid_h: int  # patches, after the pad
    grid_w: int
    tokens: int  # <|media_pad|> positions in the prompt

    @property
    def patches(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height}"


def image_grid(width: int, height: int, media: MediaLimits) -> ImageGrid:
    """K3's navit_resize_image (kimi_k3_vision_processing.py; SGLang's navit_resize_config):
    float scale = min(1, sqrt(limit / (max(1, W//p) x max(1, H//p))), side x p / W, side x p / H),
    sizes truncated with int() (at least 1, at most side x p), then padded up to multiples of
    p x merge; tokens = (H'/(p x merge)) x (W'/(p x merge))."""
    if width <= 0 or height <= 0:
        raise CapacityError(f"an image needs positive width and height, got {width}x{height}")
    p, side = media.patch_size, media.patch_limit_on_one_side
    s1 = math.sqrt(media.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    factor = media.merge_kernel_size * p
    padded_w = -(-new_w // factor) * factor
    padded_h = -(-new_h // factor) * factor
    tokens = media.fixed_output_tokens or (padded_h // factor) * (padded_w // factor)
    return ImageGrid(width, height, new_w, new_h, padded_h // p, padded_w // p, tokens)


@cache
def largest_image(media: MediaLimits) -> ImageGrid:
    """The image with the most patches the preprocessing lets through (the first found of
    equals, narrow side first).

    The patch limit bounds patches before the pad and before int() truncation, so the largest
    padded grid exceeds `in_patch_limit` (K3: 67,320 patches, 16,830 tokens, at 1889x7377; a
    numpy brute force over every W, H <= 9000 agrees, and finds more than the 1861x7041 /
    16,817 tokens vLLM's K3 processor profiles). For given quotients (W // p, H // p) the patch
    limit's scale is fixed, so the largest W and H with them give the most patches. A long side
    pays off past side x p pixels only until the per-side clamp binds instead of the patch
    limit: H // p <= W // p x side^2 / in_patch_limit.
    """
    p, side, limit = media.patch_size, media.patch_limit_on_one_side, media.in_patch_limit
    best, best_patches = (p, p), 0
    for a in range(1, side + 1):
        for b in range(a, max(side, a * side * side // limit + 1) + 1):  # b x a: turned, same
            patches = image_grid(p * a + p - 1, p * b + p - 1, media).patches
            if patches > best_patches:
                best, best_patches = (p * a + p - 1, p * b + p - 1), patches
    return image_grid(*best, media)


def vision_from_config(vc: Mapping[str, Any], source: str) -> VisionTower:
    """The tower and projector of a K3 `vision_config`, with SGLang's module defaults for the
    keys it reads with getattr (biases on unless the config turns them off)."""
    keys = ("patch_size", "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
            "vt_intermediate_size", "init_pos_emb_height", "init_pos_emb_width",
            "merge_kernel_size", "text_hidden_size")
    missing = [k for k in keys if vc.get(k) is None]
    if missing:
        raise CapacityError(f"{source}: vision_config is missing fields: {', '.join(missing)}")
    for key in ("mm_projector_type", "merge_type", "mlp_type"):
        expected = {"mm_projector_type": "patchmergerv2", "merge_type": "sd2_tpool",
                    "mlp_type": "mlp2"}[key]
        if vc.get(key, expected) != expected:
            raise CapacityError(f"{source}: vision_config.{key} {vc[key]!r} unsupported; the "
                                f"planner prices K3's {expected}")
    d = int(vc["vt_hidden_size"])
    heads = int(vc["vt_num_attention_heads"])
    qkv = int(vc.get("qkv_hidden_size") or d)
    inter = int(vc["vt_intermediate_size"])
    layers = int(vc["vt_num_hidden_layers"])
    p = int(vc["patch_size"])
    merge = vc["merge_kernel_size"]
    merge_h, merge_w = (merge, merge) if isinstance(merge, int) else (int(merge[0]), int(merge[1]))
    text = int(vc["text_hidden_size"])
    projector_in = int(vc.get("mm_hidden_size") or d) * merge_h * merge_w
    for name, value in (("vt_hidden_size", d), ("vt_num_attention_heads", heads),
                        ("qkv_hidden_size", qkv), ("vt_intermediate_size", inter),
                        ("vt_num_hidden_layers", layers), ("patch_size", p),
                        ("text_hidden_size", text), ("merge_kernel_size", merge_h * merge_w)):
        if value <= 0:
            raise CapacityError(f"{source}: vision_config.{name} must be positive, got {value}")
    if qkv % heads:
        raise CapacityError(f"{source}: vision_config.qkv_hidden_size ({qkv}) must divide by "
                            f"vt_num_attention_heads ({heads})")
    # LayerNorm has a bias beside its weight; RMSNorm only the weight.
    norm_vectors = 2 if vc.get("norm_type", "layernorm") == "layernorm" else 1
    attn_bias = bool(vc.get("attn_bias", True))
    linear_bias = bool(vc.get("linear_bias", True))
    T, V = Component.VISION_TOWER, Component.MM_PROJECTOR
    b = "vision_tower.encoder.blocks"

    def linear(name: str, rows: int, cols: int, bias: bool, count: int = 1) -> list[TensorGroup]:
        out = [TensorGroup(name, T, rows, cols, count=count, quantizable=False)]
        if bias:
            out.append(TensorGroup(f"{name}.bias", T, rows, count=count, quantizable=False))
        return out

    tower: list[TensorGroup] = [
        *linear("vision_tower.patch_embed.proj", d, 3 * p * p,
                bool(vc.get("patch_embed_proj_bias", True))),
        TensorGroup("vision_tower.patch_embed.pos_emb.weight", T,
                    int(vc["init_pos_emb_height"]) * int(vc["init_pos_emb_width"]), d,
                    quantizable=False),
        TensorGroup(f"{b}.norm0", T, d, count=layers * norm_vectors, quantizable=False),
        TensorGroup(f"{b}.norm1", T, d, count=layers * norm_vectors, quantizable=False),
        *linear(f"{b}.wqkv", 3 * qkv, d, attn_bias, layers),
        *linear(f"{b}.wo", d, qkv, attn_bias, layers),
        *linear(f"{b}.mlp.fc0", inter, d, linear_bias, layers),
        *linear(f"{b}.mlp.fc1", d, inter, linear_bias, layers),
        TensorGroup("vision_tower.encoder.final_layernorm", T, d, count=norm_vectors,
                    quantizable=False),
    ]
    # patchmergerv2: no biases, no pre-norm, an RMSNorm after (KimiK3MultiModalProjector).
    projector = (
        TensorGroup("mm_projector.proj.0", V, projector_in, projector_in, quantizable=False),
        TensorGroup("mm_projector.proj.2", V, text, projector_in, quantizable=False),
        TensorGroup("mm_projector.post_norm", V, text, quantizable=False),
    )
    return VisionTower(
        hidden=d, layers=layers, heads=heads, qkv_hidden=qkv, intermediate=inter, patch_size=p,
        merge_area=merge_h * merge_w, projector_in=projector_in, text_hidden=text,
        tower_groups=tuple(tower), projector_groups=projector,
    )


def request_images(model: ModelDescriptor, images: Images) -> ImageGrid | None:
    """The grid of each of a request's images (all alike), None without images; raises when
    the model has no vision tower to see them."""
    if images.per_request == 0:
        return None
    if model.vision is None or model.media is None:
        raise CapacityError(f"{model.name} has no vision_config: it takes no images "
                            f"(--images-per-request {images.per_request})")
    return image_grid(images.width, images.height, model.media)


def prompt_tokens(model: ModelDescriptor, text_tokens: int, images: Images) -> int:
    """A request's prompt as the text model sees it: its text tokens and every image's
    <|media_pad|> run (the ids K3's processor expands, counted in usage.prompt_tokens)."""
    grid = request_images(model, images)
    return text_tokens + (images.per_request * grid.tokens if grid else 0)


def images_per_rank(images: Images, attention_tp: int) -> int:
    """Images the busiest attention-TP rank encodes for one request: SGLang hands whole images
    to ranks, balanced by patches (all alike here, so ceil(images / ranks))."""
    return -(-images.per_request // max(1, attention_tp))


def activation_peak(model: ModelDescriptor, images: Images, attention_tp: int
                    ) -> tuple[int, int]:
    """(patches, bytes) of the largest tower call one GPU makes: the largest image the
    preprocessing lets through, or the request's images packed on one rank if more."""
    if model.vision is None or model.media is None:
        return 0, 0
    patches = largest_image(model.media).patches
    grid = request_images(model, images)
    if grid is not None:
        patches = max(patches, images_per_rank(images, attention_tp) * grid.patches)
    return patches, model.vision.activation_bytes(patches)
