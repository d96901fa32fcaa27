"""The GRPO learner: reads trajectory groups from the stream, steps the optimizer, then acks.

A plain class; `rl/actors.py` makes it a Ray actor. Letters: N = trajectories, T = tokens.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import numpy as np
import torch

from policy.hf import checksum, export_weights
from policy.logprobs import token_logprobs
from rl.batch import TrainBatch, pack
from rl.config import TrainerConfig
from rl.losses import LossStats, ppo_clip_loss
from rollout.types import TrajectoryGroup


class GroupSource(Protocol):
    def read(self, count: int, *, block_ms: int) -> list[tuple[str, TrajectoryGroup]]: ...
    def ack(self, entry_ids: list[str]) -> int: ...


class StreamTimeout(TimeoutError):
    """The stream did not deliver a full batch in time."""


class Learner:
    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        model,
        source: GroupSource,
        pad_token_id: int,
        temperature: float,
    ):
        self.cfg, self.model, self.source = cfg, model.eval(), source  # eval: no dropout in RL
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.version = 0
        self.skipped_steps = 0

    def read_batch(self) -> tuple[list[str], list[TrajectoryGroup]]:
        """Exactly `tasks_per_step` groups, or StreamTimeout after `read_timeout_s` of silence."""
        want, ids, groups = self.cfg.tasks_per_step, [], []
        deadline = time.monotonic() + self.cfg.read_timeout_s
        while len(groups) < want:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise StreamTimeout(
                    f"learner got {len(groups)} of {want} groups in "
                    f"{self.cfg.read_timeout_s:.0f} s; are the rollout workers alive?"
                )
            for entry_id, group in self.source.read(
                want - len(groups), block_ms=min(left_ms, 1000)
            ):
                ids.append(entry_id)
                groups.append(group)
        return ids, groups

    def step(self) -> dict[str, float]:
        """Read a batch, update, ack: one optimizer step and one new policy version."""
        start = time.perf_counter()
        entry_ids, groups = self.read_batch()
        batch = pack(groups, pad_token_id=self.pad_token_id)
        metrics = self._update(batch)
        self.source.ack(entry_ids)  # only after the step: a crash before this leaves them pending
        lag = (self.version - batch.versions_N.float()).mean().item()
        self.version += 1
        seconds = time.perf_counter() - start
        metrics.update(
            {
                "learner/policy_lag": lag,
                "learner/seconds": seconds,
                "learner/tokens_per_s": float(batch.attention_mask_NT.sum()) / seconds,
                "learner/trajectories": float(batch.size),
                "learner/version": float(self.version),
            }
        )
        return metrics

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        normalizer = float(batch.loss_mask_NT.sum().clamp(min=1))
        order = torch.argsort(batch.lengths_N, descending=True)
        totals = LossStats(0.0, 0.0, 0.0, 0.0)
        loss_sum, entropy_sum = 0.0, 0.0
        for index in order.split(self.cfg.micro_batch_size):
            mb = batch.rows(index)
            logp, entropy = token_logprobs(
                self.model, mb.input_ids_NT, mb.attention_mask_NT, temperature=self.temperature
            )
            loss, stats = ppo_clip_loss(
                logp,
                mb.old_logp_NT,
                mb.adv_NT,
                mb.loss_mask_NT,
                clip_low=self.cfg.clip_eps,
                clip_high=self.cfg.clip_eps,
                normalizer=normalizer,
            )
            loss.backward()
            loss_sum += loss.item()
            entropy_sum += float((entropy.detach() * mb.loss_mask_NT).sum())
            for name in LossStats.__slots__:
                setattr(totals, name, getattr(totals, name) + getattr(stats, name))
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        )
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN/Inf gradient never reaches the weights
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(totals.tokens, 1.0)
        return {
            "learner/loss": loss_sum,
            "learner/entropy": entropy_sum / tokens,
            "learner/clip_fraction": totals.clipped_tokens / tokens,
            "learner/approx_kl": totals.approx_kl_sum / tokens,
            "learner/ratio_mean": totals.ratio_sum / tokens,
            "learner/grad_norm": grad_norm,
            "learner/skipped_steps": float(self.skipped_steps),
            "learner/loss_tokens": totals.tokens,
        }

    def export(self) -> tuple[int, dict[str, np.ndarray], int]:
        """(version, weights as numpy arrays, checksum) for the rollout workers."""
        weights = export_weights(self.model)
        return self.version, weights, checksum(weights)
