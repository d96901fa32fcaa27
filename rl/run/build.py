"""Factories: a run config -> the plain objects (env, policy, renderer, worker, learner).

Actors call these in their own process; the driver calls `prepare_policy` once per run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gymnasium
import torch

import envs  # registers the built-in envs with gymnasium
from policy.engines import rollout_policy
from policy.hf import build_model, load_model, load_tokenizer
from policy.sampling import SamplingParams
from policy.tokenizer import build_tokenizer, render_conversations
from policy.warmup import CopyWarmup, copy_warmup, ordinary_token_ids
from reward import build_reward
from rl import faults
from rl.config.resources import gpu_fraction, gpu_share
from rl.config.runfile import RolloutConfig, RunConfig
from rl.learner.distributed import Shard
from rl.learner.learner import Learner
from rl.run.devices import torch_device
from rl.run.env_checks import check_prompt_room
from rl.run.launch import connect
from rl.sft.warm_start import expert_demonstrations
from rollout.episode import EpisodeLimits
from rollout.keys import LEARNER_GROUP, RunKeys
from rollout.render import ChatRenderer
from rollout.stream import RedisGroupReader, RedisTrajectoryStream
from rollout.worker import RolloutWorker

logger = logging.getLogger(__name__)

ERROR_SAMPLES = [
    "Error: unknown tool 'calc' (available: calculate)",
    "Error: arguments for calculate are not valid JSON (Expecting value)",
    "Error: calculate is missing required argument 'expression'",
    "Error: cannot parse expression '12 +'",
]


def make_env(cfg: RunConfig):
    envs.ensure_registered(cfg.env.id, cfg.env.entry_point)  # a run file's env.entry_point
    return gymnasium.make(cfg.env.id, **cfg.env.kwargs)


def prepare_policy(cfg: RunConfig, run_dir: Path) -> Path:
    """The directory the policy starts from: `policy.path`, or a fresh model + tokenizer."""
    if cfg.policy.path is not None:
        return Path(cfg.policy.path)
    count = cfg.policy.tokenizer_demonstrations
    demos = expert_demonstrations(cfg, count, error_rate=0.5, seed=cfg.seed + 7919)
    corpus = render_conversations((d.messages, d.tools) for d in demos) + ERROR_SAMPLES
    tokenizer = build_tokenizer(corpus, vocab_size=cfg.policy.vocab_size)
    check_prompt_room(cfg, tokenizer)  # its first chance: the tokenizer exists only now
    model = build_model(
        cfg.policy.model_type, cfg.policy.config, vocab_size=len(tokenizer), seed=cfg.seed
    )
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if cfg.policy.copy_warmup_steps:
        warm_up_copying(model, tokenizer, cfg.policy.copy_warmup_steps, seed=cfg.seed)
    out = run_dir / "policy-init"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def warm_up_copying(model, tokenizer, steps: int, *, seed: int) -> dict[str, float]:
    """`copy_warmup` on the tokenizer's ordinary tokens (no special ones), with progress lines;
    warns when the policy still copies less than half the tokens afterwards."""
    ordinary = ordinary_token_ids(tokenizer)
    logger.info(f"copy warm-up: up to {steps} steps on repeated random spans (policy/warmup.py)")
    result = copy_warmup(model, ordinary, CopyWarmup(steps, seed=seed), progress=logger.info)
    logger.info(
        f"copy warm-up done in {result['copy_warmup/steps']} steps, "
        f"{result['copy_warmup/seconds']:.0f} s: copy accuracy "
        f"{result['copy_warmup/accuracy']:.1%} (chance {1 / len(ordinary):.1%})"
    )
    if result["copy_warmup/accuracy"] < 0.5:
        logger.warning(
            "the policy still copies under half the tokens after the copy warm-up: raise "
            "policy.copy_warmup_steps (the skill appears suddenly, after a long plateau)"
        )
    return result


def sampling(cfg: RolloutConfig, renderer: ChatRenderer, *, greedy: bool = False) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=(renderer.eos_token_id,),
    )


def build_worker(
    cfg: RunConfig, model_dir: Path, redis_url: str | None, run_id: str, index: int
) -> RolloutWorker:
    torch.set_num_threads(cfg.rollout.threads_per_worker)
    renderer = ChatRenderer(load_tokenizer(model_dir))
    device = torch_device(cfg.rollout.device)
    fraction = gpu_fraction(cfg.rollout.resources)
    if device.type == "cuda" and fraction < 1:  # workers sharing a GPU keep to their share
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    policy = rollout_policy(
        load_model(model_dir).to(device),  # engines, caches and pushes follow the model
        pad_token_id=renderer.pad_token_id,
        seed=cfg.seed * 1000 + index,
        record_routing=cfg.rollout.record_routing,
        exact=cfg.trainer.exact_logprobs,
        paged=cfg.rollout.paged_cache,
    )
    sink = None
    if redis_url is not None:
        sink = RedisTrajectoryStream(connect(redis_url), RunKeys(run_id).trajectories)
    return RolloutWorker(
        env_factory=lambda: make_env(cfg),
        env_id=cfg.env.id,
        policy=policy,
        renderer=renderer,
        scorer=faults.reward(build_reward(cfg.reward.weights()), cfg.testing.faults),
        sink=sink,
        limits=EpisodeLimits(max_turns=cfg.rollout.max_turns, max_seq_len=cfg.rollout.max_seq_len),
        max_episodes=cfg.rollout.max_episodes,
        tool_timeout_s=cfg.rollout.tool_timeout_s,
        cache_budget=cache_budget(cfg, device),
        tool_threads=cfg.rollout.tool_threads,
    )


def available_memory() -> int:
    """Bytes of memory available on this machine (MemAvailable; free pages if unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_budget(cfg: RunConfig, device: torch.device | None = None) -> int:
    """A worker's decode-cache budget in bytes: rollout.cache_budget_mb, or by default half of
    the memory available when the worker starts: on the CPU shared by the run's workers, on a
    GPU half of the free memory of the worker's own share of it (one GPU, or the fraction
    rollout.resources.GPU names: four workers at 0.25 each take an eighth)."""
    if cfg.rollout.cache_budget_mb is not None:
        return int(cfg.rollout.cache_budget_mb * 2**20)
    if device is not None and device.type == "cuda":
        return gpu_cache_budget(
            torch.cuda.mem_get_info(device)[0], gpu_share(cfg.rollout.resources)
        )
    return available_memory() // 2 // max(1, cfg.rollout.num_workers)


def gpu_cache_budget(free_bytes: int, share: float) -> int:
    """Half of a GPU's free memory times the worker's part of the GPU (rl/config/resources.py
    gpu_fraction: a share of 0 or above 1 counts as the whole GPU)."""
    return int(free_bytes * gpu_fraction({"GPU": share})) // 2


def learner_threads(cfg: RunConfig) -> int:
    """torch threads of a learner rank. In async mode the learner computes while the workers
    do, so it keeps to the CPUs it reserved (more threads than cores make every parallel
    region wait for a preempted thread: measured 2x slower steps on 2 cores)."""
    t = cfg.trainer
    if t.mode == "async":
        return max(1, min(t.threads, int(t.cpus)))
    return t.threads


def build_learner(
    cfg: RunConfig, model_dir: Path, redis_url: str, run_id: str, shard: Shard | None = None
) -> Learner:
    """A learner rank; only rank 0 reads (and acks) the trajectory stream."""
    shard = shard or Shard(device=torch_device(cfg.trainer.device).type)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(learner_threads(cfg))
    tokenizer = load_tokenizer(model_dir)
    reader = None
    if shard.leader:
        reader = RedisGroupReader(
            connect(redis_url),
            RunKeys(run_id).trajectories,
            group=LEARNER_GROUP,
            consumer="learner-0",
            stop_key=RunKeys(run_id).learner_stop,
        )
    return Learner(
        cfg.trainer,
        model=load_model(model_dir).to(torch_device(shard.device)),  # the learner follows it
        source=reader,
        pad_token_id=tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
        shard=shard,
        faults=cfg.testing.faults,
    )
