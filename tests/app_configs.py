"""The app configs the Serve tests deploy, built from one base.

Each is a tiny serving pair (tests/tiny_models.py: write_tiny_serving_pair,
write_k3_serving_pair, write_k3_format_pair) on CPU rank slots. A test module names only what
its app changes: `tiny_app(paths, model, **sections)` merges each section over the base, a
dict key by key at every depth, anything else in its place, and DROP removes a key. It
returns the app's args as a deployment YAML holds them, which the test validates
(AppConfig.model_validate) and may change further. Imports nothing heavy: fuzz_oracle (and
bench/fuzz_api.py through it) sets the process up before torch and Ray are imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODEL = "tiny-kimi-dspark"


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP: Any = _Drop()  # a section's value that removes the key from the base

# What every served tiny pair starts from: the engine's KV capacity, and each rank on a
# quarter of a CPU (no GPU).
BASE: dict[str, Any] = {
    "engine": {"reference": {"kv_capacity_tokens": 4096}},
    "placement": {"accelerator": "CPU", "cpus_per_rank": 0.25},
}
# The ingress limits most Serve modules use: short default answers, room for long ones.
INGRESS: dict[str, Any] = {"default_max_tokens": 16, "max_tokens_limit": 512}


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` over a copy of `base`: dicts merge at every depth, other values replace,
    DROP removes the key."""
    out = {k: merged(v, {}) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in overrides.items():
        if value is DROP:
            out.pop(key, None)
        elif isinstance(value, Mapping):
            under = out.get(key)
            out[key] = merged(under if isinstance(under, Mapping) else {}, value)
        else:
            out[key] = value
    return out


def tiny_app(paths: Mapping[str, Path | str | None], model: str | None = MODEL,
             **sections: Any) -> dict[str, Any]:
    """The app's args: `paths`' target (and its draft, when it has one) served as `model`
    (None: the config's default name), each of `sections` (models, engine, parallelism,
    placement, ingress, router, api, disaggregation, ...) merged over BASE."""
    models: dict[str, Any] = {"target": str(paths["target"])}
    if paths.get("draft") is not None:
        models["draft"] = str(paths["draft"])
    if model is not None:
        models["served_model_name"] = model
    return merged({"models": models, **BASE}, sections)


def tiny_k3_app(folder: Path, engine: dict[str, Any], ingress: dict[str, Any],
                router: dict[str, Any], model: str = MODEL) -> Any:
    """The validated config the router Serve tests run: the tiny K3 serving pair (written
    into `folder`), TP 1, two target replicas on CPU rank slots; `engine` is
    engine.reference's fields."""
    from tiny_models import write_k3_serving_pair

    from serve_app.config import AppConfig

    paths = write_k3_serving_pair(folder, tiny=True)
    return AppConfig.model_validate(tiny_app(
        paths, model, engine={"reference": engine}, parallelism={"tp": 1},
        placement={"replicas": 2}, ingress=ingress, router=router))
