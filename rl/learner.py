"""The learner: reads trajectory groups from the stream, steps the optimizer, then acks.

A plain class; `rl/actors.py` makes it a Ray actor. Letters: N = trajectories, T = tokens,
K = turns, D = hidden size. One `step()` = one optimizer step = one new policy version.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from policy.hf import checksum, export_weights
from policy.logprobs import decoder_hidden, head_logprobs
from rl.advantages import gae
from rl.algorithms import algorithm_for
from rl.batch import TrainBatch, drop_flat_groups, pack, spread_turn_values
from rl.checkpoint import (
    load_optimizer_state,
    optimizer_state,
    read_json,
    read_tensors,
    write_json,
    write_tensors,
)
from rl.config import TrainerConfig
from rl.losses import LossStats, Normalizers, policy_loss, value_loss
from rollout.types import TrajectoryGroup


class GroupSource(Protocol):
    def read(self, count: int, *, block_ms: int) -> list[tuple[str, TrajectoryGroup]]: ...
    def ack(self, entry_ids: list[str]) -> int: ...


class StreamTimeout(TimeoutError):
    """The stream did not deliver a full batch in time."""


@dataclass(slots=True)
class Prepared:
    """No-grad quantities from before the update (each None when the algorithm needs none)."""

    learner_logp_NT: torch.Tensor | None = None
    values_NK: torch.Tensor | None = None
    returns_NK: torch.Tensor | None = None
    ref_logp_NT: torch.Tensor | None = None


class Learner:
    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        model,
        source: GroupSource,
        pad_token_id: int,
        temperature: float,
        seed: int = 0,
    ):
        self.cfg, self.model, self.source = cfg, model.eval(), source  # eval: no dropout in RL
        self.algo = algorithm_for(cfg)
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.value_head = None
        params = list(model.parameters())
        if self.algo.critic:
            self.value_head = torch.nn.Linear(model.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            params += list(self.value_head.parameters())
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = 0
        self.skipped_steps = 0
        self.dropped_groups = 0
        self.last_acked = "0-0"
        self.generator = torch.Generator().manual_seed(seed)  # micro-batch order

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
        groups = sorted(groups, key=_group_key)  # arrival order depends on worker timing
        dropped = 0
        if self.algo.drop_flat_groups:
            groups, dropped = drop_flat_groups(groups)
            self.dropped_groups += dropped
        metrics = {"learner/dropped_groups": float(dropped)}
        if groups:
            batch = pack(groups, pad_token_id=self.pad_token_id, advantages=self.algo.advantages)
            metrics.update(self._train(batch))
            metrics["learner/policy_lag"] = (self.version - batch.versions_N.float()).mean().item()
            metrics["learner/tokens_per_s"] = float(batch.attention_mask_NT.sum()) / (
                time.perf_counter() - start
            )
            metrics["learner/trajectories"] = float(batch.size)
        else:  # nothing carries signal: no update; the groups are consumed (counted as dropped)
            self.skipped_steps += 1
        self.source.ack(entry_ids)  # only after the step: a crash before this leaves them pending
        self.last_acked = max(entry_ids, key=_entry_key, default=self.last_acked)
        self.version += 1
        metrics.update(
            {
                "learner/seconds": time.perf_counter() - start,
                "learner/version": float(self.version),
                "learner/skipped_steps": float(self.skipped_steps),
            }
        )
        return metrics

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        prep = self._prepare(batch)
        is_weight_NT = None
        if prep.learner_logp_NT is not None and self.cfg.tis_cap is not None:
            is_weight_NT = (
                (prep.learner_logp_NT - batch.old_logp_NT).exp().clamp(max=self.cfg.tis_cap)
            )
            batch.old_logp_NT = (
                prep.learner_logp_NT
            )  # the ratio is taken against the learner's policy
        if self.algo.critic:
            batch.adv_NT = spread_turn_values(prep.returns_NK - prep.values_NK, batch)
        metrics = self._update(batch, prep, is_weight_NT)
        if is_weight_NT is not None:
            metrics["learner/tis_weight_mean"] = float(
                (is_weight_NT * batch.loss_mask_NT).sum() / batch.loss_mask_NT.sum().clamp(min=1)
            )
        return metrics

    @torch.no_grad()
    def _prepare(self, batch: TrainBatch) -> Prepared:
        need_logp = self.cfg.tis_cap is not None
        if not (need_logp or self.algo.critic or self.reference is not None):
            return Prepared()
        logps, values, refs = [], [], []
        for index in torch.arange(batch.size).split(self.cfg.micro_batch_size):
            mb = batch.rows(index)
            hidden = decoder_hidden(self.model, mb.input_ids_NT, mb.attention_mask_NT)
            if need_logp:
                logps.append(
                    _pad(
                        head_logprobs(
                            self.model, hidden, mb.input_ids_NT[:, 1:], temperature=self.temperature
                        )[0],
                        batch,
                    )
                )
            if self.algo.critic:
                values.append(self._values(hidden, mb))
            if self.reference is not None:
                ref_hidden = decoder_hidden(self.reference, mb.input_ids_NT, mb.attention_mask_NT)
                refs.append(
                    _pad(
                        head_logprobs(
                            self.reference,
                            ref_hidden,
                            mb.input_ids_NT[:, 1:],
                            temperature=self.temperature,
                        )[0],
                        batch,
                    )
                )
        prep = Prepared(
            learner_logp_NT=torch.cat(logps) if logps else None,
            values_NK=torch.cat(values) if values else None,
            ref_logp_NT=torch.cat(refs) if refs else None,
        )
        if self.algo.critic:
            _, prep.returns_NK = gae(
                _turn_rewards(batch),
                prep.values_NK,
                batch.turn_mask_NK,
                gamma=self.cfg.gamma,
                lam=self.cfg.lam,
            )
        return prep

    def _values(self, hidden_NTD: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        index_NKD = mb.turn_pos_NK[:, :, None].expand(-1, -1, hidden_NTD.shape[-1])
        return self.value_head(hidden_NTD.gather(1, index_NKD))[..., 0] * mb.turn_mask_NK

    def _update(self, batch: TrainBatch, prep: Prepared, is_weight_NT) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        norm = Normalizers.of(batch.loss_mask_NT)
        turns = float(batch.turn_mask_NK.sum().clamp(min=1))
        totals, sums = LossStats(), {"loss": 0.0, "entropy": 0.0, "value_loss": 0.0}
        order = torch.randperm(batch.size, generator=self.generator)
        for index in order.split(self.cfg.micro_batch_size):
            mb = batch.rows(index)
            width = mb.loss_mask_NT.shape[1]
            hidden = decoder_hidden(self.model, mb.input_ids_NT, mb.attention_mask_NT)
            logp, entropy = head_logprobs(
                self.model, hidden, mb.input_ids_NT[:, 1:], temperature=self.temperature
            )
            loss, stats = policy_loss(
                logp,
                mb.old_logp_NT,
                mb.adv_NT,
                mb.loss_mask_NT,
                self.algo.spec,
                norm,
                is_weight_BT=None if is_weight_NT is None else is_weight_NT[index, :width],
                ref_logp_BT=None if prep.ref_logp_NT is None else prep.ref_logp_NT[index, :width],
                entropy_BT=entropy,
            )
            if self.algo.critic:
                v_loss = (
                    value_loss(
                        self._values(hidden, mb),
                        prep.returns_NK[index],
                        prep.values_NK[index],
                        mb.turn_mask_NK,
                        clip=self.cfg.value_clip,
                    )
                    * mb.turn_mask_NK.sum()
                    / turns
                )
                loss = loss + self.cfg.vf_coef * v_loss
                sums["value_loss"] += v_loss.item()
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += float((entropy.detach() * mb.loss_mask_NT).sum())
            totals.add(stats)
        return self._finish_step(totals, sums)

    def _finish_step(self, totals: LossStats, sums: dict[str, float]) -> dict[str, float]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN/Inf gradient never reaches the weights
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(totals.tokens, 1.0)
        metrics = {
            "learner/loss": sums["loss"],
            "learner/entropy": sums["entropy"] / tokens,
            "learner/clip_fraction": totals.clipped_tokens / tokens,
            "learner/approx_kl": totals.approx_kl_sum / tokens,
            "learner/ratio_mean": totals.ratio_sum / tokens,
            "learner/grad_norm": grad_norm,
            "learner/loss_tokens": totals.tokens,
        }
        if self.reference is not None:
            metrics["learner/ref_kl"] = totals.ref_kl_sum / tokens
        if self.algo.critic:
            metrics["learner/value_loss"] = sums["value_loss"]
        return metrics

    def save(self, directory: Path) -> None:
        """Everything an exact resume needs, without pickle: weights, optimizer, RNG, counters."""
        tensors = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        if self.value_head is not None:
            tensors.update({f"value_head.{k}": v for k, v in self.value_head.state_dict().items()})
        opt_tensors, opt_meta = optimizer_state(self.optimizer)
        tensors.update({f"optim.{k}": v for k, v in opt_tensors.items()})
        tensors["rng.torch"] = torch.get_rng_state()
        tensors["rng.order"] = self.generator.get_state()
        write_tensors(Path(directory) / "learner.safetensors", tensors)
        meta = {
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "dropped_groups": self.dropped_groups,
            "last_acked": self.last_acked,
            "optimizer": opt_meta,
            "python_random": _jsonable(random.getstate()),
        }
        write_json(Path(directory) / "learner.json", meta)

    def load(self, directory: Path, *, rng: bool = True) -> None:
        tensors = read_tensors(Path(directory) / "learner.safetensors")
        meta = read_json(Path(directory) / "learner.json")
        self.model.load_state_dict(_strip(tensors, "model."))
        if self.value_head is not None:
            self.value_head.load_state_dict(_strip(tensors, "value_head."))
        load_optimizer_state(self.optimizer, _strip(tensors, "optim."), meta["optimizer"])
        if rng:  # the negative control of the resume test turns this off
            torch.set_rng_state(tensors["rng.torch"])
            self.generator.set_state(tensors["rng.order"])
            random.setstate(_tuples(meta["python_random"]))
        self.version, self.last_acked = meta["version"], meta["last_acked"]
        self.skipped_steps, self.dropped_groups = meta["skipped_steps"], meta["dropped_groups"]

    def export(self) -> tuple[int, dict[str, np.ndarray], int]:
        """(version, weights as numpy arrays, checksum) for the rollout workers."""
        weights = export_weights(self.model)
        return self.version, weights, checksum(weights)


def _pad(x_NT: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Right-pad a micro-batch tensor to the full batch width."""
    width = batch.loss_mask_NT.shape[1]
    return torch.nn.functional.pad(x_NT, (0, width - x_NT.shape[1]))


def _turn_rewards(batch: TrainBatch) -> torch.Tensor:
    """[N, K]: the trajectory's reward on its last turn (outcome rewards), 0 elsewhere."""
    last_NK = torch.zeros_like(batch.turn_mask_NK)
    count_N = batch.turn_mask_NK.sum(-1).long()
    rows = torch.arange(batch.size)[count_N > 0]
    last_NK[rows, count_N[count_N > 0] - 1] = 1
    return last_NK * batch.rewards_N[:, None]


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _group_key(group: TrajectoryGroup) -> tuple:
    """Order groups by id ("<step>-<index>" sorts numerically) so a batch never depends on
    which worker wrote first: bit-exact resume needs the same order every time."""
    return tuple(int(p) if p.isdigit() else p for p in group.group_id.split("-"))
