"""A fresh policy's model config from a run file's `policy.model_type` and `policy.config`,
checked without building the model: `agentrl check` calls it (rl/run/env_checks.py) so that a
wrong model type, a preset on a non-K3 model, an unknown preset, a misspelled field or an
impossible expert count fails before Redis and Ray start; `build_model` (policy/hf.py) builds
from the same config. transformers' configs keep unknown keyword arguments as attributes, so a
typo like `hiden_size` would otherwise be carried along unused."""

from __future__ import annotations

import difflib
from typing import Any


def model_config(model_type: str, config: dict[str, Any], *, vocab_size: int):
    """The PretrainedConfig of a fresh `model_type` model with `config` (for agentrl_k3,
    `config["preset"]` names a K3 preset and the other keys override its fields). Raises
    ValueError naming what is wrong."""
    config = dict(config)
    preset = config.pop("preset", None)
    if model_type == "agentrl_k3":
        from policy.k3 import K3Config, k3_preset

        if preset is None:
            raise ValueError("an agentrl_k3 policy needs config.preset (k3-debug, k3-tiny or k3)")
        _known_fields(K3Config(), config, model_type)
        return k3_preset(preset, vocab_size=vocab_size, **config)  # checks the expert counts
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, [*CONFIG_MAPPING.keys(), "agentrl_k3"], 3)
        raise ValueError(
            f"unknown model type {model_type!r} (transformers' model types, or agentrl_k3)"
            + (f"; closest: {', '.join(close)}" if close else "")
        )
    if preset is not None:
        raise ValueError(
            f"presets exist for agentrl_k3 only, not {model_type!r}: remove config.preset, "
            "or set policy.model_type: agentrl_k3"
        )
    _known_fields(AutoConfig.for_model(model_type), config, model_type)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **config)


def _known_fields(default, config: dict[str, Any], model_type: str) -> None:
    """Refuse keys that are neither fields of `default` (the model type's config) nor their
    aliases, naming the closest field."""
    fields = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    unknown = sorted(set(config) - fields)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{key!r} is not a field of {model_type}'s config{hint}")
