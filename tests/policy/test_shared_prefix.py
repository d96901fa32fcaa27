"""Shared-prefix forwards (policy/shared_prefix.py): a group's common prompt run once gives the
logprobs, entropy, gradients and routing records of the whole forward, in float64, for a
transformers decoder and for K3 (with and without routing replay); the plan finds the groups."""

from __future__ import annotations

import pytest
import torch

from policy.logprobs import TokenLogprobs
from policy.shared_prefix import plan_shared_prefix
from tests.policy.test_session import _one_thread, k3_model, qwen_model  # noqa: F401 (autouse)

VOCAB = 512


def grouped_batch(groups=3, size=4, prompt=24, seed=0):
    """Rows of `groups` groups (each its own prompt, with its rows in a row), own tails of 3-12
    tokens, right padding; select: the tails' predicting positions."""
    g = torch.Generator().manual_seed(seed)
    rows, masks, selects = [], [], []
    width = prompt + 12
    for _ in range(groups):
        head = torch.randint(1, VOCAB, (prompt,), generator=g)
        for _ in range(size):
            tail = int(torch.randint(3, 13, (1,), generator=g))
            ids = torch.zeros(width, dtype=torch.long)
            ids[:prompt] = head
            ids[prompt : prompt + tail] = torch.randint(1, VOCAB, (tail,), generator=g)
            mask = (torch.arange(width) < prompt + tail).long()
            select = torch.zeros(width - 1, dtype=torch.bool)
            select[prompt - 1 : prompt + tail - 1] = True
            rows.append(ids), masks.append(mask), selects.append(select)
    return torch.stack(rows), torch.stack(masks), torch.stack(selects)


def test_the_plan_finds_each_groups_prompt_and_declines_where_nothing_is_shared():
    """Groups by prompt (and by replayed routes, when given); None without a shared prefix."""
    ids, mask, select = grouped_batch()
    plan = plan_shared_prefix(ids, mask, select)
    assert plan.length == 23  # the last prompt token predicts the first sampled one
    assert sorted(plan.rows_U.tolist()) == [0, 4, 8]  # each group's first row
    assert torch.equal(plan.inverse_B, plan.inverse_B[plan.rows_U][plan.inverse_B])
    assert plan.saved_tokens == (12 - 3) * 23
    distinct = ids.clone()
    distinct[:, 0] = torch.arange(ids.shape[0]) + 1
    assert plan_shared_prefix(distinct, mask, select) is None
    routes = torch.zeros(*ids.shape, 2, 2, dtype=torch.int16)
    assert plan_shared_prefix(ids, mask, select, routes).rows_U.numel() == 3
    routes[1, 5, 0, 0] = 3  # one sample's prompt routed otherwise (an older policy version)
    assert plan_shared_prefix(ids, mask, select, routes).rows_U.numel() == 4
    early = select.clone()
    early[0, 2] = True  # a loss position inside the prompt: too short a prefix
    assert plan_shared_prefix(ids, mask, early) is None


def _run(trunk, ids, mask, select, plan, **kwargs):
    for p in trunk.parameters():
        p.grad = None
    logp, entropy, _, routed = trunk(ids, mask, 1.0, select, keep_hidden=False, prefix=plan,
                                     **kwargs)  # fmt: skip
    weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=logp.dtype).view_as(logp)
    ((logp * weights + 0.1 * entropy) * select).sum().backward()
    grads = {n: p.grad.clone() for n, p in trunk.named_parameters() if p.grad is not None}
    return logp * select, entropy * select, grads, routed


@pytest.mark.parametrize("kind", ["qwen3", "k3", "k3-replay"])
def test_shared_prefix_matches_the_whole_forward_in_float64(kind):
    model = qwen_model() if kind == "qwen3" else k3_model()
    trunk = TokenLogprobs(model.double())
    ids, mask, select = grouped_batch()
    plan = plan_shared_prefix(ids, mask, select)
    kwargs = {}
    if kind != "qwen3":
        kwargs["return_routing"] = True
    if kind == "k3-replay":  # a record per position (the group's rows share the prompt's)
        _, _, _, routed = trunk(ids, mask, 1.0, select, keep_hidden=False, return_routing=True)
        routes = routed.unflatten(1, ids.shape)
        kwargs["replay_experts"] = [routes[m] for m in range(routes.shape[0])]
    whole = _run(trunk, ids, mask, select, None, **kwargs)
    shared = _run(trunk, ids, mask, select, plan, **kwargs)
    torch.testing.assert_close(shared[0], whole[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(shared[1], whole[1], rtol=1e-10, atol=1e-10)
    assert shared[2].keys() == whole[2].keys()
    # transformers' RMSNorm computes in float32 even in a float64 model, and the shared prefix
    # sums its rows' key gradients before k_norm's backward instead of after: float32 rounding
    rtol, atol = (1e-5, 1e-6) if kind == "qwen3" else (1e-8, 1e-10)
    for name, grad in whole[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=rtol, atol=atol, msg=name)
    if kind != "qwen3":  # the routing record covers every real position
        real = mask.bool().reshape(-1)
        assert torch.equal(shared[3][:, real], whole[3][:, real])
