"""Router (k3-architecture.md 5.2/5.3) and routing replay (section 8)."""

from __future__ import annotations

import pytest
import torch

from policy.k3.routing import (
    MAX_PASSES,
    Routing,
    TopKRouter,
    combine_weights,
    select_experts,
    top_k_indices,
)

D, E, K, T = 16, 8, 2, 64


def make_router(**kwargs) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(D, E, K, routed_scaling_factor=2.5, init_std=0.5, **kwargs).double()
    return router


def tokens(num=T, seed=1) -> torch.Tensor:
    return torch.randn(num, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_router_reads_the_full_hidden_state():
    router = make_router()
    assert router.weight.shape == (E, D)
    routing = router(tokens())
    assert isinstance(routing, Routing)
    assert routing.scores_TE.shape == (T, E) and routing.indices_TK.shape == (T, K)
    assert routing.indices_TK.dtype == torch.long
    with pytest.raises(RuntimeError):
        router(torch.randn(T, D // 2, dtype=torch.float64))  # e.g. a latent-width input


def test_bias_is_a_frozen_buffer_not_a_parameter():
    router = make_router()
    assert [name for name, _ in router.named_parameters()] == ["weight"]
    assert "e_score_correction_bias" in router.state_dict()
    router.e_score_correction_bias.copy_(torch.randn(E, dtype=torch.float64))
    before = router.e_score_correction_bias.clone()
    router(tokens())[0].sum().backward()
    assert torch.equal(router.e_score_correction_bias, before)


def test_scores_are_float32_for_low_precision_inputs():
    router = TopKRouter(D, E, K)
    routing = router(torch.randn(T, D).bfloat16())
    assert routing.scores_TE.dtype == torch.float32 and routing.weights_TK.dtype == torch.float32


def test_selection_is_invariant_to_a_constant_bias_shift():
    router, x = make_router(), tokens()
    router.e_score_correction_bias.copy_(torch.randn(E, dtype=torch.float64) * 0.1)
    base = router(x)
    router.e_score_correction_bias.add_(3.7)
    shifted = router(x)
    assert torch.equal(base.indices_TK, shifted.indices_TK)
    assert torch.equal(base.weights_TK, shifted.weights_TK)


def test_bias_chooses_experts_but_weights_ignore_it():
    router, x = make_router(), tokens()
    unbiased = router(x)
    router.e_score_correction_bias[5] = 10.0  # expert 5 now wins every token
    biased = router(x)
    assert (biased.indices_TK == 5).any(dim=1).all()
    assert not (unbiased.indices_TK == 5).any(dim=1).all()
    # for a fixed selection the weights are a function of the unbiased scores only
    want = combine_weights(unbiased.scores_TE, biased.indices_TK, True, 2.5)
    assert torch.equal(biased.weights_TK, want)
    replayed = router(x, replay_indices_TK=unbiased.indices_TK)
    assert torch.equal(replayed.weights_TK, unbiased.weights_TK)


def test_weights_are_renormalised_scores_times_scaling_factor():
    router, x = make_router(), tokens()
    routing = router(x)
    picked = torch.sigmoid(x @ router.weight.T).gather(1, routing.indices_TK)
    assert (routing.weights_TK - 2.5 * picked / picked.sum(1, keepdim=True)).abs().max() < 1e-12
    assert (routing.weights_TK.sum(1) - 2.5).abs().max() < 1e-12
    raw = make_router(renormalize=False)(x)
    assert (raw.weights_TK - 2.5 * raw.scores_TE.gather(1, raw.indices_TK)).abs().max() == 0


def test_selection_is_the_topk_of_biased_scores():
    router, x = make_router(), tokens()
    router.e_score_correction_bias.copy_(torch.randn(E, dtype=torch.float64) * 0.2)
    routing = router(x)
    biased = routing.scores_TE + router.e_score_correction_bias
    chosen = biased.gather(1, routing.indices_TK).min(1).values
    rest = biased.scatter(1, routing.indices_TK, float("-inf")).max(1).values
    assert (chosen > rest).all()


@pytest.mark.parametrize("k", range(1, MAX_PASSES + 2))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_indices_are_torch_topk_and_ties_go_to_the_lower_index(k, dtype):
    x = torch.rand(257, 48, generator=torch.Generator().manual_seed(k), dtype=dtype)
    before = x.clone()
    assert torch.equal(top_k_indices(x, k), x.topk(k, dim=-1).indices)
    assert torch.equal(x, before)  # the caller's scores are never masked in place
    tied = torch.zeros(3, 8, dtype=dtype)
    tied[:, [6, 2, 4]] = 1.0
    want = torch.tensor([2, 4, 6, 0, 1, 3])[:k]
    if k <= MAX_PASSES:  # the argmax passes: equal values in index order
        assert torch.equal(top_k_indices(tied, k), want.expand(3, k))


def test_softmax_scores_are_supported():
    routing = make_router(score_func="softmax")(tokens())
    assert (routing.scores_TE.sum(1) - 1).abs().max() < 1e-12
    assert (routing.weights_TK.sum(1) - 2.5).abs().max() < 1e-12


def test_group_limited_selection():
    biased = torch.rand(T, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(select_experts(biased, K, 1, 1), biased.topk(K, dim=1).indices)
    idx = select_experts(biased, K, num_groups=4, topk_group=1)  # groups of 2 experts
    assert (idx[:, 0] // 2 == idx[:, 1] // 2).all()
    best_group = biased.view(T, 4, 2).sum(-1).argmax(-1)  # top-2 sum of a pair = its sum
    assert torch.equal(idx[:, 0] // 2, best_group)


def test_replay_reproduces_the_recorded_selection_under_perturbed_weights():
    router, x = make_router(), tokens()
    recorded = router(x).indices_TK
    with torch.no_grad():
        router.weight.add_(torch.randn(E, D, dtype=torch.float64) * 0.5)
    live = router(x)
    assert not torch.equal(live.indices_TK, recorded)  # the perturbation changes decisions
    replayed = router(x, replay_indices_TK=recorded)
    assert torch.equal(replayed.indices_TK, recorded)
    # weights follow the live (perturbed) dense scores at the replayed indices
    want = combine_weights(live.scores_TE, recorded, True, 2.5)
    assert torch.equal(replayed.weights_TK, want)


def test_replayed_routing_gives_the_router_gradients_on_replayed_experts():
    router, x = make_router(), tokens()
    recorded = router(x).indices_TK
    with torch.no_grad():
        router.weight.add_(torch.randn(E, D, dtype=torch.float64) * 0.5)
    live_sets = router(x).indices_TK
    replayed = router(x, replay_indices_TK=recorded)
    target = torch.randn(T, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (replayed.weights_TK * target).sum().backward()
    grad = router.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # experts the live top-k would NOT pick for some token still get gradient from that token
    drifted_TK = ~(recorded.unsqueeze(-1) == live_sets.unsqueeze(1)).any(-1)
    assert drifted_TK.any()
    for token, slot in drifted_TK.nonzero().tolist()[:3]:
        router.weight.grad = None
        router(x[token : token + 1], replay_indices_TK=recorded[token : token + 1])[0][
            0, slot
        ].backward()
        assert router.weight.grad[recorded[token, slot]].abs().sum() > 0


def test_sentinel_rows_route_live_and_the_others_replay():
    router, x = make_router(), tokens()
    recorded = router(x).indices_TK
    with torch.no_grad():
        router.weight.add_(torch.randn(E, D, dtype=torch.float64) * 0.5)
    live = router(x)
    unrecorded = torch.arange(T) % 3 == 0
    replay = recorded.masked_fill(unrecorded[:, None], -1)
    mixed = router(x, replay_indices_TK=replay)
    assert torch.equal(mixed.indices_TK[unrecorded], live.indices_TK[unrecorded])
    assert torch.equal(mixed.weights_TK[unrecorded], live.weights_TK[unrecorded])
    assert torch.equal(mixed.indices_TK[~unrecorded], recorded[~unrecorded])
    assert not torch.equal(live.indices_TK[~unrecorded], recorded[~unrecorded])
    everything_live = router(x, replay_indices_TK=torch.full_like(recorded, -1))
    assert torch.equal(everything_live.indices_TK, live.indices_TK)


def test_replay_indices_must_match_tokens_and_top_k():
    router, x = make_router(), tokens()
    with pytest.raises(ValueError):
        router(x, replay_indices_TK=torch.zeros(T, K + 1, dtype=torch.long))
    with pytest.raises(ValueError):
        router(x, replay_indices_TK=torch.zeros(T, K))


def test_constructor_rejects_bad_settings():
    with pytest.raises(ValueError):
        TopKRouter(D, E, E + 1)
    with pytest.raises(ValueError):
        TopKRouter(D, E, K, score_func="relu")
    with pytest.raises(ValueError):
        TopKRouter(D, E, K, num_expert_group=3)
