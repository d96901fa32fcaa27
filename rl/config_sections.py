"""The sections of a run file (rl/config.py has the run file itself and the loader).

Every section is a pydantic model that forbids unknown keys and takes values as written (no
"2" for 2, no 1 for true). Field constraints (`gt`, `ge`, ...) cover single values and show up
in the JSON Schema (`agentrl config schema`); model validators check what depends on several
fields and raise `ConfigError(field, message)`. Constructing a section directly in Python raises
ConfigError as well, never pydantic's ValidationError.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from rl.config_errors import ConfigError, config_error


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, type(self)) from None

    # Only a direct call comes through here. A section inside another is validated by pydantic
    # without calling __init__ (a custom __init__ would be called, and would translate errors
    # before their key path is complete); this marker is how pydantic's RootModel says so.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        """A section written with nothing under it (`redis:`) takes its defaults."""
        return {} if data is None else data


def _plain_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
        raise ValueError(f"use letters, digits, '.', '_' or '-'; got {value!r}")
    return value


Name = Annotated[str, AfterValidator(_plain_name)]
Positive = Annotated[int, Field(gt=0)]
Penalty = Annotated[float, Field(json_schema_extra={"maximum": 0})]
Device = Literal["auto", "cpu", "cuda"]
"""Where a part of the run computes (rl/devices.py resolves auto once, on the driver)."""


def _ray_address(value: str) -> str:
    if not re.fullmatch(r"local|auto|ray://[\w.\-]+:\d+|[\w.\-]+:\d+", value):
        raise ValueError(f"must be local, auto, ray://host:port or host:port; got {value!r}")
    return value


class RayConfig(Section):
    """The Ray cluster the run's actors live on."""

    address: Annotated[str, AfterValidator(_ray_address)] = "local"
    """"local" starts a private Ray on this machine; "auto" or "ray://host:port" joins a cluster."""
    num_cpus: Positive | None = None
    """CPUs of the local Ray (default: all of this machine's)."""
    object_store_mb: int = Field(512, gt=0)
    """Object store size of the local Ray, in MiB."""


def _redis_url(value: str | None) -> str | None:
    if value is not None and not re.match(r"(redis|rediss|unix)://", value):
        raise ValueError(f"must start with redis://, rediss:// or unix://; got {value!r}")
    return value


class RedisConfig(Section):
    """The Redis server of the trajectory stream, the task stream and the metrics stream."""

    url: Annotated[str | None, AfterValidator(_redis_url)] = None
    """redis://[:password@]host:port/db of an existing server; null starts an embedded one."""


