"""Helpers of a learner step (rl/learner/learner.py): the mini-batch schedule, decoupled PPO's
per-token weights, what a batch says about asynchrony (staleness, generated length) and the
averaging of
per-optimizer-step metrics. Letters: N = trajectories, T = target positions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl.learner.batch import TrainBatch
from rl.learner.distributed import Shard

STALENESS_BINS = 4
"""Lags 0..3 are counted one by one; larger ones share `learner/staleness_lag4plus`."""


def mini_batches(order_N: torch.Tensor, size: int | None) -> list[torch.Tensor]:
    """`order_N` cut into ceil(N / size) near-equal mini-batches (one optimizer step each); the
    whole of it when `size` is None. Batches shrink when groups are dropped, so the pieces are
    balanced rather than `size` rows and a remainder."""
    if size is None or size >= len(order_N):
        return [order_N]
    return list(torch.tensor_split(order_N, -(-len(order_N) // size)))


def decoupled_weights(
    prox_logp_NT: torch.Tensor,
    behav_logp_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    cap: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """w = min(pi_prox / mu, cap) per token (untruncated when cap is None) and its statistics."""
    raw_NT = (prox_logp_NT - behav_logp_NT).exp() * (mask_NT > 0)
    weight_NT = raw_NT if cap is None else raw_NT.clamp(max=cap)
    sampled = mask_NT > 0
    truncated = 0.0 if cap is None else float(((raw_NT > cap) & sampled).sum())
    return weight_NT, weight_metrics(
        float((weight_NT * mask_NT).sum()),
        truncated,
        float(raw_NT[sampled].max()) if sampled.any() else 0.0,
        float(mask_NT.sum()),
    )


def weight_metrics(weight_sum: float, truncated: float, largest: float, tokens: float) -> dict:
    """Importance weights: mean of the applied (truncated) weight, the largest untruncated one,
    and the share of tokens whose weight was truncated at the cap."""
    tokens = max(tokens, 1.0)
    return {
        "learner/tis_weight_mean": weight_sum / tokens,
        "learner/tis_weight_max": largest,
        "learner/tis_truncated_fraction": truncated / tokens,
    }


def staleness_metrics(
    versions_NT: torch.Tensor | None, mask_NT: torch.Tensor, version: int
) -> dict[str, float]:
    """Per sampled token, lag = learner version - the version that sampled it: mean, max, and
    counts of tokens per lag 0, 1, 2, 3 and >= 4. Tokens without a version are left out."""
    if versions_NT is None:
        return {}
    known = (mask_NT > 0) & (versions_NT >= 0)
    lags = (version - versions_NT[known]).clamp(min=0)
    out = {
        "learner/staleness_mean": float(lags.float().mean()) if len(lags) else 0.0,
        "learner/staleness_max": float(lags.max()) if len(lags) else 0.0,
    }
    counts = torch.bincount(lags.clamp(max=STALENESS_BINS), minlength=STALENESS_BINS + 1)
    for lag in range(STALENESS_BINS):
        out[f"learner/staleness_lag{lag}"] = float(counts[lag])
    out[f"learner/staleness_lag{STALENESS_BINS}plus"] = float(counts[STALENESS_BINS])
    return out


def length_metrics(mask_NT: torch.Tensor) -> dict[str, float]:
    """Sampled tokens per trajectory: mean, median, 90th percentile (linear), max."""
    lengths_N = (mask_NT > 0).sum(-1).double()
    q = torch.tensor([0.5, 0.9], dtype=torch.float64, device=lengths_N.device)
    p50, p90 = torch.quantile(lengths_N, q).tolist()
    return {
        "learner/gen_len_mean": float(lengths_N.mean()),
        "learner/gen_len_p50": p50,
        "learner/gen_len_p90": p90,
        "learner/gen_len_max": float(lengths_N.max()),
    }


def step_metrics(sums: dict[str, float], grad_norm: float) -> dict[str, float]:
    """One optimizer step's metrics from its (all-rank) sums."""
    tokens = max(sums["stat.tokens"], 1.0)
    return {
        "learner/loss": sums["loss"],
        "learner/entropy": sums["entropy"] / tokens,
        "learner/clip_fraction": sums["stat.clipped_tokens"] / tokens,
        "learner/approx_kl": sums["stat.approx_kl_sum"] / tokens,
        "learner/ratio_mean": sums["stat.ratio_sum"] / tokens,
        "learner/grad_norm": grad_norm,
        "learner/ref_kl": sums["stat.ref_kl_sum"] / tokens,
        "learner/value_loss": sums["value_loss"],
        "learner/tis_weight_mean": sums["stat.is_weight_sum"] / tokens,
        "learner/tis_truncated_fraction": sums["stat.truncated_tokens"] / tokens,
    }


