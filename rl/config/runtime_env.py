"""`ray.runtime_env`: the part of Ray's runtime environment a run file may set, checked lightly
when the run file loads (the keys, their types, and that local paths exist) so that a typo fails
at `agentrl check`, naming `ray.runtime_env.<key>`, not when Ray packs and ships it.

What the run adds on a cluster (agentrl's packages, a local env module) and the call to
`ray.init` are in rl/run/runtime_env.py and rl/run/launch.py.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import AfterValidator

from rl.config.errors import ConfigError, unknown

KEYS = ("working_dir", "py_modules", "pip", "env_vars", "excludes")
"""The runtime_env keys of Ray a run file may set."""


def is_uri(value: str) -> bool:
    """A remote package (gs://, s3://, https://...zip): Ray fetches it on each node."""
    return "://" in value


def _strings(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"expected a list of strings, got {value!r}")
    return value


def _working_dir(value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError("working_dir", f"expected a path or a URI, got {value!r}")
    path = Path(value).expanduser()
    if is_uri(value) or path.is_dir() or (path.is_file() and path.suffix == ".zip"):
        return
    raise ConfigError(
        "working_dir",
        f"{value!r} is not a directory or a .zip file (relative paths are relative to the "
        f"current directory, {Path.cwd()}); give one that exists, or a remote URI (gs://...)",
    )


def _py_modules(value: Any) -> None:
    for i, item in enumerate(_strings("py_modules", value)):
        path = Path(item).expanduser()
        if is_uri(item) or path.is_dir() or (path.is_file() and path.suffix in (".py", ".whl")):
            continue
        raise ConfigError(
            f"py_modules[{i}]",
            f"{item!r} is not a package directory, a .py file or a .whl (relative paths are "
            f"relative to the current directory, {Path.cwd()}); give one that exists, or a "
            "remote URI",
        )


def _pip(value: Any) -> None:
    if isinstance(value, str):
        if not Path(value).expanduser().is_file():
            raise ConfigError(
                "pip", f"{value!r} is not a requirements file; give one, or a list of packages"
            )
        return
    _strings("pip", value)


def _env_vars(value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError("env_vars", f"expected a mapping of names to strings, got {value!r}")
    for name, text in value.items():
        if not isinstance(text, str):
            raise ConfigError(
                f"env_vars.{name}", f"expected a string, got {text!r} (quote it in YAML)"
            )


CHECKS = MappingProxyType(
    {
        "working_dir": _working_dir,
        "py_modules": _py_modules,
        "pip": _pip,
        "env_vars": _env_vars,
        "excludes": lambda value: _strings("excludes", value),
    }
)


def _runtime_env(value: dict[str, Any]) -> dict[str, Any]:
    for key, item in value.items():
        if key not in CHECKS:
            raise ConfigError(key, unknown(key, list(KEYS)))
        CHECKS[key](item)
    return value


RuntimeEnv = Annotated[dict[str, Any], AfterValidator(_runtime_env)]
"""A run file's `ray.runtime_env`: a subset of Ray's runtime_env (KEYS), paths checked."""
