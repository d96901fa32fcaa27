"""Exact mode in the learner (`trainer.exact_logprobs`, policy/k3/engine/exact.py): the values of
the logprobs in the loss come from the rollout engine's own computation (every sequence alone,
one token per forward), so they equal the recorded ones bit for bit for the same tokens and
weights; the gradient is that of the learner's usual forward (the two agree to ~1e-6 in
float32: learner/logprob_delta_max outside exact mode). Letters: N rows, T target positions."""

from __future__ import annotations

import torch

from policy.k3.engine import K3Policy
from policy.k3.engine.exact import exact_logprobs
from policy.k3.modeling import K3ForCausalLM
from rl.config.errors import ConfigError


def exact_scorer(model) -> K3Policy:
    """A K3Policy over the learner's own model (the same fused path as the rollout workers')."""
    if not isinstance(model, K3ForCausalLM):
        raise ConfigError(
            "trainer.exact_logprobs",
            f"needs the K3 policy, not {type(model).__name__}; or set it to false",
        )
    if next(model.parameters()).device.type != "cpu":
        raise ConfigError("trainer.exact_logprobs", "is a CPU mode; or set it to false")
    training = model.training
    scorer = K3Policy(model)  # sets eval mode: put the learner's back
    model.train(training)
    return scorer


def exact_values(
    scorer: K3Policy,
    mb,
    logp_NT: torch.Tensor,
    version: int,
    temperature: float,
) -> torch.Tensor:
    """[N, T-1]: at the loss positions whose token the current weights sampled (versions_NT ==
    `version`; all when unknown), the exact logprobs; the learner's own elsewhere (older
    tokens: the usual forward, replayed where routing replay is on). Carries `logp_NT`'s
    gradient (straight through: exact + logp - logp.detach()). `mb`: a TrainBatch."""
    chosen_NT = mb.loss_mask_NT > 0
    if mb.versions_NT is not None:
        chosen_NT = chosen_NT & (mb.versions_NT == version)
    exact_NT = logp_NT.detach().clone()
    for row in range(mb.input_ids_NT.shape[0]):
        targets = chosen_NT[row].nonzero()[:, 0].tolist()
        if not targets:
            continue
        length = int(mb.attention_mask_NT[row].sum())  # right-padded (rl/learner/batch.py)
        tokens = mb.input_ids_NT[row, :length].tolist()
        values_T = exact_logprobs(scorer, tokens, targets, temperature)
        exact_NT[row, targets] = values_T[targets].to(exact_NT.dtype)
    return exact_NT + (logp_NT - logp_NT.detach())