def average(steps: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean over the optimizer steps of one batch."""
    return {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]} if steps else {}


def share_rows(shard: Shard, *tensors: torch.Tensor | None) -> None:
    """Each rank filled its own rows (zeros elsewhere): after this every rank has all of them."""
    if shard.world == 1:
        return
    for tensor in tensors:
        if tensor is not None:
            dist.all_reduce(tensor, group=shard.data_group)  # context ranks: the same rows


def largest(shard: Shard, value: float) -> float:
    """The largest `value` over the ranks."""
    if shard.world == 1:
        return value
    buffer = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    return float(buffer)


def trained_outcomes(groups: list) -> dict[str, float]:
    """Reward (mean, std) and success of the trajectories a step trained on: what the console
    shows when no rollout finished during the step (the first async step after a resume trains
    on groups buffered before the crash)."""
    trajs = [t for g in groups for t in g.trajectories if t.trainable]
    if not trajs:
        return {}
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64)
    return {
        "learner/reward_mean": float(rewards.mean()),
        "learner/reward_std": float(rewards.std(unbiased=False)),
        "learner/success_rate": sum(bool(t.success) for t in trajs) / len(trajs),
    }


def logprob_gap(
    logp_NT: torch.Tensor,
    behav_logp_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    versions_NT: torch.Tensor | None,
    version: int,
) -> float:
    """max |learner - rollout| logprob over the sampled tokens (mask_NT > 0) that the learner's
    current weights sampled (versions_NT == version; every one when versions are unknown): how
    far the two engines differ on the same tokens and weights. -1 when no such token."""
    same_NT = mask_NT > 0
    if versions_NT is not None:
        same_NT = same_NT & (versions_NT == version)
    if not same_NT.any():
        return -1.0
    return float((logp_NT.detach().float() - behav_logp_NT.float()).abs()[same_NT].max())


def routing_mismatch(routed_MXK: torch.Tensor, mb: TrainBatch, scale: float) -> dict[str, float]:
    """Per MoE layer: positions whose expert set differs between the learner's forward and the
    rollout engine's record (X = B*T positions)."""
    layers, _, k = routed_MXK.shape
    live_MBTK = routed_MXK.view(layers, *mb.input_ids_NT.shape, k).sort(-1).values
    recorded_MBTK = mb.routes_NTMK.long().permute(2, 0, 1, 3).sort(-1).values
    valid_BT = mb.routed_NT & (mb.attention_mask_NT > 0)
    measured_MBT = valid_BT & (live_MBTK >= 0).all(-1)  # -1: a position the layer skipped
    differs_MBT = (live_MBTK != recorded_MBTK).any(-1) & measured_MBT
    out = {"routing.positions": float(valid_BT.sum()) * scale}
    for m in range(layers):
        out[f"routing.mismatch.{m}"] = float(differs_MBT[m].sum()) * scale
        out[f"routing.measured.{m}"] = float(measured_MBT[m].sum()) * scale
    return out


def add_sums(sums: dict[str, float], values: dict[str, float]) -> None:
    """sums[key] += value for every item of values (missing keys start at 0)."""
    for key, value in values.items():
        sums[key] = sums.get(key, 0.0) + value


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """moe/routing_mismatch (pooled) and per layer, from routing_mismatch's summed counts."""
    positions = sums.get("routing.positions", 0.0)
    if not positions:
        return {}
    layers = sorted(k.rsplit(".", 1)[1] for k in sums if k.startswith("routing.mismatch."))
    measured = {m: sums.get(f"routing.measured.{m}", positions) for m in layers}
    rates = {  # over the positions each layer routed (the last one, under loss_positions_only:
        f"moe/routing_mismatch_layer{m}": sums[f"routing.mismatch.{m}"] / measured[m]  # the loss
        for m in layers  # positions only); a layer that routed none has no rate
        if measured[m] > 0
    }
    total = sum(measured.values())
    if total > 0:  # pooled over the layers' positions
        rates["moe/routing_mismatch"] = sum(sums[f"routing.mismatch.{m}"] for m in layers) / total
    return rates
