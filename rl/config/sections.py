"""The sections of a run file (rl/config/runfile.py has the run file itself and the loader).

Every section is a pydantic model that forbids unknown keys and takes values as written (no
"2" for 2, no 1 for true). Field constraints (`gt`, `ge`, ...) cover single values and show up
in the JSON Schema (`agentrl config schema`); model validators check what depends on several
fields and raise `ConfigError(field, message)`. Constructing a section directly in Python raises
ConfigError as well, never pydantic's ValidationError.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from rl.config.base import Section
from rl.config.errors import ConfigError
from rl.config.mix import EnvKeys, MixEntry, default_id, expand_mix
from rl.config.resources import Resources, ask, check_gpu_ask, fold_cpus
from rl.config.runtime_env import RuntimeEnv


def _plain_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
        raise ValueError(f"use letters, digits, '.', '_' or '-'; got {value!r}")
    return value


Name = Annotated[str, AfterValidator(_plain_name)]
Positive = Annotated[int, Field(gt=0)]
Penalty = Annotated[float, Field(json_schema_extra={"maximum": 0})]
Device = Literal["auto", "cpu", "cuda"]
"""Where a part of the run computes (rl/run/devices.py resolves auto once, on the driver)."""


def _ray_address(value: str) -> str:
    if not re.fullmatch(r"local|auto|ray://[\w.\-]+:\d+|[\w.\-]+:\d+", value):
        raise ValueError(f"must be local, auto, ray://host:port or host:port; got {value!r}")
    return value


class RayConfig(Section):
    """The Ray cluster the run's actors live on."""

    address: Annotated[str, AfterValidator(_ray_address)] = "local"
    """"local" starts a private Ray on this machine; "auto" (on a cluster node, e.g. under `ray
    job submit`) or "ray://host:port" (Ray Client) joins a cluster (docs/cluster.md)."""
    num_cpus: Positive | None = None
    """CPUs of the local Ray (default: all of this machine's)."""
    object_store_mb: int = Field(512, ge=75)
    """Object store size of the local Ray, in MiB."""
    runtime_env: RuntimeEnv = Field(default_factory=dict)
    """Ray's runtime environment for the run's actors, passed to ray.init (local and cluster):
    working_dir, py_modules (local paths or remote URIs, shipped to every node), pip (a list
    of packages or a requirements file), env_vars, excludes; relative paths are relative to the
    current directory. On a cluster agentrl adds to py_modules its own packages and each env
    module in the current directory that the run imports (env.entry_point, a "module:function"
    env.grader, env.harness, env.kwargs.expert, the same in env.mix entries), and says so in
    one line (docs/cluster.md)."""


def _redis_url(value: str | None) -> str | None:
    if value is not None and not re.match(r"(redis|rediss|unix)://", value):
        raise ValueError(f"must start with redis://, rediss:// or unix://; got {value!r}")
    return value


class RedisConfig(Section):
    """The Redis server of the trajectory, task and metrics streams. On a cluster (ray.address
    not local) every node must reach it: the embedded server starts on this (the head) node,
    bound to its address, or `url` names a server with a password and AOF (docs/cluster.md)."""

    url: Annotated[str | None, AfterValidator(_redis_url)] = None
    """redis://[:password@]host:port/db of an existing server (rediss:// for TLS, with
    ?ssl_ca_certs=/path/ca.pem to verify it); null starts an embedded one."""
    bind: str | None = None
    """The IP address of this machine that the embedded server listens on and the run's
    processes connect to (0.0.0.0: listen everywhere, connect by the node IP). null: 127.0.0.1
    when ray.address is local; on a cluster, the IP Ray reports for this node. A non-loopback
    address is listened on besides 127.0.0.1 (for SSH tunnels)."""
    tls_cert_file: str | None = None
    """Embedded server: serve TLS only (rediss://) with this PEM certificate, which must name
    the address the run connects to (bind, or the node IP) in its subjectAltName. Needs
    tls_key_file and tls_ca_cert_file, and a redis-server built with TLS (Debian's is)."""
    tls_key_file: str | None = None
    """The PEM private key of tls_cert_file."""
    tls_ca_cert_file: str | None = None
    """The PEM CA certificate that signed tls_cert_file (for a self-signed certificate, the
    certificate itself): every process that connects verifies the server against it, so on a
    cluster it must exist at this path on every node (a file mount)."""

    @model_validator(mode="after")
    def _embedded_only(self) -> RedisConfig:
        tls = [self.tls_cert_file, self.tls_key_file, self.tls_ca_cert_file]
        if self.url is not None:
            for key, value in (("bind", self.bind), ("tls_cert_file", tls[0])):
                if value is not None:
                    raise ConfigError(
                        key,
                        "configures the embedded server, but url names an existing one; "
                        "remove it (for TLS to an existing server use a rediss:// url)",
                    )
        if any(tls) and not all(tls):
            raise ConfigError(
                "tls_cert_file",
                "TLS needs all three of tls_cert_file, tls_key_file and tls_ca_cert_file",
            )
        return self


