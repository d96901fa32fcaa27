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


def unknown(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def _plain(value: Any) -> Any:
    """A bound of a float field as written (`> 0`, not `> 0.0`)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
