"""A context curriculum: the run file's `curriculum:` stages run in order, each with its own
max_seq_len, turns, tokens per turn and env settings, e.g. the seed's 8K -> 64K -> 256K -> 1M
(configs/long_context.yaml):

    curriculum:
      - {name: 8k, steps: 40, max_seq_len: 8192, env_kwargs: {doc_tokens: 1000}}
      - {name: 64k, steps: 20, max_seq_len: 65536, env_kwargs: {doc_tokens: 8000}}

Step s (1-based) belongs to the first stage whose cumulative steps reach s. The sync loop
(rl/run/train.py) switches every worker's limits and envs when a stage begins (and at the first step
after a resume, so `--resume` in the middle of a curriculum continues in the right stage),
checkpoints at the last step of every stage (ordinary step-NNNNNN checkpoints, which
`checkpoint.keep_last` prunes like any other), and evaluates before and after training at the
last (longest) stage, so the two evaluations compare like with like.

A stage with a `gate` (rl/config/sections.py StageGate) is evaluated on a few held-out tasks
every `gate.every` of its steps (`gate_due`); at `gate.success` or above it ends there: the run
jumps to the stage's last step number (a checkpoint there, so a resume starts in the next
stage), below it the stage holds, up to its `steps`.
"""

from __future__ import annotations

import itertools

from rl.config.runfile import RunConfig


def stage_index(cfg: RunConfig, step: int) -> int | None:
    """The stage that step `step` (1-based) belongs to; None without a curriculum."""
    if not cfg.curriculum:
        return None
    ends = list(itertools.accumulate(stage.steps for stage in cfg.curriculum))
    return next((i for i, end in enumerate(ends) if step <= end), len(ends) - 1)


def gate_due(cfg: RunConfig, step: int) -> bool:
    """Whether step `step` (1-based) runs its stage's gate: the stage has one, `gate.every` of
    its steps have run, and it is not the stage's last step (which ends the stage anyway)."""
    index = stage_index(cfg, step)
    gate = None if index is None else cfg.curriculum[index].gate
    if gate is None:
        return False
    end = stage_end(cfg, index)
    start = end - cfg.curriculum[index].steps  # the step before the stage's first
    return step < end and (step - start) % gate.every == 0


def stage_end(cfg: RunConfig, index: int) -> int:
    """The last step number of stage `index`."""
    return sum(stage.steps for stage in cfg.curriculum[: index + 1])


def stage_ends(cfg: RunConfig) -> set[int]:
    """The steps that end a stage (a checkpoint is taken at each)."""
    return {stage_end(cfg, i) for i in range(len(cfg.curriculum))}


def staged(cfg: RunConfig, index: int | None) -> RunConfig:
    """The run's config as stage `index` sees it (the config itself for None)."""
    if index is None:
        return cfg
    stage = cfg.curriculum[index]
    rollout = cfg.rollout.model_copy(
        update={
            "max_seq_len": stage.max_seq_len,
            "max_turns": stage.max_turns or cfg.rollout.max_turns,
            "max_new_tokens": stage.max_new_tokens or cfg.rollout.max_new_tokens,
        }
    )  # model_copy does not validate again: load_config checked every stage against the run
    env = cfg.env.model_copy(update={"kwargs": {**cfg.env.kwargs, **stage.env_kwargs}})
    return cfg.model_copy(update={"rollout": rollout, "env": env})


def describe(cfg: RunConfig, index: int) -> str:
    stage, run = cfg.curriculum[index], staged(cfg, index)
    extra = f", env {stage.env_kwargs}" if stage.env_kwargs else ""
    return (
        f"curriculum stage {index + 1}/{len(cfg.curriculum)} {stage.name!r}: {stage.steps} steps, "
        f"max_seq_len {run.rollout.max_seq_len}, {run.rollout.max_turns} turns x "
        f"{run.rollout.max_new_tokens} tokens{extra}"
    )
