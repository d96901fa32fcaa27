"""Pick the rollout engine for a policy model."""

from __future__ import annotations

from policy.hf import HFPolicy
from policy.k3.engine import K3Policy
from policy.k3.modeling import K3ForCausalLM


def rollout_policy(
    model, *, pad_token_id: int, seed: int = 0, max_batch: int = 128, record_routing: bool = False
):
    """The fastest rollout engine for `model`: K3Policy (cached, continuously batched) for the
    K3 policy, HFPolicy (generic KV-cached sampling) for any other causal LM."""
    if isinstance(model, K3ForCausalLM):
        return K3Policy(
            model,
            pad_token_id=pad_token_id,
            seed=seed,
            max_batch=max_batch,
            record_routing=record_routing,
        )
    return HFPolicy(model, pad_token_id=pad_token_id, seed=seed)
