"""Where a DSpark config.json keeps its draft settings, read once for the planner and the app.

SGLang 0.5.23 accepts them at the top level, in `dflash_config`, or prefixed `dspark_`
(and the mask token also as `dspark_noise_token_id`); a setting given in several places must
agree, since which one wins differs between readers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capacity.errors import CapacityError

DSPARK_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "confidence_head_alpha",
    "projector_type",
    "attention_mode",
    "num_target_layers",
    "target_hidden_size",
)

# SGLang also reads the mask token from `dspark_noise_token_id`.
_ALIASES = {"mask_token_id": ("dspark_noise_token_id",)}


def dspark_settings(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The DSpark settings the config gives (key -> value), wherever each is written.
    Raises CapacityError naming every contradiction."""
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, Mapping):
        raise CapacityError(f"{source}: dflash_config must be an object")
    settings: dict[str, Any] = {}
    conflicts = []
    for key in DSPARK_KEYS:
        found = [(where, value) for where, value in (
            (key, raw.get(key)),
            (f"dflash_config.{key}", nested.get(key)),
            (f"dspark_{key}", raw.get(f"dspark_{key}")),
            *((alias, raw.get(alias)) for alias in _ALIASES.get(key, ())),
        ) if value is not None]
        if not found:
            continue
        if any(v != found[0][1] for _, v in found[1:]):
            conflicts.append(" vs ".join(f"{w}={v!r}" for w, v in found))
        settings[key] = found[0][1]
    if conflicts:
        raise CapacityError(f"{source}: contradictory DSpark settings:\n  - "
                            + "\n  - ".join(conflicts))
    return settings
