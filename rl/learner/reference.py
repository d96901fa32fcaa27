"""GRPO on one screen: one learner step of the default `algorithm: grpo` in plain torch.

A reference to read, not used by the product path. It takes the step `Learner.step` takes
(rl/learner/learner.py -> batch.pack -> losses.policy_loss; tests/rl/test_grpo_reference.py
checks the two give the same weights) with a run file's defaults: one pass, the whole batch in
one optimizer step, old logprobs = the rollout's (`off_policy: none`), no KL, no entropy bonus.

Where it differs from textbook GRPO it follows the learner: the std is the unbiased one, a
group whose rewards are all equal (or with one trainable sample) gets advantage 0 but still
counts in the mean over sequences, env/grader errors are left out, and the loss is
seq-mean-token-mean (the mean over sequences of each one's mean over its sampled tokens; a
multi-turn trajectory is one sequence). Logits are divided by the rollout temperature and the
loss is computed in float32, whatever the model's dtype, as the learner does.

Not covered: kl_coef / kl_estimator, entropy_coef, off_policy tis / decoupled (tis_cap),
ppo_epochs > 1, mini_batch_size (several optimizer steps), the other algorithms (dr_grpo,
dapo, gspo, cispo, ppo) and loss_aggregation overrides, micro-batches (the sum is the same),
autocast, segment_tokens, MoE routing replay and expert balancing, several ranks (FSDP2), and
the bookkeeping around the step (stream, ledger, duplicates, metrics, policy version).
Letters: S = samples of a group, N = trajectories, T = target positions, V = vocabulary.
"""

from __future__ import annotations

import torch

from rollout.types import TrajectoryGroup

EPS = 1e-6


def group_advantages(rewards_S: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + eps) within a group; 0 for a group that carries no signal."""
    if len(rewards_S) < 2 or rewards_S.std() == 0:
        return torch.zeros_like(rewards_S)
    return (rewards_S - rewards_S.mean()) / (rewards_S.std() + EPS)


def grpo_step(
    model,
    optimizer: torch.optim.Optimizer,
    groups: list[TrajectoryGroup],
    *,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    max_grad_norm: float = 1.0,
    pad_token_id: int = 0,
) -> dict[str, float]:
    """One optimizer step of `model` (a transformers causal LM, eval mode) on `groups`, which
    must hold a trainable trajectory. The learner's optimizer is AdamW(model.parameters(),
    lr=trainer.lr, weight_decay=trainer.weight_decay); `max_grad_norm` is trainer.max_grad_norm."""
    rows = []  # (trajectory, its advantage), trainable trajectories only
    for group in groups:
        trajs = [t for t in group.trajectories if t.trainable]
        rewards_S = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        rows += zip(trajs, group_advantages(rewards_S).tolist(), strict=True)
    # Pack, right-padded (so the model's default positions are right). Target position t is
    # token t + 1, what tokens <= t predict.
    N, T = len(rows), max(len(t.token_ids) for t, _ in rows)
    ids_NT = torch.full((N, T), pad_token_id, dtype=torch.long)
    attn_NT = torch.zeros((N, T), dtype=torch.long)
    mask_NT, old_logp_NT, adv_NT = (torch.zeros((N, T - 1), dtype=torch.float32) for _ in range(3))
    for n, (traj, adv) in enumerate(rows):
        L = len(traj.token_ids)
        ids_NT[n, :L], attn_NT[n, :L] = torch.tensor(traj.token_ids), 1
        mask_NT[n, : L - 1] = torch.tensor(traj.loss_mask[1:])  # 1 = sampled by the policy
        old_logp_NT[n, : L - 1] = torch.tensor(traj.sample_logprobs[1:])  # behaviour policy
        adv_NT[n, : L - 1] = adv  # every token of a trajectory shares its advantage
    device = next(model.parameters()).device
    ids_NT, attn_NT, mask_NT, old_logp_NT, adv_NT = (
        x.to(device) for x in (ids_NT, attn_NT, mask_NT, old_logp_NT, adv_NT)
    )

    # Logprob of each sampled token under the current policy, at the rollout's temperature.
    logits_NTV = model(input_ids=ids_NT, attention_mask=attn_NT, use_cache=False).logits
    logits_NTV = logits_NTV[:, :-1].float() / temperature
    logp_NT = logits_NTV.log_softmax(-1).gather(-1, ids_NT[:, 1:, None])[..., 0]

    # Clipped surrogate on the per-token ratio pi / pi_rollout, then seq-mean-token-mean.
    ratio_NT = ((logp_NT - old_logp_NT) * mask_NT).exp()
    unclipped_NT = ratio_NT * adv_NT
    clipped_NT = ratio_NT.clamp(1 - clip_low, 1 + clip_high) * adv_NT
    loss_NT = -torch.minimum(unclipped_NT, clipped_NT) * mask_NT
    loss = (loss_NT.sum(-1) / mask_NT.sum(-1).clamp(min=1)).sum() / N

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if torch.isfinite(grad_norm):  # a NaN/Inf gradient never reaches the weights
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clip_fraction = ((clipped_NT < unclipped_NT) * mask_NT).sum() / mask_NT.sum().clamp(min=1)
    return {
        "loss": loss.item(),
        "grad_norm": float(grad_norm),
        "clip_fraction": clip_fraction.item(),
    }
