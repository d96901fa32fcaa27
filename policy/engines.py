"""Pick the rollout engine for a policy model (`rollout_policy`) and the decode session for a
rollout engine (`open_session`): the one place that knows every engine and session."""

from __future__ import annotations

from policy.hf import HFPolicy
from policy.hf_session import HFSession
from policy.k3.engine import K3Policy, K3Session
from policy.k3.engine.exact import ExactSession
from policy.k3.modeling import K3ForCausalLM
from policy.session import DecodeSession


def rollout_policy(
    model,
    *,
    pad_token_id: int,
    seed: int = 0,
    max_batch: int = 128,
    record_routing: bool = False,
    exact: bool = False,
    paged: bool = True,
):
    """The fastest rollout engine for `model`: K3Policy (cached, continuously batched) for the
    K3 policy, HFPolicy (generic KV-cached sampling) for any other causal LM. `exact` (K3 only):
    sessions whose logprobs equal the learner's bit for bit (policy/k3/engine/exact.py); `paged`
    (K3 only): sessions keep MLA latents in pages (policy/k3/paged.py)."""
    if exact and next(model.parameters()).device.type != "cpu":
        raise ValueError("exact logprobs are a CPU mode (rollout.device: cpu)")
    if isinstance(model, K3ForCausalLM):
        return K3Policy(
            model,
            pad_token_id=pad_token_id,
            seed=seed,
            max_batch=max_batch,
            record_routing=record_routing,
            exact=exact,
            paged=paged,
        )
    if exact:
        raise ValueError("exact logprobs need the K3 policy (policy.model_type: agentrl_k3)")
    return HFPolicy(model, pad_token_id=pad_token_id, seed=seed)


def open_session(policy) -> DecodeSession:
    """The session for an existing policy, sharing its model, generator, version and routing
    setting: K3Policy -> K3Session (ExactSession when built with exact=True); HFPolicy ->
    HFSession."""
    if isinstance(policy, K3Policy):
        return ExactSession(policy) if policy.exact else K3Session(policy)
    if isinstance(policy, HFPolicy):
        return HFSession(policy)
    raise TypeError(f"no decode session for {type(policy).__name__}")
