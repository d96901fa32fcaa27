"""The trainer section of a run file (the learner's settings); the other sections are in
rl/config/sections.py, the run file itself in rl/config/runfile.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rl.config.errors import ConfigError
from rl.config.resources import Resources, ask, check_gpu_ask, fold_cpus, gpu_share
from rl.config.sections import Device, Section

Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
"""How per-token losses become one number (rl.learner.losses; TRL's loss types)."""


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
    """Lower clip of the importance ratio (null: the algorithm's default, 0.2; gspo 3e-4; cispo
    has none)."""
    clip_high: Annotated[float, Field(gt=0)] | None = None
    """Upper clip (null: 0.2; dapo 0.28; gspo 4e-4); for cispo the ratio cap itself (default
    5.0; must be > 1)."""
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
    rl/learner/losses.py has the formulas). none: the ratio is taken against the sampling
    (behaviour) logprobs. tis: the same, with every token's importance weight truncated at tis_cap.
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
    the router still gets gradients through the replayed experts' scores. Needs
    rollout.record_routing; a trajectory without records is routed live (moe/replayed_share:
    the share of sampled tokens replayed)."""
    exact_logprobs: bool = False
    """K3 policy on CPU: the rollout engine decodes every episode alone, one token per forward
    (policy/k3/engine/exact.py), and the learner scores each sequence the same way, so the
    rollout's logprobs equal the learner's bit for bit for the tokens of its current version,
    with or without routing replay, sync or async (a push rebuilds live caches)
    (learner/logprob_delta_max 0; the loss takes its values from that pass, its gradient from
    the usual forward). Costs 6.8x in decode and 7.3x in the learner step on k3-tiny
    (docs/benchmarks.md). Refused for other policies, cuda devices, world_size > 1, autocast."""
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
    (the learner raises for other models). On several ranks (FSDP2 + expert parallel) every
    micro-batch is padded to the widest rank's, so that all ranks run the same segments. 0 =
    off: one forward over the whole micro-batch."""
    loss_positions_only: bool = True
    """With segment_tokens, on one learner rank and a K3 policy whose last layer is MLA (every
    preset): a micro-batch longer than segment_tokens without padding runs that last layer's
    attention and MLP at the positions that reach the loss (the sampled tokens) only: every
    position still passes the earlier layers and leaves its latent as a key. The loss and the
    gradients are unchanged (up to rounding in float32; under bf16 autocast the first segment's
    attention takes the absorbed form, which rounds differently); the last layer's O(T^2)
    attention becomes O(U * T) for U loss positions (about 0.4% of a long agentic episode).
    That layer's router is left out of the step's Quantile Balancing statistics and load
    metrics for those micro-batches (its bias holds if every micro-batch took this path). The
    LM head runs inside each segment's checkpoint whenever no value head needs the hidden
    states (not ppo)."""
    shared_prefix: bool = True
    """The rows of a micro-batch that start with the same prompt (a group's samples) run that
    prompt through the policy once (policy/shared_prefix.py): up to the first sampled token of
    any row, then each row's own tokens on the prompt's keys and values (K3: KDA state and MLA
    latents). Same loss and gradients up to rounding; the forward and backward skip
    (group size - 1) / group size of the prompt tokens (`learner/shared_prefix_share`: the
    share of the step's tokens skipped). Micro-batches hold whole groups where they can. Used
    on one learner rank without segments, context ranks, a value head or exact_logprobs. MoE:
    Quantile Balancing sees every row's copy of the prompt, as in the whole forward; with
    routing_replay rows share a prompt only where its recorded experts agree too."""
    autocast: Literal["none", "bf16"] = "none"
    """bf16: the learner's forward (and so its backward) under torch.autocast in bfloat16; the
    weights, gradients and optimizer state stay fp32, and K3's KDA recurrence, attention softmax,
    AttnRes and router scores stay fp32. none: the model's own dtype throughout."""
    cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved for each learner rank (the same setting as resources.CPU)."""
    resources: Resources = Field(default_factory=dict)
    """Ray resources each learner rank asks for besides its CPUs, e.g. {learner: 1}; CPU here
    replaces trainer.cpus, GPU is each cuda rank's share of a GPU (default 1; refused with
    device: cpu). Checked against the cluster before anything starts."""
    device: Device = "auto"
    """Where the learner ranks and the SFT warm start compute. cuda: one GPU per rank (one rank
    may take a share, trainer.resources.GPU), asked of Ray, NCCL between ranks (gloo on cpu),
    and with world_size > 1 FSDP2 computes in bf16 and reduces gradients in fp32; auto: cuda
    when there is a GPU for every rank, else cpu. An explicit cuda without enough GPUs is
    refused before anything starts (local Ray)."""
    world_size: int = Field(1, gt=0)
    """Learner ranks (Ray actors in one placement group, one torch.distributed group; FSDP2)."""
    expert_parallel: int = 1
    """Ranks that split each MoE layer's routed experts (must divide world_size /
    context_parallel and the policy's num_experts; agentrl_k3 policies only: checked before
    anything starts)."""
    context_parallel: int = 1
    """Ranks that split each trajectory along its tokens (K3 policies; must divide world_size):
    the ranks work at the same time, each running its shard layer by layer from the KDA states,
    conv tails and MLA latents the ranks before it relay (policy/k3/context.py), in
    trainer.segment_tokens segments (shards hold whole segments balanced by FLOPs, earlier
    ranks taking more tokens, once a micro-batch has a segment for every rank; shorter ones are
    split by tokens). FSDP2 and expert parallelism act over the world_size / context_parallel
    ranks of one context index (the weights are replicated over the context ranks). Not with
    algorithm ppo (the value head reads every position's hidden state); the routing-mismatch
    metrics are not measured, and a KL reference (kl_coef > 0) runs the whole sequence on every
    context rank. 1 = off."""
    placement_timeout_s: float = Field(30.0, gt=0)
    """Fail, naming what is free, if the learner ranks' placement group is not placed in this
    time (the cluster has the resources, checked at start, but other work holds them)."""
    threads: int = Field(2, gt=0)
    """torch threads in the learner (async mode: at most trainer.cpus, since the workers
    compute at the same time)."""
    read_timeout_s: float = Field(300.0, gt=0)
    """Give up (with an error) if the stream yields no group for this long: a silence timer that
    restarts whenever a group arrives, not a limit on collecting a whole batch."""
    max_skipped_steps: int = Field(3, ge=0)
    """Stop the run (with an error naming the steps) after this many learner steps in a row
    whose every optimizer step was skipped for a NaN/Inf loss or gradient (0: never stop)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate a batch, train on it, push, repeat. async: workers never wait for the
    learner; it trains on groups as they arrive, within max_staleness versions."""
    max_staleness: int = Field(1, ge=0)
    """async: tasks are released to the workers only while
    started groups < (learner version + max_staleness + 1) x tasks per step (admission control:
    generation pauses; nothing is ever discarded for being old or long). Where tool calls take
    seconds, raise it: on a long-tail workload (0.2 s tools, 2 s on a tenth of the tasks, 2 CPUs)
    the learner waited 9-12% of the run at 2 and 5-8% at 3, at the cost of samples one version
    older (docs/benchmarks.md, "Async vs sync")."""

    @property
    def ray_resources(self) -> dict[str, float]:
        """What one learner rank asks Ray for."""
        return ask(self.cpus, self.resources, self.device)

    @model_validator(mode="after")
    def _ranks(self) -> TrainerConfig:
        fold_cpus(self, "cpus")
        check_gpu_ask(self, "trainer")
        if self.world_size > 1 and self.device != "cpu" and gpu_share(self.resources) < 1:
            raise ConfigError(
                "resources.GPU",
                f"is {self.resources['GPU']:g}, but {self.world_size} learner ranks cannot share "
                "a GPU (NCCL needs one GPU per rank): remove it, or set trainer.world_size: 1",
            )
        context = self.context_parallel
        if context < 1 or self.world_size % context:
            raise ConfigError(
                "context_parallel",
                f"must divide world_size ({self.world_size}): each trajectory is split over "
                f"that many of the learner ranks; got {context}",
            )
        data = self.world_size // context
        if self.expert_parallel < 1 or data % self.expert_parallel:
            raise ConfigError(
                "expert_parallel",
                f"must divide world_size / context_parallel ({data}: the ranks of one context "
                f"index); got {self.expert_parallel}",
            )
        if context > 1 and self.algorithm == "ppo":
            raise ConfigError(
                "context_parallel",
                "algorithm ppo's value head reads every position's hidden state, which context "
                "ranks split: use grpo (or another critic-free algorithm), or set it to 1",
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
    def _cispo_clips(self) -> TrainerConfig:
        if self.algorithm != "cispo":
            return self
        if self.clip_high is not None and self.clip_high <= 1:
            raise ConfigError(
                "clip_high",
                f"for cispo it is the importance-weight cap itself (TRL's epsilon_high for "
                f"cispo; default 5.0), not an epsilon added to 1: a cap of {self.clip_high:g} "
                f"scales down every token's gradient. Use a value > 1 (e.g. 5.0), or null",
            )
        if self.clip_low is not None:
            raise ConfigError(
                "clip_low", "cispo has no lower clip (only the cap, clip_high): drop clip_low"
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
