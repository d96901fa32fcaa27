"""Three ways to register a tool environment, and the scripted-expert lookup that serves all three.

1. A gymnasium id: `gymnasium.register(id="acme/Echo-v0", entry_point="acme.echo:EchoEnv")`.
2. An installed package that declares an `agentrl.envs` entry point; the entry point's name is
   the env id and its value the env class (`acme/Echo-v0 = acme.echo:EchoEnv` in
   `entry_points.txt`, or in pyproject.toml:
   `[project.entry-points."agentrl.envs"] "acme/Echo-v0" = "acme.echo:EchoEnv"`). They are
   registered lazily (nothing is imported) when `envs` is imported.
3. A run file: `env: {id: acme/Echo-v0, entry_point: "acme.echo:EchoEnv", kwargs: {...}}`;
   `ensure_registered` registers it under its id.

The scripted expert of an env is its class attribute `expert` (a class, or a "module:Class"
string), so `make_expert(env_id)` works however the env was registered.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import warnings
from typing import Any

import gymnasium

ENTRY_POINT_GROUP = "agentrl.envs"
BUILTIN_NAMESPACE = "agentrl/"
_ENTRY_POINT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class RegistrationError(ValueError):
    """An env id or entry point that cannot be used (the message says why and what to do);
    `key`: the env kwarg at fault, when one is."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def load_object(entry_point: str) -> Any:
    """Import "package.module:Attr". A module next to the current directory is found too, as
    `python -m` and Ray's local workers would find it."""
    if not _ENTRY_POINT.fullmatch(entry_point):
        raise RegistrationError(
            f"entry point {entry_point!r} must look like 'package.module:Class'"
        )
    module_name, _, attr = entry_point.partition(":")
    try:
        module = _import(module_name)
    except Exception as exc:  # a typo, a missing dependency, or a bug in the module itself
        raise RegistrationError(
            f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RegistrationError(f"{module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = module_name.split(".")[0]
        if exc.name != top or cwd in sys.path or not _in_cwd(top, cwd):
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def check_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    """Import the class registered under `env_id` and bind `kwargs` (over the registered
    defaults) to its constructor, as `gymnasium.make` would, without building the env. Raises
    RegistrationError naming the kwarg at fault (an unknown one, with the closest name)."""
    spec = gymnasium.registry.get(env_id)
    if spec is None:
        raise RegistrationError(unknown_env(env_id))
    target = _target(spec.entry_point)  # a class or a factory function
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    merged = {**(spec.kwargs or {}), **kwargs}
    params = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in merged:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RegistrationError(
                f"{env_id} ({_name(target)}) takes no argument {key!r}; {hint}"
                f"it takes: {', '.join(names) or 'none'}",
                key=key,
            )
    try:
        signature.bind(**merged)
    except TypeError as exc:
        raise RegistrationError(f"{env_id} ({_name(target)}): {exc}") from None


def unknown_env(env_id: str) -> str:
    """Why `env_id` cannot be made, with the closest registered ids (a registry lookup and
    difflib: nothing is imported)."""
    ours = env_ids()
    close = difflib.get_close_matches(env_id, ours, n=1) or difflib.get_close_matches(
        env_id, list(gymnasium.registry), n=1
    )
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"no environment {env_id!r} is registered; {hint}known: {', '.join(ours)}"


def check_build(env_id: str, kwargs: dict[str, Any]) -> None:
    """Build the env once with `kwargs`, as `gymnasium.make` does in a run, and close it; an
    exception (a value its constructor refuses, a resource it cannot get) becomes a
    RegistrationError naming the kwarg its message names, if any."""
    try:
        env = gymnasium.make(env_id, **kwargs)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        key = next((k for k in kwargs if re.search(rf"\b{re.escape(k)}\b", str(exc))), None)
        shown = f" {key}={kwargs[key]!r}" if key is not None else ""
        raise RegistrationError(f"{env_id} refused{shown} when built: {text}", key=key) from None
    with contextlib.suppress(Exception):  # closing is not what is checked
        env.close()


def _target(entry: Any) -> Any:
    return load_object(entry) if isinstance(entry, str) else entry


def _name(target: Any) -> str:
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', target)}"


def _in_cwd(top: str, cwd: str) -> bool:
    return os.path.isfile(os.path.join(cwd, f"{top}.py")) or os.path.isdir(os.path.join(cwd, top))


def ensure_registered(env_id: str, entry_point: str | None = None, **kwargs: Any) -> None:
    """Make `env_id` available to `gymnasium.make`, registering `entry_point` under it if given.

    Raises RegistrationError when the id is unknown and no entry point is given, when the entry
    point cannot be imported or is not a `gymnasium.Env`, or when the id is already taken by a
    different entry point.
    """
    if entry_point is None:
        if env_id not in gymnasium.registry:
            raise RegistrationError(unknown_env(env_id))
        return
    target = load_object(entry_point)
    if not (isinstance(target, type) and issubclass(target, gymnasium.Env)):
        raise RegistrationError(f"{entry_point!r} is {target!r}, not a gymnasium.Env subclass")
    spec = gymnasium.registry.get(env_id)
    if spec is not None:
        if _same_entry(spec.entry_point, entry_point, target):
            return
        raise RegistrationError(
            f"{env_id!r} is already registered with entry point {spec.entry_point!r}; "
            f"pick another id for {entry_point!r}"
        )
    gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs)


def id_for(entry_point: str) -> str:
    """The id an entry point is registered under when none is given: <module>/<Class>-v0."""
    module, _, cls = entry_point.partition(":")
    return f"{module.split('.')[0]}/{cls.split('.')[-1]}-v0"


def register_entry_point(entry_point: str, env_id: str | None = None) -> str:
    """Register "module:EnvClass" under `env_id` (default `id_for(entry_point)`); return the id."""
    env_id = env_id or id_for(entry_point)
    ensure_registered(env_id, entry_point)
    return env_id


def _same_entry(registered: Any, entry_point: str, target: type) -> bool:
    return registered == entry_point or registered is target


def plugin_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The `agentrl.envs` entry points of the installed distributions."""
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)


def register_plugins() -> list[str]:
    """Register every `agentrl.envs` entry point (lazily: nothing is imported). Returns the ids.

    A malformed entry point, or one whose id is taken by a different env, is skipped with a
    warning instead of breaking `import envs`.
    """
    ids = []
    for ep in plugin_entry_points():
        spec = gymnasium.registry.get(ep.name)
        if spec is not None and spec.entry_point != ep.value:
            warnings.warn(
                f"agentrl.envs entry point {ep.name!r} = {ep.value!r} ignored: the id is already "
                f"registered with {spec.entry_point!r}",
                stacklevel=2,
            )
            continue
        if not _ENTRY_POINT.fullmatch(ep.value):
            warnings.warn(
                f"agentrl.envs entry point {ep.name!r} = {ep.value!r} ignored", stacklevel=2
            )
            continue
        try:
            if spec is None:
                gymnasium.register(id=ep.name, entry_point=ep.value)
        except Exception as exc:  # a bad id from some installed package must not break us
            warnings.warn(f"agentrl.envs entry point {ep.name!r} ignored: {exc}", stacklevel=2)
            continue
        ids.append(ep.name)
    return ids


def env_ids() -> list[str]:
    """The tool environments `agentrl envs list` shows: ours plus installed plugins."""
    plugins = {ep.name for ep in plugin_entry_points()}
    return sorted(k for k in gymnasium.registry if k.startswith(BUILTIN_NAMESPACE) or k in plugins)


def env_class(env_id: str) -> type:
    """The class behind a registered id (imports its module)."""
    if env_id not in gymnasium.registry:
        raise RegistrationError(unknown_env(env_id))
    target = _target(gymnasium.registry[env_id].entry_point)
    if not isinstance(target, type):
        raise RegistrationError(f"{env_id!r} is made by {target!r}, not by a class")
    return target


def make_expert(env: Any, **kwargs: Any) -> Any:
    """The scripted expert (`error_rate=..., seed=...`) of a registered env id, or of an env
    instance (its own `expert` attribute first: an env that takes its expert as a kwarg, such
    as envs/harness.py, sets it per instance).

    Raises KeyError when the env declares no `expert`.
    """
    if isinstance(env, str):
        env_id, expert = env, getattr(env_class(env), "expert", None)
    else:
        env_id = env.spec.id if env.spec else type(env.unwrapped).__name__
        expert = getattr(env.unwrapped, "expert", None)
    if expert is None:
        raise KeyError(
            f"{env_id!r} has no scripted expert; set the `expert` class attribute of its env "
            "class (a class taking error_rate= and seed=, or a 'module:Class' string)"
        )
    factory = load_object(expert) if isinstance(expert, str) else expert
    return factory(**kwargs)
