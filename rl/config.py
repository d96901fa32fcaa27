"""The run configuration: a YAML run file maps 1:1 onto this typed tree.

    agentrl train configs/quickstart.yaml trainer.lr=3e-4 rollout.num_workers=2

Every key is documented once, here. Loading fails before Ray or Redis start, naming the key.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rl.schema import ConfigError, apply_override, build


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(name, f"must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value}")


@dataclass(kw_only=True, slots=True)
class RayConfig:
    address: str = "local"
    """"local" starts a private Ray on this machine; "auto" or "ray://host:port" joins a cluster."""
    num_cpus: int | None = None
    """CPUs of the local Ray (default: all of this machine's)."""
    object_store_mb: int = 512
    """Object store size of the local Ray, in MiB."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"local|auto|ray://[\w.\-]+:\d+|[\w.\-]+:\d+", self.address):
            raise ConfigError(
                "address",
                f"must be local, auto, ray://host:port or host:port; got {self.address!r}",
            )
        if self.num_cpus is not None:
            _positive("num_cpus", self.num_cpus)
        _positive("object_store_mb", self.object_store_mb)


@dataclass(kw_only=True, slots=True)
class RedisConfig:
    url: str | None = None
    """redis://[:password@]host:port/db of an existing server; null starts an embedded one."""

    def __post_init__(self) -> None:
        if self.url is not None and not re.match(r"(redis|rediss|unix)://", self.url):
            raise ConfigError(
                "url", f"must start with redis://, rediss:// or unix://; got {self.url!r}"
            )


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    id: str | None = None
    """A gymnasium id of a tool environment (default agentrl/Calculator-v0); with `entry_point`,
    the id to register it under (default <module>/<Class>-v0)."""
    entry_point: str | None = None
    """"package.module:EnvClass" of an env that is not registered yet (a module in the current
    directory works); registered under `id` before the run starts."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to gymnasium.make (they override the registered defaults)."""

    def __post_init__(self) -> None:
        if self.entry_point is not None:
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.entry_point):
                raise ConfigError(
                    "entry_point",
                    f"must look like 'package.module:EnvClass'; got {self.entry_point!r}",
                )
            if self.id is None:
                module, _, cls = self.entry_point.partition(":")
                self.id = f"{module.split('.')[0]}/{cls}-v0"
        if self.id is None:
            self.id = "agentrl/Calculator-v0"


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Weights of the reward terms (reward/): total = sum of weight x term."""

    task_completion: float = 1.0
    """1 when the env's outcome says the task was solved, else 0."""
    env_reward: float = 0.0
    """The env's own Gymnasium step rewards summed over the episode (0: ignored). This section
    alone decides what the learner trains on; an env's native reward counts only through it."""
    invalid_tool_call: float = 0.0
    """Per invalid or unparsable tool call in the episode; a penalty, e.g. -0.1."""
    length: float = 0.0
    """Per 1000 tokens the policy generated in the episode; a penalty, e.g. -0.05."""

    def __post_init__(self) -> None:
        _positive("task_completion", self.task_completion, zero_ok=True)
        _finite("env_reward", self.env_reward)
        for name in ("invalid_tool_call", "length"):
            if getattr(self, name) > 0:
                raise ConfigError(
                    name, f"is a penalty: use a weight <= 0, got {getattr(self, name)}"
                )
        if not any(self.weights().values()):
            raise ConfigError("task_completion", "every reward weight is 0: nothing to learn")

    def weights(self) -> dict[str, float]:
        """The non-zero terms, as `reward.build_reward` takes them."""
        terms = {
            "task_completion": self.task_completion,
            "env_reward": self.env_reward,
            "invalid_tool_call": self.invalid_tool_call,
            "length": self.length,
        }
        return {name: weight for name, weight in terms.items() if weight != 0}


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    path: str | None = None
    """A local directory with a saved causal LM and tokenizer; null builds `model_type` fresh."""
    model_type: str = "qwen3"
    """transformers model type to build when `path` is null."""
    config: dict[str, Any] = field(default_factory=dict)
    """Model config fields (hidden_size, num_hidden_layers, ...) for a fresh model."""
    vocab_size: int = 768
    """Vocabulary of the tokenizer built offline for a fresh model."""
    tokenizer_demonstrations: int = 400
    """Expert episodes rendered as the tokenizer's training text (fresh models only)."""

    def __post_init__(self) -> None:
        _positive("vocab_size", self.vocab_size)
        _positive("tokenizer_demonstrations", self.tokenizer_demonstrations)
        if self.model_type == "agentrl_k3" and self.path is None and "preset" not in self.config:
            raise ConfigError(
                "config.preset",
                "an agentrl_k3 policy needs a preset (k3-debug, "
                "k3-tiny or k3); its other config keys override the preset's fields",
            )


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


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    num_workers: int = 2
    """RolloutWorker actors."""
    cpus_per_worker: float = 0.5
    """Ray CPUs reserved per worker."""
    threads_per_worker: int = 1
    """torch threads in each worker."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48
    """Tokens per assistant turn."""
    max_turns: int = 4
    """Assistant turns per episode."""
    max_seq_len: int = 1024
    """Tokens per trajectory, prompt included; an episode that reaches it ends as truncated. At
    most the policy's max_position_embeddings (checked before anything starts)."""
    cache_budget_mb: float | None = None
    """Decode-cache memory per worker: an episode starts only if every live one can still reach
    max_seq_len within it (null: half the memory available at start, shared by the workers)."""
    record_routing: bool = True
    """MoE policies: record the experts the rollout engine chose for every token (for routing
    replay and the rollout/learner routing-mismatch metric)."""
    max_episodes: int = 64
    """Live episodes per worker (decoded together; async mode admits new groups up to this)."""
    tool_timeout_s: float = 60.0
    """An env step (its tool calls) running longer ends that episode as an env error; the
    other episodes keep decoding meanwhile."""
    token_budget: int | None = None
    """Partial rollouts: tokens a worker generates per iteration (sync: per collect; async: per
    policy version it serves). Unfinished episodes are saved to Redis with their env state and
    continued later, on any worker. null: no budget."""
    max_restarts: int = 3
    """Ray restarts a crashed rollout worker this many times; its tasks are retried."""

    def __post_init__(self) -> None:
        _positive("tool_timeout_s", self.tool_timeout_s)
        _positive("max_episodes", self.max_episodes)
        _positive("max_restarts", self.max_restarts, zero_ok=True)
        if self.token_budget is not None:
            _positive("token_budget", self.token_budget)
        if self.cache_budget_mb is not None:
            _positive("cache_budget_mb", self.cache_budget_mb)
        for name in (
            "num_workers",
            "threads_per_worker",
            "max_new_tokens",
            "max_turns",
            "max_seq_len",
        ):
            _positive(name, getattr(self, name))
        _positive("cpus_per_worker", self.cpus_per_worker, zero_ok=True)
        _positive("temperature", self.temperature)
        _positive("top_k", self.top_k, zero_ok=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens >= self.max_seq_len:
            raise ConfigError("max_new_tokens", f"must be below max_seq_len ({self.max_seq_len})")


Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
"""How per-token losses become one number (rl.losses; TRL's loss types)."""


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    algorithm: Algorithm = "grpo"
    """grpo | dr_grpo | dapo | gspo | cispo (group-relative), or ppo (value head + GAE)."""
    steps: int = 60
    """Optimizer steps (one batch of fresh rollouts each)."""
    group_size: int = 8
    """Samples per task; the GRPO family normalises rewards within a group."""
    batch_size: int = 128
    """Trajectories per step (= tasks per step x group_size)."""
    lr: float = 5e-4
    weight_decay: float = 0.0
    clip_low: float | None = None
    """Lower clip of the importance ratio (null: the algorithm's default, 0.2; gspo 3e-4)."""
    clip_high: float | None = None
    """Upper clip (null: 0.2; dapo 0.28; gspo 4e-4); for cispo the ratio cap (default 5.0)."""
    loss_aggregation: Aggregation | None = None
    """null: the algorithm's default (grpo/gspo seq-mean-token-mean, dr_grpo
    seq-mean-token-sum-norm, dapo/cispo/ppo token-mean)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || frozen initial policy) per token; 0 keeps no reference model."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    """Entropy bonus (subtracted from the loss, times the token-mean entropy)."""
    tis_cap: float | None = None
    """The cap of the per-token importance weight of `off_policy` (tis: needed; decoupled: null
    leaves the weight untruncated). Setting it alone turns on off_policy decoupled."""
    off_policy: Literal["none", "tis", "decoupled"] | None = None
    """Per-token correction for tokens sampled by another policy (older versions, another engine;
    rl/losses.py has the formulas). none: the ratio is taken against the sampling (behaviour)
    logprobs. tis: the same, with every token's importance weight truncated at tis_cap.
    decoupled: a no-grad forward before the update gives the proximal logprobs; the clip acts on
    pi / pi_proximal and each token is weighted by min(pi_proximal / pi_behaviour, tis_cap).
    null: decoupled when tis_cap is set, else none."""
    ppo_epochs: int = 1
    """Passes over each batch (reshuffled every pass); one step() is still one policy version."""
    mini_batch_size: int | None = None
    """Trajectories per optimizer step (must divide batch_size); null: the whole batch. A step()
    takes ppo_epochs x batch_size / mini_batch_size optimizer steps."""
    gamma: float = 1.0
    """PPO: discount between turns."""
    lam: float = 0.95
    """PPO: GAE lambda."""
    routing_replay: bool = False
    """MoE policies: replay the rollout engine's expert choices in the learner's forward (R3);
    the router still gets gradients through the replayed experts' scores."""
    vf_coef: float = 0.1
    """PPO: weight of the value loss (the value head shares the policy trunk)."""
    value_clip: float | None = 0.2
    """PPO: clip of the value prediction around its old value (null: unclipped)."""
    max_grad_norm: float = 1.0
    micro_batch_size: int = 32
    """Trajectories per forward/backward (gradients accumulate to the batch)."""
    segment_tokens: int = 0
    """Long trajectories: when > 0, a micro-batch longer than this runs the policy's forward and
    backward in segments of this many tokens that carry the KDA state and the MLA latents from
    segment to segment, each segment recomputed in the backward (activation checkpointing), so
    memory grows about linearly with the length; same gradient as unsegmented. K3 policies only
    (the learner raises for other models) and one learner rank (world_size 1). 0 = off: one
    forward over the whole micro-batch."""
    autocast: Literal["none", "bf16"] = "none"
    """bf16: the learner's forward (and so its backward) under torch.autocast in bfloat16; the
    weights, gradients and optimizer state stay fp32, and K3's KDA recurrence, attention softmax,
    AttnRes and router scores stay fp32. none: the model's own dtype throughout."""
    cpus: float = 1.0
    """Ray CPUs reserved for each learner rank."""
    world_size: int = 1
    """Learner ranks (Ray actors in one placement group, one torch.distributed group; FSDP2)."""
    expert_parallel: int = 1
    """Ranks that split each MoE layer's routed experts (must divide world_size)."""
    placement_timeout_s: float = 30.0
    """Fail (naming the missing resources) if the learner ranks cannot be placed in time."""
    threads: int = 2
    """torch threads in the learner (async mode: at most trainer.cpus, since the workers
    compute at the same time)."""
    read_timeout_s: float = 300.0
    """Give up (with an error) if the stream yields no group for this long."""
    max_skipped_steps: int = 3
    """Stop the run (with an error naming the steps) after this many learner steps in a row
    whose every optimizer step was skipped for a NaN/Inf loss or gradient (0: never stop)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate a batch, train on it, push, repeat. async: workers never wait for the
    learner; it trains on groups as they arrive, within max_staleness versions."""
    max_staleness: int = 1
    """async: tasks are released to the workers only while
    started groups < (learner version + max_staleness + 1) x tasks per step (admission control:
    generation pauses; nothing is ever discarded for being old or long)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size", "threads", "lr"):
            _positive(name, getattr(self, name))
        for name in ("weight_decay", "kl_coef", "entropy_coef", "vf_coef"):
            _positive(name, getattr(self, name), zero_ok=True)
        _positive("max_grad_norm", self.max_grad_norm)
        _positive("segment_tokens", self.segment_tokens, zero_ok=True)
        if self.segment_tokens and self.world_size > 1:
            raise ConfigError(
                "segment_tokens",
                "is single-rank for now (world_size 1): ranks would run different numbers of "
                "segments, and so of FSDP / expert-parallel collectives",
            )
        if self.autocast not in ("none", "bf16"):
            raise ConfigError("autocast", f"must be none or bf16, got {self.autocast!r}")
        _positive("read_timeout_s", self.read_timeout_s)
        _positive("max_skipped_steps", self.max_skipped_steps, zero_ok=True)
        _positive("world_size", self.world_size)
        _positive("placement_timeout_s", self.placement_timeout_s)
        _positive("max_staleness", self.max_staleness, zero_ok=True)
        if self.expert_parallel < 1 or self.world_size % self.expert_parallel:
            raise ConfigError(
                "expert_parallel",
                f"must divide world_size ({self.world_size}); got {self.expert_parallel}",
            )
        self._check_groups()
        for name in ("clip_low", "clip_high", "tis_cap", "value_clip"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.clip_low is not None and self.clip_low >= 1:
            raise ConfigError("clip_low", f"must be in (0, 1), got {self.clip_low}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError("tis_cap", f"must be >= 1 (it caps a ratio), got {self.tis_cap}")
        self._check_epochs()
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(name, f"must be in [0, 1], got {getattr(self, name)}")

    def _check_groups(self) -> None:
        if self.algorithm != "ppo" and self.group_size < 2:
            raise ConfigError(
                "group_size",
                f"must be >= 2 for {self.algorithm}: rewards are "
                f"normalised within a group (use algorithm: ppo for single samples); "
                f"got {self.group_size}",
            )
        _positive("group_size", self.group_size)
        if self.batch_size % self.group_size:
            raise ConfigError(
                "batch_size",
                f"must be a multiple of group_size ({self.group_size}); got {self.batch_size}",
            )

    def _check_epochs(self) -> None:
        if self.ppo_epochs < 1:
            raise ConfigError(
                "ppo_epochs", f"must be >= 1 (passes over each batch), got {self.ppo_epochs}"
            )
        mini = self.mini_batch_size
        if mini is not None and not (1 <= mini <= self.batch_size and self.batch_size % mini == 0):
            raise ConfigError(
                "mini_batch_size",
                f"must divide batch_size ({self.batch_size}) (trajectories per optimizer step; "
                f"null: the whole batch); got {mini}",
            )
        if self.off_policy is None:
            self.off_policy = "none" if self.tis_cap is None else "decoupled"
        if self.off_policy == "tis" and self.tis_cap is None:
            raise ConfigError("tis_cap", "off_policy tis truncates at tis_cap: set it (e.g. 2.0)")
        if self.off_policy == "none" and self.tis_cap is not None:
            raise ConfigError(
                "tis_cap",
                "has no effect with off_policy none: set off_policy to tis or decoupled, "
                "or drop tis_cap",
            )

    @property
    def tasks_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    enabled: bool = True
    """Warm-start the policy on the env expert's demonstrations (TRL SFTTrainer)."""
    demonstrations: int = 2000
    expert_error_rate: float = 0.3
    """Share of demonstrations in which the expert deliberately goes wrong."""
    epochs: float = 6.0
    lr: float = 2e-3
    batch_size: int = 16

    def __post_init__(self) -> None:
        for name in ("demonstrations", "epochs", "lr", "batch_size"):
            _positive(name, getattr(self, name))
        if not 0 <= self.expert_error_rate <= 1:
            raise ConfigError(
                "expert_error_rate", f"must be in [0, 1], got {self.expert_error_rate}"
            )


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    tasks: int = 200
    """Held-out tasks (seeds disjoint from training)."""
    samples: int = 4
    """Sampled episodes per task at the training temperature."""
    greedy: bool = True
    """Also evaluate with greedy decoding (one episode per task)."""

    def __post_init__(self) -> None:
        _positive("tasks", self.tasks, zero_ok=True)
        _positive("samples", self.samples)


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    tensorboard: bool = True
    collapse_window: int = 5
    """Steps in the rolling mean used to detect a reward collapse."""
    collapse_drop: float = 0.3
    """A fall of the rolling mean success this far below its best is reported as a collapse."""


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    transport: Literal["object_store", "broadcast"] = "object_store"
    """object_store: buckets as Ray objects (shared memory on a node); broadcast: a gloo group."""
    bucket_mb: float = 256.0
    """Size of one bucket of a push. object_store: fewer, bigger buckets cost fewer Ray calls
    (256 MiB measured fastest on 2 cores); broadcast pipelines buckets and does better near 16."""
    push_timeout_s: float = 120.0
    """A push not acknowledged by every worker within this time is an error naming them."""

    def __post_init__(self) -> None:
        _positive("bucket_mb", self.bucket_mb)
        _positive("push_timeout_s", self.push_timeout_s)


@dataclass(kw_only=True, slots=True)
class StageConfig:
    """One stage of a context curriculum (rl/curriculum.py): its steps, and the rollout limits
    and env settings that replace the run's while it lasts."""

    name: str
    steps: int
    """RL steps in this stage; the stages' steps add up to trainer.steps."""
    max_seq_len: int
    """rollout.max_seq_len during the stage."""
    max_turns: int | None = None
    """rollout.max_turns during the stage (null: the run's)."""
    max_new_tokens: int | None = None
    """rollout.max_new_tokens during the stage (null: the run's)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Merged over env.kwargs during the stage (e.g. longer documents, more hops)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ConfigError("name", f"use letters, digits, '.', '_' or '-'; got {self.name!r}")
        _positive("steps", self.steps)
        _positive("max_seq_len", self.max_seq_len)
        for name in ("max_turns", "max_new_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    output_dir: str = "runs"
    """Run directories are created under here: <output_dir>/<name>-<timestamp>/."""
    checkpoint_every: int = 10
    """Write an atomic checkpoint every this many steps and at the end (0: only at the end)."""
    ray: RayConfig = field(default_factory=RayConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    curriculum: list[StageConfig] = field(default_factory=list)
    """A context curriculum: stages run in order, each with its own max_seq_len, turns and env
    settings; a checkpoint at every stage's end (rl/curriculum.py). Empty: no curriculum."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ConfigError("name", f"use letters, digits, '.', '_' or '-'; got {self.name!r}")
        _positive("checkpoint_every", self.checkpoint_every, zero_ok=True)
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
        self._check_curriculum()
        if self.rollout.token_budget is not None and self.trainer.mode != "async":
            raise ConfigError(
                "rollout.token_budget",
                "partial rollouts need trainer.mode: async (a sync step waits for whole groups); "
                "set trainer.mode=async or remove the budget",
            )

    def _check_curriculum(self) -> None:
        if not self.curriculum:
            return
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


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, "overrides look like section.key=value (e.g. trainer.lr=3e-4)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run file (or none: defaults), apply dotted overrides, check everything."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"run file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping of settings at the top level")
    for key, value in parse_overrides(list(overrides)):
        apply_override(data, key, value)
    return build(RunConfig, data)
