"""The learner: reads trajectory groups from the stream, steps the optimizer, then acks.

A plain class; `rl/run/actors.py` makes each learner rank a Ray actor. With several ranks
(`shard.world > 1`) rank 0 reads and acks the stream, every rank trains on its slice of the batch
(FSDP2 + expert parallel, `policy/parallel.py`), and losses are normalised by whole-batch counts
so the summed gradients equal one rank's. Letters: N = trajectories, T = tokens, K = turns,
D = hidden size. One `step()` = one batch = `ppo_epochs` x (batch / `mini_batch_size`) optimizer
steps = one new policy version.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from policy.k3.context import context_span, min_length
from policy.logprobs import TokenLogprobs, decoder_hidden, head_logprobs
from policy.shared_prefix import PrefixPlan, plan_shared_prefix
from rl import faults
from rl.config.runfile import ConfigError, FaultsConfig, TrainerConfig
from rl.learner.advantages import gae
from rl.learner.algorithms import algorithm_for
from rl.learner.batch import TrainBatch, pack, spread_turn_values
from rl.learner.distributed import Shard
from rl.learner.exact import exact_scorer, exact_values
from rl.learner.group_ids import GroupIds
from rl.learner.ledger import group_ids, new_entry, note, sort_groups
from rl.learner.losses import LossStats, Normalizers, policy_loss, value_loss
from rl.learner.optim import adamw
from rl.learner.stats import (
    add_sums,
    average,
    decoupled_weights,
    largest,
    length_metrics,
    logprob_gap,
    mini_batches,
    mismatch_metrics,
    routing_mismatch,
    share_rows,
    staleness_metrics,
    step_metrics,
    trained_outcomes,
)
from rollout.types import TrajectoryGroup


class GroupSource(Protocol):
    def read(self, count: int, *, block_ms: int) -> list[tuple[str, TrajectoryGroup]]: ...
    def ack(self, entry_ids: list[str]) -> int: ...
    def stopped(self) -> bool: ...  # the run is stopping: read no more, ack nothing


class StreamTimeout(TimeoutError):
    """The stream did not deliver a full batch in time."""


@dataclass(slots=True)
class Prepared:
    """No-grad quantities from before the update (None where the algorithm needs none)."""

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
        source: GroupSource | None,
        pad_token_id: int,
        temperature: float,
        seed: int = 0,
        shard: Shard | None = None,
        faults: FaultsConfig | None = None,
    ):
        self.cfg, self.source, self.shard = cfg, source, shard or Shard()
        self.faults = faults  # the run file's testing.faults (rl/faults.py); None: none
        self.algo = algorithm_for(cfg)
        self.pad_token_id, self.temperature = pad_token_id, temperature
        self.reference = None
        if cfg.kl_coef > 0:  # kept whole on every rank: its forward needs no collectives
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = model.eval()  # eval: no dropout in RL
        self.device = next(model.parameters()).device  # batches follow the model (cpu / cuda)
        _check_segments(cfg, model, self.shard.context)
        trunk = TokenLogprobs(
            self.model, segment_tokens=cfg.segment_tokens, context=self.shard.context_group,
            selected_only=cfg.loss_positions_only and self.shard.world == 1,
        )  # fmt: skip
        self.trunk = self.shard.prepare_model(trunk)  # sharded from here
        self.value_head = None
        params = list(self.trunk.parameters())
        if self.algo.critic:
            self.value_head = torch.nn.Linear(model.config.hidden_size, 1, device=self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            params += list(self.value_head.parameters())
        self.router_stats = _router_stats(self.trunk)
        self.exact = exact_scorer(model) if cfg.exact_logprobs else None  # rl/learner/exact.py
        self.share_prefix = cfg.shared_prefix and not (
            self.shard.world > 1 or self.algo.critic or self.exact is not None
        )  # one forward per rank per micro-batch keeps FSDP's collectives in step
        self.optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)  # optim.py
        self.version, self.skipped_steps, self.dropped_groups = 0, 0, 0
        self.nonfinite_in_a_row = 0
        """Steps in a row whose every optimizer step had a NaN/Inf gradient (not checkpointed)."""
        self.last_acked = "0-0"
        self.trained = GroupIds()
        """Group ids with a ledger entry so far: trained, filtered or failed (checkpointed;
        rl/learner/ledger.py): a redelivered copy is never trained again."""
        self.ledger = new_entry()
        self.last_groups: list[TrajectoryGroup] = []
        """The groups of the last step, trained or not (for rl/observe/trajlog.py's records)."""
        self.generator = torch.Generator().manual_seed(seed)  # micro-batch order
        self.last_end: float | None = None
        """When the last step ended (perf_counter): learner/between_steps_seconds."""

    def read_batch(self) -> tuple[list[str], list[TrajectoryGroup]]:
        """Exactly `tasks_per_step` groups, or StreamTimeout after `read_timeout_s` of silence:
        the timer restarts whenever a group arrives, so a slow but live stream never times out.
        No groups when the run stops meanwhile (those read stay pending, unacked)."""
        want, ids, groups = self.cfg.tasks_per_step, [], []
        deadline = time.monotonic() + self.cfg.read_timeout_s
        while len(groups) < want:
            if self.source.stopped():
                return [], []
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise StreamTimeout(
                    f"learner got {len(groups)} of {want} groups and then none for "
                    f"{self.cfg.read_timeout_s:g} s (trainer.read_timeout_s); "
                    "are the rollout workers alive?"
                )
            entries = self.source.read(want - len(groups), block_ms=min(left_ms, 1000))
            for group_id in _dead_letters(self.source):  # undecodable: failed, never retried
                note(self.ledger, "failed", "undecodable", group_id)
            if entries:  # the stream is alive (duplicates included): restart the silence timer
                deadline = time.monotonic() + self.cfg.read_timeout_s
            for entry_id, group in entries:
                if group.group_id in self.trained or any(
                    g.group_id == group.group_id for g in groups
                ):
                    note(self.ledger, "filtered", "duplicate", group.group_id)
                    self.source.ack([entry_id])  # another attempt of a group we have
                    continue
                ids.append(entry_id)
                groups.append(group)
        return ids, groups

    def step(self) -> dict[str, float]:
        """Read a batch, update, ack: one optimizer step and one new policy version."""
        start = time.perf_counter()
        between = None if self.last_end is None else start - self.last_end
        self.ledger = new_entry()
        wait = time.perf_counter()
        entry_ids, groups = self.read_batch() if self.shard.leader else ([], [])
        read_notes = copy.deepcopy(self.ledger)  # acked while reading: duplicates, dead letters
        wait = time.perf_counter() - wait
        faults.slow_learner(self.faults, self.version + 1)  # testing.faults (rl/faults.py)
        groups = sorted(self.shard.share_groups(groups), key=_group_key)  # arrival order varies
        self.last_groups = groups
        count = len(groups)
        groups = sort_groups(groups, drop_flat=self.algo.drop_flat_groups, entry=self.ledger)
        dropped = count - len(groups)
        self.dropped_groups += dropped
        metrics = {"learner/dropped_groups": float(dropped), "learner/wait_seconds": wait}
        if groups:
            batch = pack(groups, pad_token_id=self.pad_token_id, advantages=self.algo.advantages)
            batch = batch.to(self.device)
            metrics.update(self._train(batch))
            self._count_nonfinite(metrics["learner/optimizer_steps"] == 0)
            metrics["learner/policy_lag"] = (self.version - batch.versions_N.float()).mean().item()
            metrics["learner/tokens_per_s"] = float(batch.attention_mask_NT.sum()) / (
                time.perf_counter() - start
            )
            metrics["learner/trajectories"] = float(batch.size)
            metrics.update(trained_outcomes(groups))
        else:  # nothing carries signal: no update; the groups are consumed (counted as dropped)
            self.skipped_steps += 1
        stopped = self.shard.leader and self.source.stopped()  # the run stopped meanwhile:
        if stopped:  # no ack, so the batch stays pending for a resume; the ledger keeps only
            self.ledger = read_notes  # the entries acked while reading
            metrics["learner/stopped"] = 1.0
        self.trained.update(group_ids(self.ledger))  # (a failed step settles nothing)
        if self.shard.leader and not stopped:
            self.source.ack(entry_ids)  # only after the step: a crash before leaves them pending
            self.last_acked = max(entry_ids, key=_entry_key, default=self.last_acked)
        self.version += 1
        metrics.update(
            {
                "learner/seconds": time.perf_counter() - start,
                "learner/version": float(self.version),
                "learner/skipped_steps": float(self.skipped_steps),
                "learner/nonfinite_in_a_row": float(self.nonfinite_in_a_row),
            }
        )
        metrics["learner/started_at"] = time.time() - (time.perf_counter() - start)  # unix s
        if between is not None:  # exports, pushes, the driver's bookkeeping (sync: the rollouts)
            metrics["learner/between_steps_seconds"] = between
        self.last_end = time.perf_counter()
        return metrics

    def _count_nonfinite(self, skipped: bool) -> None:
        """A batch whose every optimizer step had a NaN/Inf gradient trained nothing: its groups
        are failed ("non-finite gradient") in the ledger, not trained; the driver stops the run
        after `trainer.max_skipped_steps` such steps in a row (rl/run/failures.py)."""
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        if skipped:
            for group_id in self.ledger["trained"]:
                note(self.ledger, "failed", "non-finite gradient", group_id)
            self.ledger["trained"] = []

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        """`ppo_epochs` passes over the batch, reshuffled each time, one optimizer step per
        mini-batch. The old logprobs (behaviour, or proximal for decoupled), PPO's values and
        returns and the reference logprobs are computed once, before the first step."""
        cfg = self.cfg
        if batch.input_ids_NT.shape[1] < self.shard.context:  # a token for every context rank
            batch = batch.rows(torch.arange(batch.size), self.shard.context)
        order = torch.randperm(batch.size, generator=self.generator)
        prep = self._prepare(batch, self.shard.micro_batches(self._grouped(order, batch),
                                                             cfg.micro_batch_size))  # fmt: skip
        metrics = {
            **staleness_metrics(batch.versions_NT, batch.loss_mask_NT, self.version),
            **length_metrics(batch.loss_mask_NT),
            "learner/loss_tokens": float(batch.loss_mask_NT.sum()),
        }
        if self.router_stats is not None:  # MoE policies
            metrics["moe/replayed_share"] = self._replayed_share(batch)
        is_weight_NT, gap = None, -1.0
        if cfg.off_policy == "decoupled":  # the learner's logprobs of the whole batch, no grad
            gap = logprob_gap(prep.learner_logp_NT, batch.old_logp_NT, batch.loss_mask_NT,
                              batch.versions_NT, self.version)  # fmt: skip
            is_weight_NT, weights = decoupled_weights(
                prep.learner_logp_NT, batch.old_logp_NT, batch.loss_mask_NT, cfg.tis_cap
            )
            batch.old_logp_NT = prep.learner_logp_NT  # the clip acts on pi / pi_prox
            metrics.update(weights)
        if self.algo.critic:
            batch.adv_NT = spread_turn_values(prep.returns_NK - prep.values_NK, batch)
        steps, routing, largest_ratio, shared = [], {}, 0.0, 0.0
        for epoch in range(cfg.ppo_epochs):
            if epoch:
                order = torch.randperm(batch.size, generator=self.generator)
            for mini in mini_batches(order, cfg.mini_batch_size):
                fresh = not steps  # the weights that sampled this version's tokens
                sums, grad_norm = self._update(batch, prep, mini, is_weight_NT, epoch == 0, fresh)
                add_sums(routing, {k: v for k, v in sums.items() if k.startswith("routing.")})
                largest_ratio = max(largest_ratio, sums.pop("local.is_weight_max"))
                shared += sums.pop("shared_tokens")
                gap = max(gap, sums.pop("local.logprob_gap"))
                steps.append(step_metrics(sums, grad_norm))
        metrics.update(self._step_summary(average(steps), routing, largest_ratio))
        if self.share_prefix:  # the share of the batch's tokens whose forward was skipped
            metrics["learner/shared_prefix_share"] = shared / float(batch.attention_mask_NT.sum())
        gap = largest(self.shard, gap)
        if gap >= 0:  # some sampled token of this version was trained
            metrics["learner/logprob_delta_max"] = gap
        taken = sum(math.isfinite(step["learner/grad_norm"]) for step in steps)
        metrics["learner/optimizer_steps"] = float(taken)  # a non-finite gradient's is skipped
        return metrics

    def _step_summary(self, means: dict, routing: dict, largest_ratio: float) -> dict:
        """The averaged step metrics that apply to this run, plus routing and expert balance."""
        drop = {
            "learner/ref_kl": self.reference is None,
            "learner/value_loss": not self.algo.critic,
        }
        tis = self.cfg.off_policy == "tis"
        drop["learner/tis_weight_mean"] = drop["learner/tis_truncated_fraction"] = not tis
        out = {k: v for k, v in means.items() if not drop.get(k, False)}
        if tis:
            out["learner/tis_weight_max"] = largest(self.shard, largest_ratio)
        out.update(mismatch_metrics(routing))
        out.update(self._balance_experts())  # once per batch (see _balance_experts)
        return out

    @torch.no_grad()
    def _prepare(self, batch: TrainBatch, pieces: list[torch.Tensor]) -> Prepared:
        """Proximal logprobs (decoupled), values (PPO) and reference logprobs (KL) of the whole
        batch: each rank computes its rows, then they are shared."""
        need_logp = self.cfg.off_policy == "decoupled"
        if not (need_logp or self.algo.critic or self.reference is not None):
            return Prepared()
        zeros_NT, zeros_NK = batch.loss_mask_NT.new_zeros, batch.turn_mask_NK.new_zeros
        shape_NT, shape_NK = batch.loss_mask_NT.shape, batch.turn_mask_NK.shape
        prep = Prepared(
            learner_logp_NT=zeros_NT(shape_NT) if need_logp else None,
            values_NK=zeros_NK(shape_NK) if self.algo.critic else None,
            ref_logp_NT=zeros_NT(shape_NT) if self.reference is not None else None,
        )
        for index, scale in _pieces(pieces):
            mb = self._rows(batch, index)
            width = mb.loss_mask_NT.shape[1]
            select = mb.loss_mask_NT > 0
            with self._autocast():
                logp, _, hidden, _ = self.trunk(
                    mb.input_ids_NT,
                    mb.attention_mask_NT,
                    self.temperature,
                    select,
                    replay_experts=self._replay(mb),
                    keep_hidden=self.algo.critic,
                    prefix=self._plan(mb),
                )
            if not scale:  # an empty piece's stand-in row belongs to another rank
                continue
            if need_logp and self.exact is not None:  # exact mode: the proximal values too
                logp = exact_values(self.exact, mb, logp, self.version, self.temperature)
            if need_logp:
                prep.learner_logp_NT[index, :width] = logp
            if self.algo.critic:
                prep.values_NK[index] = self._values(hidden, mb)
            if self.reference is not None:
                with self._autocast():
                    ref_hidden = decoder_hidden(
                        self.reference,
                        mb.input_ids_NT,
                        mb.attention_mask_NT,
                        segment_tokens=self.cfg.segment_tokens,
                    )
                prep.ref_logp_NT[index, :width] = self._logp(self.reference, ref_hidden, mb)
        share_rows(self.shard, prep.learner_logp_NT, prep.values_NK, prep.ref_logp_NT)
        if self.algo.critic:
            _, prep.returns_NK = gae(
                _turn_rewards(batch),
                prep.values_NK,
                batch.turn_mask_NK,
                gamma=self.cfg.gamma,
                lam=self.cfg.lam,
            )
        return prep

    def _rows(self, batch: TrainBatch, index: torch.Tensor) -> TrainBatch:
        """A micro-batch; segmented on several ranks, padded to the widest of the ranks' pieces
        so that every rank runs the same number of segments (so of FSDP and EP collectives);
        when no rank's piece is longer than a segment, every rank runs one forward unpadded.
        With context ranks: at least a token per context rank, and padded to the widest once
        that is split into whole segments (shorter micro-batches are split by tokens: one
        forward per shard whatever the width)."""
        segment, context = self.cfg.segment_tokens, self.shard.context
        shortest = context if context > 1 else 0  # a token for every context rank
        if not (segment and self.shard.world > 1):
            return batch.rows(index, shortest)
        widest = self.shard.max(int(batch.lengths_N[index].max()))
        # with context ranks: shards of whole segments once the widest has one per rank
        pad = widest >= min_length(context, segment) if context > 1 else widest > segment
        return batch.rows(index, max(shortest, widest) if pad else shortest)

    def _shard_mask(self, mask_NT: torch.Tensor) -> torch.Tensor:
        """The columns of `mask_NT` this rank's forward routes (all of them without CP)."""
        if self.shard.context == 1:
            return mask_NT
        context = self.shard.context
        a, b = context_span(self.model.config, mask_NT.shape[1], context,
                            self.shard.rank % context, self.cfg.segment_tokens)  # fmt: skip
        return mask_NT[:, a:b]

    def _grouped(self, rows: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """The same rows, each group's together (groups in the order of their first row in
        `rows`), when prompts are shared: micro-batches then hold whole groups."""
        if not self.share_prefix or batch.groups_N is None:
            return rows
        first: dict[int, int] = {}
        key = [first.setdefault(g, i) for i, g in enumerate(batch.groups_N[rows].tolist())]
        return rows[torch.tensor(key).argsort(stable=True)]

    def _plan(self, mb: TrainBatch) -> PrefixPlan | None:
        """The micro-batch's shared prompt (policy/shared_prefix.py), or None."""
        segment = self.cfg.segment_tokens
        if not self.share_prefix or (segment and mb.input_ids_NT.shape[1] > segment):
            return None
        routes = mb.routes_NTMK if self.cfg.routing_replay else None  # same replay too
        return plan_shared_prefix(
            mb.input_ids_NT, mb.attention_mask_NT, mb.loss_mask_NT > 0, routes
        )

    def _logp(self, model, hidden, mb: TrainBatch) -> torch.Tensor:
        targets = mb.input_ids_NT[:, 1:]
        select = mb.loss_mask_NT > 0
        return head_logprobs(
            model, hidden, targets, temperature=self.temperature, select_BT=select
        )[0]

    def _replay(self, mb: TrainBatch):
        """The rollout's expert choices per MoE layer (int64 [B, T, K] each) when replaying (R3);
        -1 rows (positions without a record) are routed live by the model."""
        if not self.cfg.routing_replay or mb.routes_NTMK is None:
            return None
        return [mb.routes_NTMK[:, :, m].long() for m in range(mb.routes_NTMK.shape[2])]

    def _replayed_share(self, batch: TrainBatch) -> float:
        """Share of the sampled (loss-mask) tokens predicted from a replayed route: the record
        of the predicting position t (target t + 1); 0 without routing replay."""
        if not self.cfg.routing_replay or batch.routed_NT is None:
            return 0.0
        mask_NT = batch.loss_mask_NT
        replayed = (mask_NT * batch.routed_NT[:, :-1]).sum()
        return float(replayed / mask_NT.sum().clamp(min=1))

    def _measure_routing(self, mb: TrainBatch) -> bool:
        """Compare the learner's own routing with the rollout's record, replayed or not (the
        model reports the router's own choice: policy/k3/modeling.py router_choice)."""
        return mb.routes_NTMK is not None

    def _values(self, hidden_NTD: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        """Value of each turn [N, K], read at the turn's first predicting position (< T-1)."""
        index_NKD = mb.turn_pos_NK[:, :, None].expand(-1, -1, hidden_NTD.shape[-1])
        hidden_NKD = hidden_NTD.gather(1, index_NKD).to(self.value_head.weight.dtype)
        return self.value_head(hidden_NKD)[..., 0] * mb.turn_mask_NK

    def _autocast(self):
        """The trunk's forward under bf16 autocast (`trainer.autocast: bf16`): fp32 weights,
        gradients and optimizer state; the loss and its backward run outside it."""
        if self.cfg.autocast != "bf16":
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=torch.bfloat16)

    def _update(
        self, batch, prep: Prepared, mini: torch.Tensor, is_weight_NT, first_pass: bool,
        fresh: bool,
    ) -> tuple[dict[str, float], float]:  # fmt: skip
        """One optimizer step on the mini-batch `mini` (rows of `batch`), accumulated over this
        rank's micro-batches and normalised by the whole mini-batch's counts (all ranks).
        Returns the all-rank sums and the gradient norm. Router statistics and the routing
        mismatch are taken on the batch's first pass only (every token once); the rollout /
        learner logprob gap on the step's first optimizer step (`fresh`: unchanged weights)."""
        self.optimizer.zero_grad(set_to_none=True)
        norm = Normalizers.of(batch.loss_mask_NT[mini])
        turns = float(batch.turn_mask_NK[mini].sum().clamp(min=1))
        cap = self.cfg.tis_cap if self.cfg.off_policy == "tis" else None
        totals, sums = LossStats(), {"loss": 0.0, "entropy": 0.0, "value_loss": 0.0}
        sums["shared_tokens"] = 0.0  # prompt tokens the shared prefix skipped (first pass)
        largest_gap = -1.0
        micro = self.shard.micro_batches(self._grouped(mini, batch), self.cfg.micro_batch_size)
        for index, scale in _pieces(micro):
            mb = self._rows(batch, index)
            width = mb.loss_mask_NT.shape[1]
            plan = self._plan(mb)
            if plan is not None and first_pass:
                sums["shared_tokens"] += plan.saved_tokens
            mask = self._shard_mask(mb.attention_mask_NT)
            record = (
                self.router_stats.record(token_mask=plan.token_masks(mask) if plan else mask)
                if self.router_stats and first_pass
                else contextlib.nullcontext()
            )
            with record, self._autocast():  # the backward runs outside autocast
                logp, entropy, hidden, routed = self.trunk(
                    mb.input_ids_NT,
                    mb.attention_mask_NT,
                    self.temperature,
                    mb.loss_mask_NT > 0,
                    replay_experts=self._replay(mb),
                    return_routing=self._measure_routing(mb) and first_pass,
                    keep_hidden=self.algo.critic,
                    prefix=plan,
                )
            if self.exact is not None:  # the rollout engine's values, this forward's gradient
                logp = exact_values(self.exact, mb, logp, self.version, self.temperature)
            if routed is not None:
                add_sums(sums, routing_mismatch(routed, mb, scale))
            if fresh and self.cfg.off_policy != "decoupled":  # decoupled: measured in _train
                gap = logprob_gap(logp, mb.old_logp_NT, mb.loss_mask_NT, mb.versions_NT,
                                  self.version)  # fmt: skip
                largest_gap = max(largest_gap, gap)
            loss, stats = policy_loss(
                logp,
                mb.old_logp_NT,
                mb.adv_NT,
                mb.loss_mask_NT * scale,
                self.algo.spec,
                norm,
                is_weight_BT=None if is_weight_NT is None else is_weight_NT[index, :width],
                ratio_cap=cap,
                ref_logp_BT=None if prep.ref_logp_NT is None else prep.ref_logp_NT[index, :width],
                entropy_BT=entropy,
            )
            if faults.nan_loss(self.faults, self.version + 1):  # testing.faults (rl/faults.py)
                loss = loss * float("nan")
            if self.algo.critic:
                v_loss = value_loss(
                    self._values(hidden, mb),
                    prep.returns_NK[index],
                    prep.values_NK[index],
                    mb.turn_mask_NK * scale,
                    clip=self.cfg.value_clip,
                )
                v_loss = v_loss * (mb.turn_mask_NK * scale).sum() / turns
                loss = loss + self.cfg.vf_coef * v_loss
                sums["value_loss"] += v_loss.item()
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += float((entropy.detach() * mb.loss_mask_NT * scale).sum())
            totals.add(stats)
        self.shard.sync_context(self.trunk.parameters())
        self.shard.sync_replicated(self.value_head)
        grad_norm = self._optimizer_step()
        sums = self.shard.sum({**sums, **{f"stat.{k}": getattr(totals, k) for k in totals.SUMMED}})
        local = {"local.is_weight_max": totals.is_weight_max, "local.logprob_gap": largest_gap}
        return {**sums, **local}, grad_norm

    def _optimizer_step(self) -> float:
        """Clip, step (never with a NaN/Inf gradient: counted in skipped_steps), zero."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = self.shard.clip_grad_norm(params, self.cfg.max_grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN/Inf gradient never reaches the weights
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _balance_experts(self) -> dict[str, float]:
        """Quantile Balancing once per batch (per policy version, whatever ppo_epochs and the
        mini-batches), from the global routing statistics of the batch's first pass: the bias
        stays fixed during the optimizer steps, so the ratio measures only the gradient's
        change, and its step size does not grow with the number of optimizer steps."""
        if self.router_stats is None:
            return {}
        loads = self.router_stats.load_metrics()
        self.router_stats.update_biases()  # the new bias ships with the next weight push
        self.router_stats.reset()
        return {f"moe/{name.removeprefix('policy.model.')}": value for name, value in loads.items()}

    def save(self, directory) -> None:
        from rl.learner.state import save_learner

        save_learner(self, directory)

    def load(self, directory, *, rng: bool = True) -> None:
        from rl.learner.state import load_learner

        load_learner(self, directory, rng=rng)

    def export(self) -> tuple[int, dict[str, np.ndarray], None]:
        """(version, full weights as numpy arrays, None) for the rollout workers; every rank
        must call it (it gathers shards); ranks other than 0 get an empty dict. The checksum is
        left to `rl.run.weights.Publisher`, which hashes while it stores the buckets."""
        weights = self.shard.full_weights(self.trunk)
        return self.version, {k.removeprefix("policy."): v for k, v in weights.items()}, None


def _check_segments(cfg: TrainerConfig, model, context: int = 1) -> None:
    """trainer.segment_tokens and trainer.context_parallel need a K3 policy: only its decoder
    carries state across segments (and shards)."""
    wanted = [
        ("trainer.context_parallel", context > 1, "context parallelism", "relayed between ranks",
         1),
        ("trainer.segment_tokens", bool(cfg.segment_tokens), "segmented training",
         "carried between segments", 0),
    ]  # fmt: skip
    from policy.k3.modeling import K3Model

    for key, on, what, how, off in wanted:
        if on and not isinstance(model.get_decoder(), K3Model):
            raise ConfigError(
                key,
                f"{what} needs a K3 policy (KDA state and MLA latents {how}); "
                f"{type(model).__name__} has none: set it to {off}",
            )


def _router_stats(model):
    """Router statistics for MoE policies (Quantile Balancing); None for dense models."""
    from policy.parallel import RouterStats, moe_blocks

    if not moe_blocks(model):
        return None
    from rl.learner.distributed import init_single

    init_single(next(model.parameters()).device.type)
    return RouterStats(model)


def _pieces(pieces: list[torch.Tensor]):
    """(row index, weight): an empty piece becomes row 0 at weight 0 (collectives stay in step)."""
    for index in pieces:
        yield (index, 1.0) if len(index) else (torch.tensor([0]), 0.0)


def _turn_rewards(batch: TrainBatch) -> torch.Tensor:
    """[N, K]: the trajectory's reward on its last turn (outcome rewards), 0 elsewhere."""
    last_NK = torch.zeros_like(batch.turn_mask_NK)
    count_N = batch.turn_mask_NK.sum(-1).long()
    rows = torch.arange(batch.size, device=count_N.device)[count_N > 0]
    last_NK[rows, count_N[count_N > 0] - 1] = 1
    return last_NK * batch.rewards_N[:, None]


def _dead_letters(source) -> list[str]:
    """Group ids of the entries the source sent to its dead letters since the last call (a
    source that has none, like the tests' in-memory ones, has no `take_dead_letters`)."""
    take = getattr(source, "take_dead_letters", None)
    return take() if take is not None else []


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _group_key(group: TrajectoryGroup) -> tuple:
    """Order groups by id ("<step>-<index>" sorts numerically) so a batch never depends on
    which worker wrote first: bit-exact resume needs the same order every time."""
    return tuple(int(p) if p.isdigit() else p for p in group.group_id.split("-"))
