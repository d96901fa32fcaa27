"""Pack trajectory groups into padded training tensors.

Letters: N = trajectories, T = longest trajectory, G = groups, S = samples per group, K = turns.
Targets are shifted: position t of `loss_mask_NT`, `old_logp_NT` and `adv_NT` refers to the token
at t + 1 (what the model predicts from tokens <= t), so they line up with `token_logprobs`.
A turn starts at a target position whose mask is 1 after a 0; the hidden state there is where
PPO's value head estimates the value of the state the turn acts in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from rl.learner.advantages import centred_advantages, grpo_advantages
from rollout.types import TrajectoryGroup

GROUP_ADVANTAGES = {"grpo": grpo_advantages, "centred": centred_advantages}


@dataclass(slots=True)
class TrainBatch:
    input_ids_NT: torch.Tensor
    attention_mask_NT: torch.Tensor
    loss_mask_NT: torch.Tensor
    """[N, T-1] 1 where the target token was sampled by the policy."""
    old_logp_NT: torch.Tensor
    """[N, T-1] logprob of each target under the rollout (behaviour) policy."""
    adv_NT: torch.Tensor
    """[N, T-1] the advantage of each target token."""
    lengths_N: torch.Tensor
    versions_N: torch.Tensor
    """[N] lowest policy version that sampled a token of the trajectory."""
    rewards_N: torch.Tensor
    turn_pos_NK: torch.Tensor
    """[N, K] target position where each turn starts (0 where `turn_mask_NK` is 0)."""
    turn_mask_NK: torch.Tensor
    routes_NTMK: torch.Tensor | None = None
    """MoE policies: int16 [N, T, M, K] experts the rollout engine routed each input position
    to, per MoE layer (int16 to keep long batches small: convert with `.long()` per micro-batch
    where they index); -1 (route live) where there is no record: past a trajectory's recorded
    positions and on every position of a trajectory without records. None when no trajectory
    has records."""
    routed_NT: torch.Tensor | None = None
    """[N, T] True where `routes_NTMK` holds a real record (replayed with routing replay; the
    positions the mismatch metric compares)."""
    versions_NT: torch.Tensor | None = None
    """[N, T-1] policy version that sampled each target token (-1 where it was not sampled)."""
    groups_N: torch.Tensor | None = None
    """[N] each row's group (its index in the packed list of groups)."""

    @property
    def size(self) -> int:
        return self.input_ids_NT.shape[0]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on `device` (itself when they already are)."""
        if self.input_ids_NT.device == torch.device(device):
            return self
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return TrainBatch(*(None if x is None else x.to(device) for x in values))

    def rows(self, index: torch.Tensor, width: int = 0) -> TrainBatch:
        """A micro-batch, trimmed to its own longest sequence (or to `width`, if longer: right
        padding, masked, also past the batch's own width)."""
        width = max(int(self.lengths_N[index].max()), width)

        def cols(tensor, size, fill=0):
            part = tensor[index, :size]
            if part.shape[1] < size:  # past the batch's width: pad (routes: -1, no record)
                shape = (part.shape[0], size - part.shape[1], *part.shape[2:])
                part = torch.cat([part, part.new_full(shape, fill)], 1)
            return part

        return TrainBatch(
            cols(self.input_ids_NT, width),
            cols(self.attention_mask_NT, width),
            cols(self.loss_mask_NT, width - 1),
            cols(self.old_logp_NT, width - 1),
            cols(self.adv_NT, width - 1),
            self.lengths_N[index],
            self.versions_N[index],
            self.rewards_N[index],
            self.turn_pos_NK[index],
            self.turn_mask_NK[index],
            None if self.routes_NTMK is None else cols(self.routes_NTMK, width, -1),
            None if self.routed_NT is None else cols(self.routed_NT, width),
            None if self.versions_NT is None else cols(self.versions_NT, width - 1),
            None if self.groups_N is None else self.groups_N[index],
        )


def drop_flat_groups(groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], int]:
    """DAPO's filter: groups whose trainable rewards are all equal carry no signal."""
    kept = []
    for group in groups:
        rewards = {t.reward for t in group.trajectories if t.trainable}
        if len(rewards) > 1:
            kept.append(group)
    return kept, len(groups) - len(kept)


