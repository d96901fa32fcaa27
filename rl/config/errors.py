"""`ConfigError`: a bad run file, named by its dotted key (`trainer.max_staleness`).

The run-file models (rl/config/runfile.py) are pydantic models; `config_error` turns pydantic's
ValidationError into one ConfigError in our words: the key path, what was wrong, and for an
unknown key the closest valid one. Model validators raise `ConfigError(field, message)`
themselves; the key path of the section they check is put in front here.
"""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)


MESSAGES = {
    "int_type": "expected an integer, got {shown}",
    "float_type": "expected a number, got {shown}",
    "bool_type": "expected true or false, got {shown}",
    "string_type": "expected a string, got {shown}",
    "dict_type": "expected a mapping, got {shown}",
    "model_type": "expected a mapping of {class_name} settings, got {shown}",
    "list_type": "expected a list, got {shown}",
    "finite_number": "must be a finite number, got {input}",
    "greater_than": "must be > {gt}, got {input}",
    "greater_than_equal": "must be >= {ge}, got {input}",
    "less_than": "must be < {lt}, got {input}",
    "less_than_equal": "must be <= {le}, got {input}",
    "literal_error": "must be one of {expected}; got {input!r}",
    "missing": "is required (it has no default)",
}


def config_error(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """The first of pydantic's errors as a ConfigError, the others (if any) on lines below."""
    found = [_describe(error, model) for error in exc.errors(include_url=False)]
    key, message = found[0]
    rest = "".join(f"\n{k}: {m}" if k else f"\n{m}" for k, m in found[1:])
    return ConfigError(key, message + rest)


def _describe(error: Any, model: type[BaseModel]) -> tuple[str, str]:
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx", {})
    key = dotted(loc)
    if kind == "value_error":
        cause = ctx.get("error")
        if isinstance(cause, ConfigError):  # a model validator's: its field within the section
            return join(key, cause.key), cause.message
        return key, str(cause)
    if kind == "extra_forbidden":
        return key, unknown(str(loc[-1]), valid_keys(model, loc[:-1]))
    if kind in MESSAGES:
        value, bounds = error.get("input"), {k: _plain(v) for k, v in ctx.items()}
        return key, MESSAGES[kind].format(input=value, shown=show(value), **bounds)
    message = error["msg"]
    return key, message[:1].lower() + message[1:]


def dotted(loc: tuple) -> str:
    """('curriculum', 0, 'steps') -> curriculum[0].steps"""
    key = ""
    for part in loc:
        key = f"{key}[{part}]" if isinstance(part, int) else join(key, str(part))
    return key


def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def valid_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys of the section at `loc` (a path of field names and list indices)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(hint: Any) -> type[BaseModel] | None:
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint
    return next(filter(None, map(_model_in, get_args(hint))), None)


PEER_NAMES = {  # a key users bring from TRL's GRPOConfig/SFTConfig or verl: (ours, their name)
    "learning_rate": ("trainer.lr", "TRL's learning_rate"),
    "num_generations": ("trainer.group_size", "TRL's num_generations"),
    "beta": ("trainer.kl_coef", "TRL's beta"),
    "epsilon": ("trainer.clip_low", "TRL's epsilon"),
    "epsilon_high": ("trainer.clip_high", "TRL's epsilon_high"),
    "loss_type": ("trainer.algorithm", "TRL's loss_type"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL's max_completion_length"),
    "max_steps": ("trainer.steps", "TRL's max_steps"),
    "num_train_epochs": ("sft.epochs", "TRL's num_train_epochs"),
    "model_name_or_path": ("policy.path", "TRL's model_name_or_path"),
    "n": ("trainer.group_size", "verl's rollout.n"),
    "clip_ratio_low": ("trainer.clip_low", "verl's clip_ratio_low"),
    "clip_ratio_high": ("trainer.clip_high", "verl's clip_ratio_high"),
    "kl_loss_coef": ("trainer.kl_coef", "verl's kl_loss_coef"),
    "entropy_coeff": ("trainer.entropy_coef", "verl's entropy_coeff"),
    "ppo_mini_batch_size": ("trainer.mini_batch_size", "verl's ppo_mini_batch_size"),
    "total_training_steps": ("trainer.steps", "verl's total_training_steps"),
    "max_response_length": ("rollout.max_new_tokens", "verl's max_response_length"),
}


def unknown(key: str, valid: list[str]) -> str:
    """The message for an unknown key: a peer's name for one of ours (TRL's learning_rate), else
    the closest valid key, then the valid keys of the section."""
    if key in PEER_NAMES:
        ours, theirs = PEER_NAMES[key]
        leaf = ours.rsplit(".", 1)[-1]
        hint = f"{theirs} is {f'{leaf!r} here' if leaf in valid else f'{ours} in a run file'}; "
    else:
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def _plain(value: Any) -> Any:
    """A bound of a float field as written (`> 0`, not `> 0.0`)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
