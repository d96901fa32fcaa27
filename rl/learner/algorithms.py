"""The algorithms a run file can name, as data: how advantages are made and which loss applies.

    grpo     group-normalised advantages, token-level clipped ratio, seq-mean-token-mean
    dr_grpo  group-centred advantages (no std), seq-mean-token-sum-norm
    dapo     group-normalised, clip-higher (0.28), token-mean, zero-variance groups dropped
    gspo     group-normalised, sequence-level ratio, clip 3e-4 / 4e-4, seq-mean-token-mean
    cispo    group-normalised, clipped IS weight (cap 5.0) as a stop-gradient on logp, token-mean
    ppo      value head on the policy trunk, GAE(gamma, lambda) over turns, token-mean

These defaults match TRL 1.16's loss types of the same name (tests compare the numbers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl.config.runfile import TrainerConfig
from rl.learner.losses import LossSpec


@dataclass(frozen=True, slots=True)
class Algorithm:
    advantages: str
    """grpo | centred | none (ppo computes them from its critic)."""
    spec: LossSpec
    drop_flat_groups: bool = False
    critic: bool = False


def _defaults(name: str) -> Algorithm:
    table = {
        "grpo": Algorithm("grpo", LossSpec(aggregation="seq-mean-token-mean")),
        "dr_grpo": Algorithm("centred", LossSpec(aggregation="seq-mean-token-sum-norm")),
        "dapo": Algorithm(
            "grpo", LossSpec(clip_high=0.28, aggregation="token-mean"), drop_flat_groups=True
        ),
        "gspo": Algorithm(
            "grpo",
            LossSpec(
                level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"
            ),
        ),
        "cispo": Algorithm(
            "grpo", LossSpec(objective="cispo", clip_high=5.0, aggregation="token-mean")
        ),
        "ppo": Algorithm("none", LossSpec(aggregation="token-mean"), critic=True),
    }
    return table[name]


def algorithm_for(cfg: TrainerConfig) -> Algorithm:
    """The named algorithm with the run file's explicit overrides applied."""
    base = _defaults(cfg.algorithm)
    overrides = {
        "clip_low": cfg.clip_low,
        "clip_high": cfg.clip_high,
        "aggregation": cfg.loss_aggregation,
    }
    spec = dataclasses.replace(
        base.spec,
        **{k: v for k, v in overrides.items() if v is not None},
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
    )
    return dataclasses.replace(base, spec=spec)