class EnvConfig(EnvKeys):
    """The tool environment to train on."""

    mix: list[MixEntry] | None = None
    """Several envs in one run: a list of entries, each with the keys of `env:` (id,
    entry_point, kwargs, dataset, ...) and a `weight` (> 0, default 1.0). Each task comes from
    one entry, with probability weight / the sum of the weights (agentrl/Mix-v0,
    envs/mixture.py); held-out evaluation follows the same weights, SFT demonstrations come
    from each env's expert, and metrics are per env (env/<id>/success_rate, episodes,
    reward_mean). The other keys of `env:` stay unset beside it."""

    @model_validator(mode="after")
    def _complete(self) -> EnvConfig:
        return default_id(expand_mix(self))  # rl/config/mix.py: `mix` -> agentrl/Mix-v0


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


MIN_FRESH_VOCAB = 263
"""256 byte tokens + the 7 special tokens of policy/tokenizer.py (tests check the two agree)."""


class PolicyConfig(Section):
    """The policy: a saved model, or a fresh one built offline."""

    path: str | None = None
    """A local directory with a saved causal LM and tokenizer; null builds `model_type` fresh."""
    model_type: str = "qwen3"
    """transformers model type to build when `path` is null."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Model config fields (hidden_size, num_hidden_layers, ...) for a fresh model."""
    vocab_size: int = Field(768, gt=0)
    """Vocabulary of the tokenizer built offline for a fresh model (at least 263: the 256 bytes
    and 7 special tokens)."""
    tokenizer_demonstrations: int = Field(400, gt=0)
    """Expert episodes rendered as the tokenizer's training text (fresh models only)."""
    copy_warmup_steps: int = Field(0, ge=0)
    """The most steps of copy warm-up for a fresh model, before SFT (policy/warmup.py): random
    token spans repeated, anywhere in the sequence, the loss on the repeat, so the policy learns
    to copy from its context as a pretrained LLM can; it climbs a ladder (spans of 8 from 16
    tokens, 16 from 64, then 32 from the whole vocabulary after up to 128 others), each rung
    until a batch is copied at 90% (0: no warm-up). k3-tiny: 90% on the last rung at step
    ~2,300, ~21 min on 2 cores (docs/benchmarks.md "Copying from anywhere"); 3,000 leaves
    room."""

    @model_validator(mode="after")
    def _fresh_vocab(self) -> PolicyConfig:
        if self.path is None and self.vocab_size < MIN_FRESH_VOCAB:
            raise ConfigError(
                "vocab_size",
                f"a fresh policy's tokenizer holds the 256 bytes and {MIN_FRESH_VOCAB - 256} "
                f"special tokens before any merge: use at least {MIN_FRESH_VOCAB}; got "
                f"{self.vocab_size}",
            )
        return self

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
    """Ray CPUs reserved per worker (the same setting as resources.CPU; write either)."""
    resources: Resources = Field(default_factory=dict)
    """Ray resources each worker asks for besides its CPUs, e.g. {rollout: 1} (a custom
    resource that only some nodes offer puts the workers there); CPU here replaces
    cpus_per_worker. GPU is each cuda worker's share of a GPU (default 1; 0.25 packs four
    workers onto one, each caching in its quarter; a whole fraction, 1/k); refused with
    device: cpu. Checked against the cluster before anything starts."""
    spread: bool = True
    """Place the workers with Ray's SPREAD strategy, over as many nodes as can hold them (a lost
    node takes fewer workers with it); false: Ray's default, which fills the driver's node
    first."""
    threads_per_worker: int = Field(1, gt=0)
    """torch threads in each worker."""
    cpu_priority: Literal["auto", "normal", "idle"] = "auto"
    """async mode, Linux: the scheduling class of a worker's serve thread (its decoding, agent
    loop and tool threads). idle: SCHED_IDLE, so where workers and the learner share CPUs the
    learner (an async run's critical path) never waits for a core and the workers take the
    cycles it leaves; normal: the OS default; auto: idle when the workers decode on the CPU
    (rollout.device resolved to cpu), else normal. Sync mode, where the two never overlap,
    ignores it."""
    device: Device = "auto"
    """Where the workers' engines (and so the evaluations) run. cuda: one GPU per worker (or the
    share rollout.resources.GPU names), asked of Ray; auto: cuda when the GPUs left after the
    learner's hold every worker's share, else cpu. An explicit cuda without enough GPUs is
    refused before anything starts (local Ray)."""
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
    paged_cache: bool = True
    """K3 policy: keep every episode's MLA latents in fixed-size pages (decode reads each
    episode's own pages; an episode reserves its pages, not twice its length). false: one slot
    axis shared by all episodes (the reference path). Float32/float64 rollout models only (the
    fused engine); trainer.exact_logprobs decodes every episode alone and ignores it."""
    record_routing: bool = True
    """MoE policies: record the experts the rollout engine chose for every token (for routing
    replay and the rollout/learner routing-mismatch metric)."""
    max_env_error_rate: float = Field(0.5, gt=0, le=1)
    """Stop the run when more than this fraction of a step's episodes end in an env error (the
    env's reset or step raised, or a tool ran past tool_timeout_s; such episodes are counted in
    rollout/env_errors and never trained on). 1: never stop."""
    max_grader_error_rate: float = Field(0.5, gt=0, le=1)
    """Stop the run when more than this fraction of a step's episodes end in a grader error (a
    reward term raised or returned NaN or inf, e.g. an env's step reward under reward.env_reward;
    counted in rollout/grader_errors, never trained on, each distinct error logged once by the
    workers). 1: never stop."""
    max_episodes: Positive | None = None
    """Live episodes per worker (decoded together; async mode admits new groups up to this).
    null: 64 in sync mode; in async mode room for every group trainer.max_staleness lets start,
    ceil((max_staleness + 1) x batch_size / num_workers) (at least 64): with fewer, the workers
    cannot run ahead as far as the staleness bound allows, and tool latency goes unhidden."""
    tool_timeout_s: float = Field(60.0, gt=0)
    """An env step (its tool calls) running longer ends that episode as an env error; the
    other episodes keep decoding meanwhile."""
    tool_threads: Positive | None = None
    """Env steps (tool calls) a worker runs at once, each on a thread of its tool pool. null: one
    per live episode (rollout.max_episodes), so that no episode's tool call queues behind
    others that wait (on I/O, a sandbox, a slow service). With fewer, a few slow tools hold
    every thread and the whole worker stalls: on the long-tail workload (async, staleness 2) a
    pool of 16 left the learner idle 21% of its steps after the first, one thread per episode 6%
    (docs/benchmarks.md, "Async vs sync")."""
    token_budget: Positive | None = None
    """Partial rollouts (trainer.mode: async only): tokens a worker generates per policy version
    it serves. Unfinished episodes are saved to Redis with their env state and continued later,
    on any worker. null: no budget."""
    max_restarts: int = Field(3, ge=0)
    """Ray restarts a crashed rollout worker this many times (on another node if its node is
    lost); its tasks are retried."""

    @model_validator(mode="after")
    def _turn_fits(self) -> RolloutConfig:
        if self.max_new_tokens >= self.max_seq_len:
            raise ConfigError("max_new_tokens", f"must be below max_seq_len ({self.max_seq_len})")
        fold_cpus(self, "cpus_per_worker")
        check_gpu_ask(self, "rollout")
        return self

    @property
    def ray_resources(self) -> dict[str, float]:
        """What one worker asks Ray for (a GPU on cuda; resolve `auto` first: rl/run/devices.py)."""
        return ask(self.cpus_per_worker, self.resources, self.device)