def _entry_point(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
        raise ValueError(f"must look like 'package.module:EnvClass'; got {value!r}")
    return value


class EnvConfig(Section):
    """The tool environment to train on."""

    id: str | None = None
    """A gymnasium id of a tool environment (default agentrl/Calculator-v0); with `entry_point`,
    the id to register it under (default <module>/<Class>-v0)."""
    entry_point: Annotated[str | None, AfterValidator(_entry_point)] = None
    """"package.module:EnvClass" of an env that is not registered yet (a module in the current
    directory works); registered under `id` before the run starts."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to gymnasium.make (they override the registered defaults)."""

    @model_validator(mode="after")
    def _default_id(self) -> EnvConfig:
        if self.id is None and self.entry_point is not None:
            module, _, cls = self.entry_point.partition(":")
            self.id = f"{module.split('.')[0]}/{cls}-v0"
        if self.id is None:
            self.id = "agentrl/Calculator-v0"
        return self


def _penalty(value: float) -> float:
    if value > 0:
        raise ValueError(f"is a penalty: use a weight <= 0, got {value}")
    return value


class RewardConfig(Section):
    """Weights of the reward terms (reward/): total = sum of weight x term."""

    task_completion: float = Field(1.0, ge=0)
    """1 when the env's outcome says the task was solved, else 0."""
    env_reward: float = 0.0
    """The env's own Gymnasium step rewards summed over the episode (0: ignored). This section
    alone decides what the learner trains on; an env's native reward counts only through it."""
    invalid_tool_call: Annotated[Penalty, AfterValidator(_penalty)] = 0.0
    """Per invalid or unparsable tool call in the episode; a penalty, e.g. -0.1."""
    length: Annotated[Penalty, AfterValidator(_penalty)] = 0.0
    """Per 1000 tokens the policy generated in the episode; a penalty, e.g. -0.05."""

    @model_validator(mode="after")
    def _something_to_learn(self) -> RewardConfig:
        if not self.weights():
            raise ConfigError("task_completion", "every reward weight is 0: nothing to learn")
        return self

    def weights(self) -> dict[str, float]:
        """The non-zero terms, as `reward.build_reward` takes them."""
        terms = {
            "task_completion": self.task_completion,
            "env_reward": self.env_reward,
            "invalid_tool_call": self.invalid_tool_call,
            "length": self.length,
        }
        return {name: weight for name, weight in terms.items() if weight != 0}


class PolicyConfig(Section):
    """The policy: a saved model, or a fresh one built offline."""

    path: str | None = None
    """A local directory with a saved causal LM and tokenizer; null builds `model_type` fresh."""
    model_type: str = "qwen3"
    """transformers model type to build when `path` is null."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Model config fields (hidden_size, num_hidden_layers, ...) for a fresh model."""
    vocab_size: int = Field(768, gt=0)
    """Vocabulary of the tokenizer built offline for a fresh model."""
    tokenizer_demonstrations: int = Field(400, gt=0)
    """Expert episodes rendered as the tokenizer's training text (fresh models only)."""

    @model_validator(mode="after")
    def _k3_preset(self) -> PolicyConfig:
        if self.model_type == "agentrl_k3" and self.path is None and "preset" not in self.config:
            raise ConfigError(
                "config.preset",
                "an agentrl_k3 policy needs a preset (k3-debug, "
                "k3-tiny or k3); its other config keys override the preset's fields",
            )
        return self


class RolloutConfig(Section):
    """Rollout workers: sampling, episode limits, partial rollouts."""

    num_workers: int = Field(2, gt=0)
    """RolloutWorker actors."""
    cpus_per_worker: float = Field(0.5, ge=0)
    """Ray CPUs reserved per worker."""
    threads_per_worker: int = Field(1, gt=0)
    """torch threads in each worker."""
    device: Device = "auto"
    """Where the workers' engines (and so the evaluations) run. cuda: one GPU per worker, asked
    of Ray; auto: cuda when a GPU is left for every worker after the learner's, else cpu. An
    explicit cuda without enough GPUs is refused before anything starts (local Ray)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollouts (and of the sampled evaluation)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens with this much probability (1: off)."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens only (0: off)."""
    max_new_tokens: int = Field(48, gt=0)
    """Tokens per assistant turn."""
    max_turns: int = Field(4, gt=0)
    """Assistant turns per episode."""
    max_seq_len: int = Field(1024, gt=0)
    """Tokens per trajectory, prompt included; an episode that reaches it ends as truncated. At
    most the policy's max_position_embeddings (checked before anything starts)."""
    cache_budget_mb: Annotated[float, Field(gt=0)] | None = None
    """Decode-cache memory per worker: an episode starts only if every live one can still reach
    max_seq_len within it (null: half the memory available at start, shared by the workers)."""
    record_routing: bool = True
    """MoE policies: record the experts the rollout engine chose for every token (for routing
    replay and the rollout/learner routing-mismatch metric)."""
    max_episodes: int = Field(64, gt=0)
    """Live episodes per worker (decoded together; async mode admits new groups up to this)."""
    tool_timeout_s: float = Field(60.0, gt=0)
    """An env step (its tool calls) running longer ends that episode as an env error; the
    other episodes keep decoding meanwhile."""
    token_budget: Positive | None = None
    """Partial rollouts: tokens a worker generates per iteration (sync: per collect; async: per
    policy version it serves). Unfinished episodes are saved to Redis with their env state and
    continued later, on any worker. null: no budget."""
    max_restarts: int = Field(3, ge=0)
    """Ray restarts a crashed rollout worker this many times; its tasks are retried."""

    @model_validator(mode="after")
    def _turn_fits(self) -> RolloutConfig:
        if self.max_new_tokens >= self.max_seq_len:
            raise ConfigError("max_new_tokens", f"must be below max_seq_len ({self.max_seq_len})")
        return self


class SFTConfig(Section):
    """The supervised warm start on the env expert's demonstrations."""

    enabled: bool = True
    """Warm-start the policy on the env expert's demonstrations (TRL SFTTrainer)."""
    demonstrations: int = Field(2000, gt=0)
    """Expert episodes rendered as SFT examples."""
    expert_error_rate: float = Field(0.3, ge=0, le=1)
    """Share of demonstrations in which the expert deliberately goes wrong."""
    epochs: float = Field(6.0, gt=0)
    """Passes over the demonstrations (fractions allowed)."""
    lr: float = Field(2e-3, gt=0)
    """SFT learning rate (AdamW)."""
    batch_size: int = Field(16, gt=0)
    """SFT examples per optimizer step."""


class EvalConfig(Section):
    """Held-out evaluation after SFT and after RL."""

    tasks: int = Field(200, ge=0)
    """Held-out tasks (seeds disjoint from training)."""
    samples: int = Field(4, gt=0)
    """Sampled episodes per task at the training temperature."""
    greedy: bool = True
    """Also evaluate with greedy decoding (one episode per task)."""


class MetricsConfig(Section):
    """Where metrics go besides metrics.jsonl and the Redis metrics stream."""

    tensorboard: bool = True
    """Also write TensorBoard events to <run>/tensorboard."""
    collapse_window: int = 5
    """Steps in the rolling mean used to detect a reward collapse."""
    collapse_drop: float = 0.3
    """A fall of the rolling mean success this far below its best is reported as a collapse."""
    trajectories: int = Field(32, ge=0)
    """Trajectories per step recorded in <run>/trajectories.jsonl for `agentrl show` (whole
    groups, spread over the step's batch); 0: none."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    mlflow: bool = False
    """Also log to MLflow (needs `pip install mlflow`)."""


class WeightsConfig(Section):
    """The weight push from the learner to the rollout workers."""

    transport: Literal["object_store", "broadcast"] = "object_store"
    """object_store: buckets as Ray objects (shared memory on a node); broadcast: a gloo group."""
    bucket_mb: float = Field(256.0, gt=0)
    """Size of one bucket of a push. object_store: fewer, bigger buckets cost fewer Ray calls
    (256 MiB measured fastest on 2 cores); broadcast pipelines buckets and does better near 16."""
    push_timeout_s: float = Field(120.0, gt=0)
    """A push not acknowledged by every worker within this time is an error naming them."""


class CheckpointConfig(Section):
    """Checkpoints of the run (written every `checkpoint_every` steps and at the end)."""

    keep_last: int = Field(3, ge=0)
    """After each checkpoint commits, delete the step directories older than the newest this
    many (0: keep all); never the one `checkpoints/latest` names. Curriculum stage-end
    checkpoints count like any other."""


class StageConfig(Section):
    """One stage of a context curriculum (rl/curriculum.py): its steps, and the rollout limits
    and env settings that replace the run's while it lasts."""

    name: Name
    """The stage's name (letters, digits, '.', '_', '-'), shown in the console and logs."""
    steps: Positive
    """RL steps in this stage; the stages' steps add up to trainer.steps."""
    max_seq_len: Positive
    """rollout.max_seq_len during the stage."""
    max_turns: Positive | None = None
    """rollout.max_turns during the stage (null: the run's)."""
    max_new_tokens: Positive | None = None
    """rollout.max_new_tokens during the stage (null: the run's)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Merged over env.kwargs during the stage (e.g. longer documents, more hops)."""


Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
"""How per-token losses become one number (rl.losses; TRL's loss types)."""


class TrainerConfig(Section):
    """The RL learner: algorithm, batch, optimizer, async and long-context settings."""

    algorithm: Algorithm = "grpo"
    """grpo | dr_grpo | dapo | gspo | cispo (group-relative), or ppo (value head + GAE)."""
    steps: int = Field(60, gt=0)
    """Optimizer steps (one batch of fresh rollouts each)."""
    group_size: int = Field(8, gt=0)
    """Samples per task; the GRPO family normalises rewards within a group."""
    batch_size: int = Field(128, gt=0)
    """Trajectories per step (= tasks per step x group_size)."""
    lr: float = Field(5e-4, gt=0)
    """RL learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    clip_low: Annotated[float, Field(gt=0, lt=1)] | None = None
    """Lower clip of the importance ratio (null: the algorithm's default, 0.2; gspo 3e-4)."""
    clip_high: Annotated[float, Field(gt=0)] | None = None
    """Upper clip (null: 0.2; dapo 0.28; gspo 4e-4); for cispo the ratio cap (default 5.0)."""
    loss_aggregation: Aggregation | None = None
    """null: the algorithm's default (grpo/gspo seq-mean-token-mean, dr_grpo
    seq-mean-token-sum-norm, dapo/cispo/ppo token-mean)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of KL(policy || frozen initial policy) per token; 0 keeps no reference model."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator when kl_coef > 0: k1 (the log ratio) or k3 (Schulman's unbiased,
    non-negative estimator)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (subtracted from the loss, times the token-mean entropy)."""
    tis_cap: Annotated[float, Field(ge=1)] | None = None
    """The cap of the per-token importance weight of `off_policy` (>= 1; tis: needed; decoupled:
    null leaves the weight untruncated). Setting it alone turns on off_policy decoupled."""
    off_policy: Literal["none", "tis", "decoupled"] | None = None
    """Per-token correction for tokens sampled by another policy (older versions, another engine;
    rl/losses.py has the formulas). none: the ratio is taken against the sampling (behaviour)
    logprobs. tis: the same, with every token's importance weight truncated at tis_cap.
    decoupled: a no-grad forward before the update gives the proximal logprobs; the clip acts on
    pi / pi_proximal and each token is weighted by min(pi_proximal / pi_behaviour, tis_cap).
    null: decoupled when tis_cap is set, else none."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch (reshuffled every pass); one step() is still one policy version."""
    mini_batch_size: int | None = None
    """Trajectories per optimizer step (must divide batch_size); null: the whole batch. A step()
    takes ppo_epochs x batch_size / mini_batch_size optimizer steps."""
    gamma: float = Field(1.0, ge=0, le=1)
    """PPO: discount between turns."""
    lam: float = Field(0.95, ge=0, le=1)
    """PPO: GAE lambda."""
    routing_replay: bool = False
    """MoE policies: replay the rollout engine's expert choices in the learner's forward (R3);
    the router still gets gradients through the replayed experts' scores."""
    vf_coef: float = Field(0.1, ge=0)
    """PPO: weight of the value loss (the value head shares the policy trunk)."""
    value_clip: Annotated[float, Field(gt=0)] | None = 0.2
    """PPO: clip of the value prediction around its old value (null: unclipped)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    micro_batch_size: int = Field(32, gt=0)
    """Trajectories per forward/backward (gradients accumulate to the batch)."""
    segment_tokens: int = Field(0, ge=0)
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
    device: Device = "auto"
    """Where the learner ranks and the SFT warm start compute. cuda: one GPU per rank, asked of
    Ray, NCCL between ranks (gloo on cpu), and with world_size > 1 FSDP2 computes in bf16 and
    reduces gradients in fp32; auto: cuda when there is a GPU for every rank, else cpu. An
    explicit cuda without enough GPUs is refused before anything starts (local Ray)."""
    world_size: int = Field(1, gt=0)
    """Learner ranks (Ray actors in one placement group, one torch.distributed group; FSDP2)."""
    expert_parallel: int = 1
    """Ranks that split each MoE layer's routed experts (must divide world_size)."""
    placement_timeout_s: float = Field(30.0, gt=0)
    """Fail (naming the missing resources) if the learner ranks cannot be placed in time."""
    threads: int = Field(2, gt=0)
    """torch threads in the learner (async mode: at most trainer.cpus, since the workers
    compute at the same time)."""
    read_timeout_s: float = Field(300.0, gt=0)
    """Give up (with an error) if the stream yields no group for this long."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate a batch, train on it, push, repeat. async: workers never wait for the
    learner; it trains on groups as they arrive, within max_staleness versions."""
    max_staleness: int = Field(1, ge=0)
    """async: tasks are released to the workers only while
    started groups < (learner version + max_staleness + 1) x tasks per step (admission control:
    generation pauses; nothing is ever discarded for being old or long)."""

    @model_validator(mode="after")
    def _ranks(self) -> TrainerConfig:
        if self.segment_tokens and self.world_size > 1:
            raise ConfigError(
                "segment_tokens",
                "is single-rank for now (world_size 1): ranks would run different numbers of "
                "segments, and so of FSDP / expert-parallel collectives",
            )
        if self.expert_parallel < 1 or self.world_size % self.expert_parallel:
            raise ConfigError(
                "expert_parallel",
                f"must divide world_size ({self.world_size}); got {self.expert_parallel}",
            )
        return self

    @model_validator(mode="after")
    def _groups(self) -> TrainerConfig:
        if self.algorithm != "ppo" and self.group_size < 2:
            raise ConfigError(
                "group_size",
                f"must be >= 2 for {self.algorithm}: rewards are "
                f"normalised within a group (use algorithm: ppo for single samples); "
                f"got {self.group_size}",
            )
        if self.batch_size % self.group_size:
            raise ConfigError(
                "batch_size",
                f"must be a multiple of group_size ({self.group_size}); got {self.batch_size}",
            )
        mini = self.mini_batch_size
        if mini is not None and not (1 <= mini <= self.batch_size and self.batch_size % mini == 0):
            raise ConfigError(
                "mini_batch_size",
                f"must divide batch_size ({self.batch_size}) (trajectories per optimizer step; "
                f"null: the whole batch); got {mini}",
            )
        return self

    @model_validator(mode="after")
    def _off_policy(self) -> TrainerConfig:
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
        return self

    @property
    def tasks_per_step(self) -> int:
        return self.batch_size // self.group_size
