"""The runtime environment `ray.init` gets: what every node's workers need besides what is
installed there.

On one machine (`ray.address: local`) it is the run file's `ray.runtime_env` alone: the workers
share this machine's files and find a module in the current directory as the driver does
(envs/registry.py `load_object`). On a cluster the workers of other nodes see neither, so it also
ships, as `py_modules`:
  - agentrl's own packages (envs, policy, reward, rl, rollout: the code of this checkout, which
    may differ from the copy installed on the nodes), and
  - the module of each env entry point, "module:function" grader, agent harness and scripted
    expert (`env.entry_point`, `env.grader`, `env.harness`, `env.kwargs.expert`, the same in
    each `env.mix` entry) that lies in the current directory, a
    `name.py` file or a `name/` package found there, not an installed package: that module
    alone, not the whole directory (which may hold runs/ and a .venv);
and `AGENTRL_LOG_LEVEL` (rl/observe/console.py) in `env_vars`. `runtime_env_for` says in one line
what it ships; rl/run/launch.py `start_ray` passes the result to `ray.init`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.config.runfile import EnvConfig, RunConfig
from rl.config.runtime_env import KEYS, is_uri

AGENTRL_PACKAGES = ("envs", "policy", "reward", "rl", "rollout")
LEVEL_ENV = "AGENTRL_LOG_LEVEL"  # rl/observe/console.py


@dataclass(frozen=True)
class Shipped:
    """What `ray.init(runtime_env=...)` gets (`spec`, {}: nothing) and the run-file key behind
    each module shipped automatically (`sources`: path -> key), for the summary line."""

    spec: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: what goes to every node ("" when nothing does)."""
        parts = []
        for key in (k for k in KEYS if k in self.spec):
            value = self.spec[key]
            if key == "py_modules":
                value = ", ".join(_module_text(p, self.sources) for p in value)
            elif isinstance(value, dict):  # env_vars: the names (a value may be a secret)
                value = ", ".join(value)
            elif isinstance(value, list):  # pip, excludes
                value = " ".join(value)
            parts.append(f"{key} {value}")
        return f"ray runtime_env: {'; '.join(parts)}" if parts else ""


def _module_text(path: str, sources: dict[str, str]) -> str:
    if path in sources:
        return f"{path} ({sources[path]})"
    name = Path(path).name
    return name if name in AGENTRL_PACKAGES and path == package_dir(name) else path


def package_dir(name: str) -> str | None:
    """The directory of the importable package `name` (found, not imported)."""
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return str(Path(locations[0]).resolve()) if locations else None


def local_module(module: str, cwd: Path) -> Path | None:
    """The file (`name.py`) or package directory (`name/`) of `module`'s top-level package when
    it lies directly in `cwd`, as envs/registry.py finds it there; None for an installed package
    (one importable from elsewhere comes first, as on the driver) and for agentrl's own."""
    top = module.split(".")[0]
    if top in AGENTRL_PACKAGES:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        where = locations[0] if locations else spec.origin
        if where is None or not os.path.isabs(where):  # built-in, frozen
            return None
        path = Path(where).resolve()
        return path if path.parent == cwd else None
    package, file = cwd / top, cwd / f"{top}.py"
    if (package / "__init__.py").is_file():
        return package
    if file.is_file():
        return file
    return package if package.is_dir() else None


def _envs(cfg: RunConfig) -> list[tuple[str, EnvConfig]]:
    """The env section and each env.mix entry, with its run-file key."""
    return [("env", cfg.env)] + [(f"env.mix[{i}]", e) for i, e in enumerate(cfg.env.mix or [])]


def entry_points(cfg: RunConfig) -> list[tuple[str, str]]:
    """(run-file key, "module:name") of the code the run's envs import from a module: entry
    points, graders given as "module:function", harnesses and experts named in kwargs."""
    found = []
    for prefix, env in _envs(cfg):
        if env.entry_point:
            found.append((f"{prefix}.entry_point", env.entry_point))
        if env.grader and ":" in env.grader:
            found.append((f"{prefix}.grader", env.grader))
        if env.harness:
            found.append((f"{prefix}.harness", env.harness))
        expert = env.kwargs.get("expert")
        if isinstance(expert, str) and ":" in expert:
            found.append((f"{prefix}.kwargs.expert", expert))
    return found


def data_files(cfg: RunConfig) -> list[tuple[str, str]]:
    """(run-file key, absolute path) of the task files the run's envs read (env.dataset): on a
    cluster every node must have them (rl/run/shared_dir.py `check_files_everywhere`)."""
    return [(f"{prefix}.dataset", env.dataset) for prefix, env in _envs(cfg) if env.dataset]


def _local_paths(env: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """The run file's runtime_env with its local paths made absolute (Ray packs them from
    here, whatever directory it is in when it does)."""

    def absolute(value: str) -> str:
        return value if is_uri(value) else str((cwd / Path(value).expanduser()).resolve())

    out = dict(env)
    if isinstance(out.get("working_dir"), str):
        out["working_dir"] = absolute(out["working_dir"])
    if out.get("py_modules"):
        out["py_modules"] = [absolute(p) for p in out["py_modules"]]
    if isinstance(out.get("pip"), str):
        out["pip"] = absolute(out["pip"])
    return out


def runtime_env_for(cfg: RunConfig, cwd: Path | None = None) -> Shipped:
    """The runtime_env for `cfg`'s ray.init: the run file's `ray.runtime_env`, and on a cluster
    agentrl's packages, the env modules in `cwd` (default: the current directory) and the
    console's log level."""
    cwd = (cwd or Path.cwd()).resolve()
    spec = _local_paths(cfg.ray.runtime_env, cwd)
    if cfg.ray.address == "local":
        return Shipped(spec)
    sources: dict[str, str] = {}
    for key, entry_point in entry_points(cfg):
        path = local_module(entry_point.partition(":")[0], cwd)
        if path is not None:
            sources.setdefault(str(path), key)
    ours = [package_dir(name) for name in AGENTRL_PACKAGES]
    modules = [p for p in ours if p] + list(sources) + spec.get("py_modules", [])
    spec["py_modules"] = list(dict.fromkeys(modules))  # in order, once each
    level = {LEVEL_ENV: os.environ[LEVEL_ENV]} if LEVEL_ENV in os.environ else {}
    env_vars = {**level, **spec.get("env_vars", {})}
    if env_vars:
        spec["env_vars"] = env_vars
    return Shipped(spec, sources)