class SFTVariant(Section):
    """One variant of the env in `sft.kwargs_mix`."""

    share: float = Field(1.0, gt=0)
    """Weight of this variant among the demonstrations (normalised over the mix)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Env kwargs merged over env.kwargs for this variant's demonstrations."""


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
    copy_rehearsal: float = Field(0.0, ge=0, le=4)
    """Copy sequences (the copy warm-up's task, policy/warmup.py) added to the SFT examples, as
    a share of the demonstrations' count, so that SFT keeps the copying that
    `policy.copy_warmup_steps` taught: on LongHorizon demonstrations alone, k3-tiny's copy
    accuracy on random spans fell from 94% to 7% (0.25: 84%; docs/benchmarks.md "12-05
    (later)", where it did not by itself raise held-out success). 0: none."""
    kwargs_mix: list[SFTVariant] = Field(default_factory=list)
    """Variants of the env the demonstrations come from, each `{share, kwargs}` (kwargs merged
    over env.kwargs; the demonstrations split by share): e.g. documents of several lengths, so
    that the policy has seen the task at the lengths its RL stages ask for. A policy trained
    on one length answers there, and at 10x the length reads on without answering
    (docs/benchmarks.md "In-context copying"). Empty: every demonstration from env.kwargs."""


class EvalConfig(Section):
    """Held-out evaluation after SFT and after RL (and every `every` steps between)."""

    tasks: int = Field(200, ge=0)
    """Held-out tasks (seeds disjoint from training)."""
    samples: int = Field(4, gt=0)
    """Sampled episodes per task at the training temperature."""
    greedy: bool = True
    """Also evaluate with greedy decoding (one episode per task)."""
    every: int = Field(0, ge=0)
    """Also evaluate every this many RL steps (trainer.mode: sync), logged at the step under the
    algorithm's label, so the held-out success shows as a curve; 0: only after SFT and after
    RL. Each costs what the final evaluation costs (eval.tasks x eval.samples episodes)."""


