"""`--hf-overrides JSON` (vLLM's flag): checkpoint config values replaced before the model is built.

The override is a JSON object in the checkpoint's own `config.json` vocabulary, merged into the
config whatever the checkpoint's format (for a GGUF, into the config derived from its metadata;
the GGUF's conversion cache keeps the derived config as it was). What it is for is a longer
context on purpose, e.g. YaRN:

    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
     "max_position_embeddings": 32768}

Only keys that change how the weights are used, never their shapes, can be overridden
(`OVERRIDABLE`); any other key, or a value of the wrong kind, is a start-up error naming it. The
overridden config reaches the KV namespace through `engine.kv_tiers.numerics_digest`, and the
override's digest joins the weight fingerprint (`fingerprint`), so pages computed under one
override are never read under another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import Any

from engine.model.config import ModelConfig, RopeConfig, UnsupportedModel, _rope_from_hf

OVERRIDABLE = (
    "rope_scaling",
    "rope_parameters",
    "rope_theta",
    "max_position_embeddings",
    "rms_norm_eps",
    "eos_token_id",
)


class BadOverride(ValueError):
    """An `--hf-overrides` key or value the server cannot apply; `key` names it."""

    def __init__(self, key: str, why: str):
        self.key = key
        super().__init__(f"--hf-overrides: {key}: {why}")


def parse_overrides(text: str | None) -> dict[str, Any]:
    """The flag's JSON object ({} when not given). Raises BadOverride."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadOverride("(json)", f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadOverride("(json)", f"expected a JSON object, got {type(value).__name__}")
    return value


def check_keys(overrides: dict[str, Any]) -> None:
    """Raise BadOverride for the first key that cannot be overridden (before any loading)."""
    for key in overrides:
        if key not in OVERRIDABLE:
            raise BadOverride(
                key,
                f"cannot be overridden (it is unknown or changes the weights' shapes); "
                f"overridable: {', '.join(OVERRIDABLE)}",
            )


def apply_overrides(config: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """`config` with `overrides` merged in (a new config; `config` is unchanged).

    Raises:
        BadOverride: naming the first key that cannot be overridden or whose value is wrong.
    """
    check_keys(overrides)
    changes: dict[str, Any] = {}
    rope = overrides.get("rope_parameters", overrides.get("rope_scaling"))
    if rope is not None or "rope_theta" in overrides:
        key = "rope_parameters" if "rope_parameters" in overrides else "rope_scaling"
        if rope is not None and not isinstance(rope, dict):
            raise BadOverride(key, f"expected an object, got {rope!r}")
        given = dict(rope or {})
        if "type" in given:  # the old name of rope_type
            given["rope_type"] = given.pop("type")
        merged = {**_rope_dict(config.rope), **given}
        if "rope_theta" in overrides:
            merged["rope_theta"] = overrides["rope_theta"]
        try:
            changes["rope"] = _rope_from_hf({"rope_parameters": merged})
        except (UnsupportedModel, TypeError, ValueError) as e:
            raise BadOverride(key, str(e)) from None
    for key, field, kind in (
        ("max_position_embeddings", "max_position_embeddings", int),
        ("rms_norm_eps", "rms_norm_eps", float),
    ):
        if key in overrides:
            value = overrides[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise BadOverride(key, f"expected a positive number, got {value!r}")
            changes[field] = kind(value)
    if "eos_token_id" in overrides:
        eos = overrides["eos_token_id"]
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise BadOverride("eos_token_id", f"expected a token id or a list of them, got {eos!r}")
        changes["eos_token_ids"] = tuple(ids)
    return replace(config, **changes)


def fingerprint(weights: str, overrides: dict[str, Any]) -> str:
    """The weight fingerprint under `overrides`: the weights' own when there are none."""
    if not overrides:
        return weights
    digest = hashlib.blake2b(json.dumps(overrides, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"{weights}+hf{digest}"


def _rope_dict(rope: RopeConfig) -> dict[str, Any]:
    """A RopeConfig in `rope_parameters` vocabulary (what `_rope_from_hf` reads back)."""
    d = asdict(rope)
    d["rope_theta"], d["rope_type"] = d.pop("theta"), d.pop("type")
    return {k: v for k, v in d.items() if v is not None}
