"""`env: {dataset: tasks.jsonl, grader: numeric}`: a run file's shorthand for the built-in
agentrl/Dataset-v0 env (envs/dataset.py), checked and expanded before the env section is.

The shorthand becomes `id: agentrl/Dataset-v0` with `kwargs.path` (the file's absolute path, so
every Ray worker finds it whatever its working directory) and `kwargs.grader`; the env's other
options stay in `env.kwargs` (prompt_key, answer_key, heldout_fraction, judge, system, mcp, ...).
The expanded section keeps `dataset` and `grader`, so a run's saved config.yaml loads again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl.config.errors import ConfigError

if TYPE_CHECKING:
    from envs.taskset import TaskSet

DATASET_ENV = "agentrl/Dataset-v0"
HARNESS_ENV = "agentrl/Harness-v0"
TASK_FILE_ENVS = (DATASET_ENV, HARNESS_ENV)
SPLIT_KWARGS = ("prompt_key", "answer_key", "heldout_fraction", "split_seed")
GRADERS = ("exact", "numeric", "judge")
SUFFIXES = (".jsonl", ".parquet")
_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_grader(value: str | None) -> str | None:
    """env.grader: a built-in grader's name or "package.module:function"."""
    if value is not None and value not in GRADERS and not _FUNCTION.fullmatch(value):
        raise ValueError(
            f'must be exact, numeric, judge or "package.module:function"; got {value!r}'
        )
    return value


def expand_shorthand(data: Any) -> Any:
    """`env: {harness: "my_agent:run", dataset: FILE, ...}` -> agentrl/Harness-v0 (envs/harness.py)
    with kwargs.harness; without `harness`, `expand_dataset` onto agentrl/Dataset-v0."""
    if not isinstance(data, dict) or data.get("harness") is None:
        return expand_dataset(data)
    harness = data["harness"]
    if not isinstance(harness, str) or not _FUNCTION.fullmatch(harness):
        raise ConfigError("harness", f'must be "package.module:function", got {harness!r}')
    if data.get("dataset") is None:
        raise ConfigError(
            "dataset", "a harness plays the tasks of a file: set env.dataset (prompt, answer rows)"
        )
    out = expand_dataset(data, HARNESS_ENV)
    kwargs = out["kwargs"]
    if kwargs.get("harness", harness) != harness:
        raise ConfigError(
            "kwargs.harness", f"is {kwargs['harness']!r} but env.harness says {harness!r}"
        )
    return {**out, "kwargs": {**kwargs, "harness": harness}}


def expand_dataset(data: Any, env_id: str = DATASET_ENV) -> Any:
    """The raw env section with `dataset` / `grader` expanded onto `env_id` (see the module
    docstring); ConfigError naming the key for a shorthand that conflicts or a missing file.
    Values of the wrong type are left for the fields' own checks to report."""
    if not isinstance(data, dict):
        return data
    dataset, grader = data.get("dataset"), data.get("grader")
    kwargs = data.get("kwargs") if data.get("kwargs") is not None else {}
    if dataset is None:
        if grader is not None:
            raise ConfigError("grader", "grades a task file's answers: set env.dataset too")
        if data.get("id") == env_id and isinstance(kwargs, dict) and not kwargs.get("path"):
            raise ConfigError("dataset", f"{env_id} needs a task file: env: {{dataset: FILE}}")
        return data
    if not isinstance(dataset, str) or not isinstance(kwargs, dict):
        return data
    if data.get("entry_point") is not None:
        raise ConfigError(
            "entry_point", f"env.dataset trains on {env_id}; remove env.dataset or env.entry_point"
        )
    if data.get("id") not in (None, env_id):
        raise ConfigError(
            "id", f"env.dataset trains on {env_id}, not {data['id']!r}; remove one of the two"
        )
    path = task_file(dataset)
    for key, value, short in (("path", path, "dataset"), ("grader", grader, "grader")):
        if value is not None and key in kwargs and kwargs[key] != value:
            raise ConfigError(
                f"kwargs.{key}", f"is {kwargs[key]!r} but env.{short} says {value!r}; set it once"
            )
    extra = {"path": path} | ({"grader": grader} if grader is not None else {})
    return {**data, "dataset": path, "id": env_id, "kwargs": {**kwargs, **extra}}


def task_file(dataset: str) -> str:
    """The absolute path of env.dataset (relative to the current directory); ConfigError
    naming env.dataset when it is not a .jsonl or .parquet file that exists."""
    path = Path(os.path.abspath(os.path.expanduser(dataset)))
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError("dataset", f"must be a .jsonl or .parquet file, got {dataset!r}")
    if not path.is_file():
        shown = f" (looked for {path})" if str(path) != dataset else ""
        if not Path(os.path.expanduser(dataset)).is_absolute():
            shown = (
                f" (looked for {path}: a relative path is read from the current directory; run "
                "from the directory it is relative to, e.g. the repository root for the run "
                "files in configs/, or give an absolute path)"
            )
        raise ConfigError("dataset", f"no such file {dataset!r}{shown}")
    return str(path)


def task_set(env: Any) -> TaskSet | None:
    """The rows of the task file an env section plays (agentrl/Dataset-v0 or Harness-v0 with
    kwargs.path), split as the env splits them (envs/taskset.py); None for any other env (a
    mixture of envs too)."""
    kwargs = env.kwargs
    if env.id not in TASK_FILE_ENVS or not kwargs.get("path"):
        return None
    from envs.taskset import TaskSet

    return TaskSet.load(kwargs["path"], **{k: kwargs[k] for k in SPLIT_KWARGS if k in kwargs})
