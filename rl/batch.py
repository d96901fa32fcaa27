"""Pack trajectory groups into padded training tensors.

Letters: N = trajectories, T = longest trajectory, G = groups, S = samples per group.
Targets are shifted: position t of `loss_mask_NT`, `old_logp_NT` and `adv_NT` refers to the token
at t + 1 (what the model predicts from tokens <= t), so they line up with `token_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.advantages import grpo_advantages
from rollout.types import TrajectoryGroup


@dataclass(slots=True)
class TrainBatch:
    input_ids_NT: torch.Tensor
    attention_mask_NT: torch.Tensor
    loss_mask_NT: torch.Tensor
    """[N, T-1] 1 where the target token was sampled by the policy."""
    old_logp_NT: torch.Tensor
    """[N, T-1] logprob of each target under the rollout policy."""
    adv_NT: torch.Tensor
    """[N, T-1] the trajectory's advantage on each of its tokens."""
    lengths_N: torch.Tensor
    versions_N: torch.Tensor
    """[N] lowest policy version that sampled a token of the trajectory."""

    @property
    def size(self) -> int:
        return self.input_ids_NT.shape[0]

    def rows(self, index: torch.Tensor) -> TrainBatch:
        """A micro-batch, trimmed to its own longest sequence."""
        width = int(self.lengths_N[index].max())
        return TrainBatch(
            self.input_ids_NT[index, :width],
            self.attention_mask_NT[index, :width],
            self.loss_mask_NT[index, : width - 1],
            self.old_logp_NT[index, : width - 1],
            self.adv_NT[index, : width - 1],
            self.lengths_N[index],
            self.versions_N[index],
        )


def group_advantages(groups: list[TrajectoryGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages [G, S] and validity [G, S] (groups may differ in size: padded invalid)."""
    width = max(len(g.trajectories) for g in groups)
    rewards = torch.zeros(len(groups), width, dtype=torch.float64)
    valid = torch.zeros(len(groups), width, dtype=torch.bool)
    for i, group in enumerate(groups):
        for j, traj in enumerate(group.trajectories):
            rewards[i, j], valid[i, j] = traj.reward, traj.trainable
    return grpo_advantages(rewards, valid), valid


def pack(groups: list[TrajectoryGroup], *, pad_token_id: int) -> TrainBatch:
    """Every trainable trajectory of `groups`, right-padded, with its group advantage."""
    adv_GS, valid_GS = group_advantages(groups)
    trajs, advs = [], []
    for i, group in enumerate(groups):
        for j, traj in enumerate(group.trajectories):
            if valid_GS[i, j]:
                trajs.append(traj)
                advs.append(float(adv_GS[i, j]))
    if not trajs:
        raise ValueError("no trainable trajectory in the batch (all errored)")
    width = max(len(t.token_ids) for t in trajs)
    n = len(trajs)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1), dtype=torch.float32)
    old = torch.zeros((n, width - 1), dtype=torch.float32)
    adv = torch.zeros((n, width - 1), dtype=torch.float32)
    for row, (traj, a) in enumerate(zip(trajs, advs, strict=True)):
        length = len(traj.token_ids)
        ids[row, :length] = torch.tensor(traj.token_ids)
        attn[row, :length] = 1
        mask[row, : length - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float32)
        old[row, : length - 1] = torch.tensor(traj.sample_logprobs[1:], dtype=torch.float32)
        adv[row, : length - 1] = a
    lengths = attn.sum(-1)
    versions = torch.tensor(
        [min((v for v in t.token_versions if v >= 0), default=-1) for t in trajs]
    )
    return TrainBatch(ids, attn, mask, old, adv, lengths, versions)
