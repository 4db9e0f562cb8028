"""What an image becomes before K3's tower sees it (`MediaConfig`, read from the checkpoint) and
what a deployment accepts from clients (`ImagePolicy`, the operator's limits).

`MediaConfig` mirrors `media_proc_cfg` in a checkpoint's `preprocessor_config.json`: the values
are read from the folder, never assumed, so a checkpoint with other limits is served as its own
processor would serve it. Every problem in the file is reported in ONE error that names each key.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork, model_validator

from serve_app.protocol.problems import ProblemsError

PREPROCESSOR_FILE = "preprocessor_config.json"

BackgroundPattern = Literal["white", "black", "gray", "chessboard"]
_PATTERNS = ("white", "black", "gray", "chessboard")
_FILL_STAGES = ("before_resize", "after_resize")


class MediaConfigError(ProblemsError):
    """A preprocessor_config.json that cannot be served; the message lists every bad key."""


@dataclass(frozen=True)
class TransparentBackground:
    """What transparent pixels are blended over (`transparent_bg_config`)."""

    pattern: BackgroundPattern
    square_size: int  # chessboard squares, pixels
    white_on_top_left: bool
    white_value: int
    gray_value: int


@dataclass(frozen=True)
class MediaConfig:
    """K3's image preprocessing, as `preprocessor_config.json`'s `media_proc_cfg` sets it."""

    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int  # patches of the resized image (before padding)
    patch_limit_on_one_side: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    background: TransparentBackground | None  # None: alpha is dropped (converted to RGB)
    fill_after_resize: bool  # transparent_bg_fill_stage == "after_resize"

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> MediaConfig | None:
        """The folder's media config; None when it has no preprocessor_config.json (a text-only
        checkpoint)."""
        path = Path(folder) / PREPROCESSOR_FILE
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MediaConfigError(path, [f"not valid JSON ({exc})"]) from None
        if not isinstance(raw, dict) or not isinstance(raw.get("media_proc_cfg"), dict):
            raise MediaConfigError(path, ["media_proc_cfg: missing or not an object"])
        return cls.from_dict(raw["media_proc_cfg"], where=path)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any],
                  where: str | os.PathLike[str] = "media_proc_cfg") -> MediaConfig:
        problems: list[str] = []

        def positive_int(key: str) -> int:
            value = cfg.get(key)
            if key not in cfg:
                problems.append(f"{key}: missing")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{key}: {value!r} is not a positive integer")
            else:
                return value
            return 1

        def three_floats(key: str, positive: bool) -> tuple[float, float, float]:
            value = cfg.get(key)
            if key not in cfg:
                problems.append(f"{key}: missing")
            elif (not isinstance(value, list) or len(value) != 3
                  or not all(isinstance(v, int | float) and not isinstance(v, bool)
                             and math.isfinite(v) and (v > 0 or not positive) for v in value)):
                kind = "positive " if positive else ""
                problems.append(f"{key}: {value!r} is not a list of three {kind}numbers")
            else:
                return (float(value[0]), float(value[1]), float(value[2]))
            return (1.0, 1.0, 1.0)

        patch = positive_int("patch_size")
        merge = positive_int("merge_kernel_size")
        in_patch_limit = positive_int("in_patch_limit")
        one_side = positive_int("patch_limit_on_one_side")
        if one_side % merge:
            # K3's processor asserts that a padded side stays within the limit; with a limit
            # that is a multiple of the merge kernel, no image can break it.
            problems.append(f"patch_limit_on_one_side: {one_side} is not a multiple of "
                            f"merge_kernel_size {merge}")
        mean = three_floats("image_mean", positive=False)
        std = three_floats("image_std", positive=True)
        if cfg.get("fixed_output_tokens") is not None:
            problems.append(f"fixed_output_tokens: {cfg['fixed_output_tokens']!r} is not "
                            "supported (only null: tokens follow the image's size)")
        stage = cfg.get("transparent_bg_fill_stage", "before_resize")  # K3's processor default
        if stage not in _FILL_STAGES:
            problems.append(f"transparent_bg_fill_stage: {stage!r} is not one of {_FILL_STAGES}")
        background = _background(cfg.get("transparent_bg_config"), problems)
        if problems:
            raise MediaConfigError(where, problems)
        return cls(patch, merge, in_patch_limit, one_side, mean, std, background,
                   stage == "after_resize")


# transparent_bg_config's keys and their defaults when absent: those of K3's processor's
# TransparentBgConfig dataclass, so a partial config means what it means there.
_BACKGROUND_DEFAULTS: dict[str, Any] = {
    "pattern": "black",
    "chessboard_square_size": 16,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 200,
}


def _background(raw: Any, problems: list[str]) -> TransparentBackground | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.append(f"transparent_bg_config: {raw!r} is not an object or null")
        return None
    bad = len(problems)
    unknown = sorted(set(raw) - set(_BACKGROUND_DEFAULTS))
    if unknown:
        problems.append(f"transparent_bg_config: unknown keys {unknown}")
    values = {**_BACKGROUND_DEFAULTS, **raw}
    if values["pattern"] not in _PATTERNS:
        problems.append(f"transparent_bg_config.pattern: {values['pattern']!r} is not one of "
                        f"{_PATTERNS}")
    size = values["chessboard_square_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        problems.append(f"transparent_bg_config.chessboard_square_size: {size!r} is not a "
                        "positive integer")
    if not isinstance(values["chessboard_square_on_top_left"], bool):
        problems.append("transparent_bg_config.chessboard_square_on_top_left: "
                        f"{values['chessboard_square_on_top_left']!r} is not a boolean")
    for key in ("chessboard_white_value", "chessboard_gray_value"):
        v = values[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255:
            problems.append(f"transparent_bg_config.{key}: {v!r} is not an integer in [0, 255]")
    if len(problems) > bad:
        return None
    return TransparentBackground(values["pattern"], size, values["chessboard_square_on_top_left"],
                                 values["chessboard_white_value"],
                                 values["chessboard_gray_value"])


ImageFormat = Literal["PNG", "JPEG", "WEBP", "GIF", "BMP"]


class FetchPolicy(BaseModel):
    """Whether and how the server downloads `http(s)://` image URLs. Off by default: a server
    that fetches URLs for clients can be pointed at its own network (SSRF), so an operator turns
    it on for named hosts only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # Host names fetched from: "example.com" (exactly), "*.example.com" (its subdomains), or "*"
    # (any host). Every address a host resolves to must still be public.
    allow_hosts: tuple[str, ...] = ()
    # Non-public networks fetched from anyway (e.g. "10.1.0.0/16" for an in-cluster image store).
    # Empty: only public addresses.
    allow_networks: tuple[IPvAnyNetwork, ...] = ()
    max_bytes: int = Field(20 * 1024 * 1024, gt=0)
    timeout_s: float = Field(10.0, gt=0)  # for the whole download, redirects included
    max_redirects: int = Field(3, ge=0)

    @model_validator(mode="after")
    def _hosts_named(self) -> FetchPolicy:
        if self.enabled and not self.allow_hosts:
            raise ValueError("fetch.enabled needs fetch.allow_hosts (['*'] for any public host)")
        for host in self.allow_hosts:
            name = host.removeprefix("*.")
            if host != "*" and (not name or "*" in name or "/" in name
                                or (":" in name and not _is_ip(name))):
                raise ValueError(f"fetch.allow_hosts: {host!r} is not a host name, "
                                 "'*.domain' or '*'")
        return self


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


class ImagePolicy(BaseModel):
    """A deployment's limits on the images clients send."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_images_per_request: int = Field(16, ge=0)
    # Encoded bytes of one image (a data URL's decoded payload, or a download); over it: 413.
    max_image_bytes: int = Field(20 * 1024 * 1024, gt=0)
    # Decoded pixels of one image, checked from its header before any pixel is decoded: a small
    # file can declare a 100k x 100k canvas (a decompression bomb). 50 MP takes a 48 MP phone
    # photo; it decodes to at most 200 MB (RGBA).
    max_pixels: int = Field(50_000_000, gt=0)
    formats: tuple[ImageFormat, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    fetch: FetchPolicy = FetchPolicy()
