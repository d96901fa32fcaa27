"""Typed config trees from plain dicts: unknown keys, wrong types and bad values fail with the
key path and what would be valid. No third-party dependency, so it runs before anything starts.

Config classes are `@dataclass(kw_only=True, slots=True)`; their `__post_init__` raises
`ConfigError(field, message)` for impossible values and the loader prefixes the path.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(key.strip("."), self.message)


def build(cls: type, data: Any, path: str = "") -> Any:
    """Instantiate dataclass `cls` from a mapping, recursively, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping of {cls.__name__} settings, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(_join(path, str(key)), _unknown(str(key), list(fields)))
    kwargs = {
        name: convert(hints[name], data[name], _join(path, name)) for name in fields if name in data
    }
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.under(path) from None


def convert(hint: Any, value: Any, path: str) -> Any:
    """Check (and lightly coerce) one value against a type hint."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        return _union(args, value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, args))}; got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {_show(value)}")
        item = args[0] if args else Any
        return origin(convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {_show(value)}")
        return {
            str(k): convert(args[1] if args else Any, v, _join(path, str(k)))
            for k, v in value.items()
        }
    return _scalar(hint, value, path)


def _union(args: tuple, value: Any, path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(path, "must be set (null is not allowed here)")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return convert(arg, value, path)
        except ConfigError as exc:
            errors.append(exc.message)
    raise ConfigError(path, " or ".join(errors))


def _scalar(hint: type, value: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(path, f"expected an integer, got {_show(value)}")
    if hint is float:
        return _float(value, path)
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {_show(value)}")
    raise ConfigError(path, f"unsupported setting type {hint}")  # pragma: no cover


def _float(value: Any, path: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(path, f"expected a number, got {_show(value)}")
    if isinstance(value, int | float):
        result = float(value)
    elif isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            result = float(value)
        except ValueError:
            raise ConfigError(path, f"expected a number, got {_show(value)}") from None
    else:
        raise ConfigError(path, f"expected a number, got {_show(value)}")
    if result != result or result in (float("inf"), float("-inf")):
        raise ConfigError(path, f"must be a finite number, got {value!r}")
    return result


def _unknown(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def to_dict(obj: Any) -> Any:
    """A config tree back to plain data (for the resolved config in the run directory)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts (the typed build then checks the key and the value)."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(dotted, "override keys look like section.key=value")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(keys[: i + 1]), "is a value, not a section")
        node = child
    node[keys[-1]] = value