def group_advantages(groups: list[TrajectoryGroup], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages [G, S] and validity [G, S] (ragged groups padded invalid)."""
    width = max(len(g.trajectories) for g in groups)
    rewards = torch.zeros(len(groups), width, dtype=torch.float64)
    valid = torch.zeros(len(groups), width, dtype=torch.bool)
    for i, group in enumerate(groups):
        for j, traj in enumerate(group.trajectories):
            rewards[i, j], valid[i, j] = traj.reward, traj.trainable
    if kind == "none":
        return torch.zeros_like(rewards), valid
    return GROUP_ADVANTAGES[kind](rewards, valid), valid


def pack(
    groups: list[TrajectoryGroup], *, pad_token_id: int, advantages: str = "grpo"
) -> TrainBatch:
    """Every trainable trajectory of `groups`, right-padded, with its group-relative advantage
    (`advantages`: grpo | centred | none, the last for PPO, which fills them in later)."""
    adv_GS, valid_GS = group_advantages(groups, advantages)
    chosen = [
        (t, float(adv_GS[i, j]))
        for i, g in enumerate(groups)
        for j, t in enumerate(g.trajectories)
        if valid_GS[i, j]
    ]
    if not chosen:
        raise ValueError("no trainable trajectory in the batch (all errored)")
    n, width = len(chosen), max(len(t.token_ids) for t, _ in chosen)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask, old, adv = (torch.zeros((n, width - 1)) for _ in range(3))
    token_versions = torch.full((n, width - 1), -1, dtype=torch.long)
    starts = []
    for row, (traj, a) in enumerate(chosen):
        length = len(traj.token_ids)
        ids[row, :length] = torch.tensor(traj.token_ids)
        attn[row, :length] = 1
        mask[row, : length - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float32)
        old[row, : length - 1] = torch.tensor(traj.sample_logprobs[1:], dtype=torch.float32)
        adv[row, : length - 1] = a
        sampled_by = traj.token_versions[1:length]
        token_versions[row, : len(sampled_by)] = torch.tensor(sampled_by, dtype=torch.long)
        starts.append(_turn_starts(traj.loss_mask[1:]))
    turns = max(1, max(len(s) for s in starts))
    turn_pos = torch.zeros((n, turns), dtype=torch.long)
    turn_mask = torch.zeros((n, turns), dtype=torch.float32)
    for row, s in enumerate(starts):
        turn_pos[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        turn_mask[row, : len(s)] = 1
    versions = torch.tensor(
        [min((v for v in t.token_versions if v >= 0), default=-1) for t, _ in chosen]
    )
    rewards = torch.tensor([t.reward for t, _ in chosen], dtype=torch.float32)
    routes, routed = _routes([t for t, _ in chosen], width)
    return TrainBatch(
        ids,
        attn,
        mask,
        old,
        adv,
        attn.sum(-1),
        versions,
        rewards,
        turn_pos,
        turn_mask,
        routes,
        routed,
        token_versions,
        valid_GS.nonzero()[:, 0],  # each row's group, in the order of `chosen`
    )


def _routes(trajs: list, width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """int16 [N, T, M, K] recorded expert choices (-1 where none: routed live) and [N, T] record
    mask; None, None when no trajectory has records. A record may be an int16 array [T-1, M, K]
    (what rollouts produce) or nested lists."""
    records = [_record(t.routed_experts) for t in trajs]
    shaped = next((r for r in records if r is not None), None)
    if shaped is None:
        return None, None
    routes_NTMK = torch.full((len(trajs), width, *shaped.shape[1:]), -1, dtype=torch.int16)
    routed_NT = torch.zeros((len(trajs), width), dtype=torch.bool)
    out_NTMK = routes_NTMK.numpy()  # the same memory: fill it without a torch copy per record
    for row, record_TMK in enumerate(records):
        if record_TMK is None:
            continue  # e.g. sampled without record_routing: its rows route live
        record_TMK = record_TMK[:width]
        out_NTMK[row, : len(record_TMK)] = record_TMK
        routed_NT[row, : len(record_TMK)] = True
    return routes_NTMK, routed_NT


def _record(routed_experts) -> np.ndarray | None:
    """A trajectory's routes as int16 [T-1, M, K]; None when it has none (None or empty)."""
    if routed_experts is None or len(routed_experts) == 0:
        return None
    record_TMK = np.asarray(routed_experts, dtype=np.int16)
    if record_TMK.ndim != 3:
        raise ValueError(f"routed_experts must be [T-1, M, K], got shape {record_TMK.shape}")
    return record_TMK


def _turn_starts(target_mask: list[int]) -> list[int]:
    return [p for p, m in enumerate(target_mask) if m and (p == 0 or not target_mask[p - 1])]


def spread_turn_values(values_NK: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """[N, T-1]: each sampled token gets the value of the turn it belongs to."""
    out = torch.zeros_like(batch.loss_mask_NT)
    width = out.shape[1]
    for k in range(batch.turn_pos_NK.shape[1]):
        start = batch.turn_pos_NK[:, k]
        positions = torch.arange(width, device=out.device)[None, :]
        after = (positions >= start[:, None]) & (batch.turn_mask_NK[:, k : k + 1] > 0)
        out = torch.where(after, values_NK[:, k : k + 1].to(out.dtype), out)
    return out * batch.loss_mask_NT