class MetricsConfig(Section):
    """Where metrics go besides metrics.jsonl and the Redis metrics stream."""

    tensorboard: bool = True
    """Also write TensorBoard events to <run>/tensorboard."""
    collapse_window: int = Field(5, gt=0)
    """Steps in the rolling mean used to detect a reward collapse."""
    collapse_drop: float = Field(0.3, gt=0, le=1)
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


class StageGate(Section):
    """Held-out success that ends a curriculum stage before its steps run out (rl/run/
    curriculum.py): every `every` steps of the stage, `tasks` held-out tasks (one sample each,
    at the training temperature, at the stage's limits; seeds after the final evaluation's, so
    the gate never sees those, except in a task file with fewer held-out rows than both take).
    At `success` or above the stage ends there (a checkpoint, then the next stage; its remaining
    step numbers are skipped; a gate on the last stage ends the run); below it the stage
    holds."""

    success: float = Field(ge=0, le=1)
    """The share of gate tasks solved that ends the stage (0: the first gate always passes)."""
    every: Positive = 2
    """Steps of the stage between gate evaluations (the first after `every` steps); below the
    stage's steps."""
    tasks: Positive = 8
    """Held-out tasks per gate evaluation (its whole cost: keep it small at long stages)."""


class StageConfig(Section):
    """One stage of a context curriculum (rl/run/curriculum.py): its steps, and the rollout limits
    and env settings that replace the run's while it lasts."""

    name: Name
    """The stage's name (letters, digits, '.', '_', '-'), shown in the console and logs."""
    steps: Positive
    """RL steps in this stage (the most, with a `gate`); the stages' steps add up to
    trainer.steps."""
    max_seq_len: Positive
    """rollout.max_seq_len during the stage."""
    max_turns: Positive | None = None
    """rollout.max_turns during the stage (null: the run's)."""
    max_new_tokens: Positive | None = None
    """rollout.max_new_tokens during the stage (null: the run's)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Merged over env.kwargs during the stage (e.g. longer documents, more hops)."""
    gate: StageGate | None = None
    """End the stage early on held-out success at the stage (`StageGate`); null: the stage runs
    all its steps. `steps` is then the most the stage may take."""


