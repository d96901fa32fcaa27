"""The run configuration: a YAML run file maps 1:1 onto this typed tree.

    agentrl train configs/quickstart.yaml trainer.lr=3e-4 rollout.num_workers=2

Every key is documented once, in rl/config/sections.py and here (as pydantic models; `agentrl
config schema` prints their JSON Schema for editors). Loading fails before Ray or Redis start,
with a ConfigError naming the key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from rl.config.cluster import cluster_output_error, cluster_redis_error
from rl.config.errors import ConfigError, config_error
from rl.config.sections import (
    CheckpointConfig,
    EnvConfig,
    EvalConfig,
    FaultsConfig,
    MetricsConfig,
    Name,
    PolicyConfig,
    RayConfig,
    RedisConfig,
    RewardConfig,
    RolloutConfig,
    Section,
    SFTConfig,
    StageConfig,
    TestingConfig,
    WeightsConfig,
)
from rl.config.trainer import Aggregation, Algorithm, TrainerConfig

__all__ = [
    "Aggregation",
    "Algorithm",
    "CheckpointConfig",
    "ConfigError",
    "EnvConfig",
    "EvalConfig",
    "FaultsConfig",
    "MetricsConfig",
    "PolicyConfig",
    "RayConfig",
    "RedisConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "StageConfig",
    "TestingConfig",
    "TrainerConfig",
    "WeightsConfig",
    "build_config",
    "load_config",
    "parse_overrides",
    "policy_max_positions",
    "read_text",
    "read_yaml",
    "run_file_data",
    "run_file_schema",
]


def policy_max_positions(policy: PolicyConfig) -> int | None:
    """The longest context the policy takes (its max_position_embeddings), or None when it is
    not known before the model loads (a `policy.path` without a config.json)."""
    if "max_position_embeddings" in policy.config:
        return int(policy.config["max_position_embeddings"])
    if policy.path is not None:
        file = Path(policy.path) / "config.json"
        if not file.is_file():
            return None
        value = json.loads(file.read_text()).get("max_position_embeddings")
        return None if value is None else int(value)
    if policy.model_type == "agentrl_k3":
        from policy.k3 import k3_preset

        try:
            return k3_preset(policy.config["preset"]).max_position_embeddings
        except (KeyError, ValueError):
            return None  # an unknown preset: building the policy names it
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(policy.model_type, **policy.config)
    except (ValueError, TypeError):
        return None  # an unknown model type: building it reports that
    return getattr(config, "max_position_embeddings", None)


class RunConfig(Section):
    """An agentrl run file (agentrl train RUN_FILE): every section is optional."""

    name: Name = "run"
    """The run's name: run directories are <output_dir>/<name>-<timestamp>."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds task draws, sampling and model initialisation (0 to 2^32 - 1, as numpy takes)."""
    output_dir: str = "runs"
    """Run directories are created under here: <output_dir>/<name>-<timestamp>/."""
    checkpoint_every: int = Field(10, ge=0)
    """Write an atomic checkpoint every this many steps and at the end (0: only at the end)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    curriculum: list[StageConfig] = Field(default_factory=list)
    """A context curriculum: stages run in order, each with its own max_seq_len, turns and env
    settings; a checkpoint at every stage's end (rl/run/curriculum.py). Empty: no curriculum."""
    testing: TestingConfig = Field(default_factory=TestingConfig)

    @model_validator(mode="after")
    def _faults_only_under_pytest(self) -> RunConfig:
        faults = self.testing.faults
        if faults.active() and "PYTEST_CURRENT_TEST" not in os.environ:  # pytest's own marker
            raise ConfigError(
                "testing.faults",
                "fault injection is for agentrl's own test suite (pytest); remove the testing "
                f"section from the run file (set: {', '.join(faults.active())})",
            )
        for key in ("kill_worker", "kill_worker_on_push"):
            index = (getattr(faults, key) or "any").partition(":")[0]
            if index != "any" and int(index) >= self.rollout.num_workers:
                raise ConfigError(
                    f"testing.faults.{key}",
                    f"names worker {index}, but rollout.num_workers is {self.rollout.num_workers}",
                )
        if faults.poison_saved and not faults.kill_worker:
            raise ConfigError(
                "testing.faults.poison_saved",
                "poisons the saved episodes of the worker that testing.faults.kill_worker kills: "
                "set kill_worker too",
            )
        return self

    @model_validator(mode="after")
    def _lengths_fit_the_policy(self) -> RunConfig:
        limit = policy_max_positions(self.policy)
        lengths = [("rollout.max_seq_len", self.rollout.max_seq_len)]
        lengths += [
            (f"curriculum[{i}].max_seq_len", s.max_seq_len) for i, s in enumerate(self.curriculum)
        ]
        for key, length in lengths:
            if limit is not None and length > limit:
                raise ConfigError(
                    key,
                    f"{length} tokens is more than the policy takes (max_position_embeddings "
                    f"{limit}); lower it, or raise policy.config.max_position_embeddings for a "
                    "fresh model",
                )
        return self

    @model_validator(mode="after")
    def _curriculum(self) -> RunConfig:
        if not self.curriculum:
            return self
        if self.trainer.mode != "sync":
            raise ConfigError("curriculum", "a curriculum runs in trainer.mode: sync for now")
        total = sum(stage.steps for stage in self.curriculum)
        if total != self.trainer.steps:
            raise ConfigError(
                "trainer.steps",
                f"is {self.trainer.steps}, but the curriculum's stages add up to {total} steps; "
                f"set trainer.steps: {total}",
            )
        for i, stage in enumerate(self.curriculum):
            new = stage.max_new_tokens or self.rollout.max_new_tokens
            if new >= stage.max_seq_len:
                raise ConfigError(
                    f"curriculum[{i}].max_seq_len", f"must be above max_new_tokens ({new})"
                )
            if stage.gate is not None and stage.gate.every >= stage.steps:
                raise ConfigError(
                    f"curriculum[{i}].gate.every",
                    f"must be below the stage's steps ({stage.steps}): the stage's last step ends "
                    "it anyway, so this gate would never run",
                )
            if stage.env_kwargs and self.env.mix is not None:
                raise ConfigError(
                    f"curriculum[{i}].env_kwargs",
                    "cannot change the envs of an env.mix (not supported yet); remove it, and "
                    "set each env's kwargs under env.mix",
                )
        if self.sft.kwargs_mix and self.env.mix is not None:
            raise ConfigError(
                "sft.kwargs_mix",
                "cannot change the envs of an env.mix; set each env's kwargs under env.mix",
            )
        return self

    @model_validator(mode="after")
    def _redis_reachable_on_a_cluster(self) -> RunConfig:
        for error in (
            cluster_redis_error(self.ray.address, self.redis),
            cluster_output_error(self.ray.address, self.output_dir),
        ):
            if error is not None:
                raise error
        return self

    @model_validator(mode="after")
    def _replay_needs_records(self) -> RunConfig:
        if self.trainer.routing_replay and not self.rollout.record_routing:
            raise ConfigError(
                "trainer.routing_replay",
                "replays the experts the rollout engine recorded, but rollout.record_routing is "
                "false (nothing would be replayed); set rollout.record_routing: true, or "
                "trainer.routing_replay: false",
            )
        return self

    @model_validator(mode="after")
    def _exact_needs_one_cpu_k3_learner(self) -> RunConfig:
        t = self.trainer
        if not t.exact_logprobs:
            return self
        why = None
        if self.policy.path is None and self.policy.model_type != "agentrl_k3":
            kind = self.policy.model_type
            why = f"needs the K3 policy (policy.model_type: agentrl_k3, not {kind})"
        elif "cuda" in (t.device, self.rollout.device):
            why = "is a CPU mode (trainer.device and rollout.device: cpu or auto)"
        elif t.world_size != 1 or t.autocast != "none":
            why = "needs one learner rank (trainer.world_size: 1) and trainer.autocast: none"
        if why is not None:
            raise ConfigError("trainer.exact_logprobs", f"{why}; or set it to false")
        return self

    @model_validator(mode="after")
    def _context_needs_k3(self) -> RunConfig:
        kind = self.policy.model_type
        if self.trainer.context_parallel > 1 and self.policy.path is None and kind != "agentrl_k3":
            raise ConfigError(
                "trainer.context_parallel",
                f"context parallelism relays K3's KDA state and MLA latents between ranks; "
                f"policy.model_type {kind} has none: use agentrl_k3 or set it to 1",
            )
        if self.trainer.segment_tokens and self.policy.path is None and kind != "agentrl_k3":
            raise ConfigError(
                "trainer.segment_tokens",
                f"segmented training carries K3's KDA state and MLA latents from segment to "
                f"segment; policy.model_type {kind} has none: use agentrl_k3 or set it to 0",
            )
        return self

    @model_validator(mode="after")
    def _live_episodes(self) -> RunConfig:
        """rollout.max_episodes null -> its mode's default (see its docstring); tool_threads
        null -> max_episodes."""
        if self.rollout.max_episodes is None:
            live = 64
            if self.trainer.mode == "async":
                ahead = (self.trainer.max_staleness + 1) * self.trainer.batch_size
                live = max(live, -(-ahead // self.rollout.num_workers))
            self.rollout.max_episodes = live
        if self.rollout.tool_threads is None:
            self.rollout.tool_threads = self.rollout.max_episodes
        return self

    @model_validator(mode="after")
    def _budget_needs_async(self) -> RunConfig:
        if self.rollout.token_budget is not None and self.trainer.mode != "async":
            raise ConfigError(
                "rollout.token_budget",
                "partial rollouts need trainer.mode: async (a sync step waits for whole groups); "
                "set trainer.mode=async or remove the budget",
            )
        return self

    @model_validator(mode="after")
    def _periodic_evals_need_sync(self) -> RunConfig:
        if self.eval.every and self.trainer.mode != "sync":
            raise ConfigError(
                "eval.every",
                "evaluations during training run in trainer.mode: sync for now (async workers "
                "are busy serving); set eval.every=0 (evaluate after SFT and after RL only) or "
                "trainer.mode=sync",
            )
        if self.eval.every and self.eval.tasks == 0:
            raise ConfigError("eval.every", "needs eval.tasks > 0; set eval.tasks or eval.every=0")
        return self


def run_file_schema() -> dict[str, Any]:
    """The JSON Schema of a run file, for editors (`agentrl config schema`)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema"} | (
        RunConfig.model_json_schema()
    )


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 3e-4 (no dot) as a string; run files mean the number (as YAML 1.2 does)."""


_Loader.add_implicit_resolver(  # on _Loader's own copy of the resolvers, not SafeLoader's
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "overrides look like section.key=value (e.g. trainer.lr=3e-4)")
        try:
            value = yaml.load(raw, Loader=_Loader) if raw else ""  # _Loader is a SafeLoader
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts (the typed build then checks the key and the value)."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(dotted, "override keys look like section.key=value")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if child is None:  # a section written with nothing under it
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(keys[: i + 1]), "is a value, not a section")
        node = child
    node[keys[-1]] = value


def read_text(path: str | Path, what: str = "run file") -> str:
    """The text of a UTF-8 file, or a ConfigError saying what is wrong with it and what to do."""
    path = Path(path)
    if path.is_dir():
        hint = (
            f"; its run file is {path / 'config.yaml'} (to continue the run: agentrl train "
            f"--resume {path})"
            if (path / "config.yaml").is_file()
            else ""
        )
        raise ConfigError("", f"{what} {str(path)!r} is a directory, not a YAML file{hint}")
    if not path.is_file():
        raise ConfigError("", f"{what} {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        data = path.read_bytes()[: exc.start]
        line, column = data.count(b"\n") + 1, exc.start - (data.rfind(b"\n") + 1) + 1
        raise ConfigError(
            "",
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at line {line}, "
            f"column {column}); save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    except OSError as exc:
        raise ConfigError("", f"cannot read {what} {str(path)!r}: {exc.strerror}") from None


def read_yaml(path: str | Path, what: str = "run file") -> Any:
    """A YAML file's data (read_text's errors, and a syntax error on one line with its place)."""
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        problem = _yaml_place(getattr(exc, "problem", None), getattr(exc, "problem_mark", None))
        context = _yaml_place(getattr(exc, "context", None), getattr(exc, "context_mark", None))
        what = problem or str(exc).splitlines()[0]
        if context:
            what = f"{what} ({context})" if problem else context
        raise ConfigError("", f"{path} is not valid YAML: {what}; fix the syntax there") from None


def _yaml_place(text: str | None, mark: Any) -> str:
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{text}{where}" if text else ""


def run_file_data(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """A run file's settings (none: {}) with the dotted overrides applied, not yet checked."""
    data: Any = {}
    if path is not None:
        data = read_yaml(path)
        if data is None:
            raise ConfigError(
                "",
                f"run file {str(path)!r} is empty; write the settings of your run in it "
                "(configs/template.yaml is a start)",
            )
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping of settings at the top level")
    for key, value in parse_overrides(list(overrides)):
        apply_override(data, key, value)
    return data


def build_config(data: dict) -> RunConfig:
    """Check settings (run_file_data's) into a RunConfig; a ConfigError names the key at fault."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, RunConfig) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run file (or none: defaults), apply dotted overrides, check everything."""
    return build_config(run_file_data(path, overrides))