_WORKER = 'use "<worker index>:<groups>" or "any:<groups>" (e.g. "0:2", "any:0")'
_PUSH = 'use "<worker index>:<version>" (e.g. "1:2")'
_SLOW = 'use "<learner step>:<seconds>" (e.g. "4:120")'


def _pair(pattern: str, form: str):
    """A validator of "A:B" strings. YAML 1.1 reads an unquoted 1:2 as the number 62: refused
    with the fix."""

    def check(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"write it quoted (YAML reads 1:2 as a number); {form}")
        if isinstance(value, str) and not re.fullmatch(pattern, value):
            raise ValueError(f"{form}; got {value!r}")
        return value

    return check


class FaultsConfig(Section):
    """Fault injection for agentrl's own chaos and resume tests (tests/chaos, rl/faults.py): each
    fault fires at one fixed point of the run. Refused outside pytest, with a warning banner at
    the start of a run; never written to the run's config.yaml (a `--resume` runs without
    them). Empty: no fault."""

    nan_loss: list[Positive] = Field(default_factory=list)
    """Learner steps (1-based: the version the step produces) whose loss is NaN."""
    reward_raises: Positive | None = None
    """K: the reward raises for every episode of a task whose seed is a multiple of K, and for
    the first episode of every other group."""
    kill_worker: Annotated[str | None, BeforeValidator(_pair(r"(\d+|any)(:\d+)?", _WORKER))] = None
    """`"I:G"`: SIGKILL rollout worker I (its first incarnation, async mode) once it has
    finished G groups (`"I"`: 1) and saved its live episodes to Redis; `"any:G"`: the first
    worker to get there. Quote it (YAML reads 1:2 as a number)."""
    kill_worker_on_push: Annotated[str | None, BeforeValidator(_pair(r"\d+:\d+", _PUSH))] = None
    """`"I:V"`: SIGKILL rollout worker I (its first incarnation) when the weight push of policy
    version V reaches it. Quote it (YAML reads 1:2 as a number)."""
    poison_saved: bool = False
    """With kill_worker: just before the kill, the chosen worker overwrites every saved episode
    of the groups it holds (in Redis) with bytes no decoder reads (rl/faults.py poison_saved), so
    the worker that claims those tasks again cannot restore them: each such episode ends as an
    env error (workers/restore_failures) and its group is still produced."""
    kill_learner_at: Positive | None = None
    """SIGKILL the learner when this step begins (its rollouts are already in the stream)."""
    disk_full_at: Positive | None = None
    """The checkpoint of this step fails with ENOSPC after cutting the learner's tensor file in
    half, as a disk that filled up during the write would."""
    slow_learner: Annotated[str | None, BeforeValidator(_pair(r"\d+:\d+(\.\d+)?", _SLOW))] = None
    """`"S:X"`: learner step S (1-based) takes X s longer after reading its batch, as a step at
    long context does (the async driver's stop then waits for it). Quote it."""
    slow_driver_s: Annotated[float, Field(ge=0)] = 0.0
    """Async mode: the driver's bookkeeping of every step takes this many seconds longer (the
    learner trains the next step meanwhile: learner/between_steps_seconds stays small)."""

    def active(self) -> dict[str, Any]:
        """The faults that are set, by name (empty: fault injection is off)."""
        return {k: v for k, v in self.model_dump().items() if v not in (None, [], False)}


class TestingConfig(Section):
    """Settings for agentrl's own test suite only; a run file for real training has none."""

    __test__ = False  # not a pytest test class

    faults: FaultsConfig = Field(default_factory=FaultsConfig)
