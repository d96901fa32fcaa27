"""Stable LatentMoE (k3-architecture.md 5.2, 5.5): latent reduction, norm placement, and parity
of the expert dispatch paths (naive loop, dense masked, sorted segments, grouped_mm)."""

from __future__ import annotations

import pytest
import torch

from policy.k3.configuration import k3_preset
from policy.k3.moe import (
    GroupedExperts,
    StableLatentMoE,
    _Dispatch,
    _Permute,
    grouped_linear,
    grouped_mm_supported,
    naive_experts,
)
from policy.k3.situ import situ_glu

D, L, FF, E, K = 32, 16, 24, 8, 2
BETAS = (4.0, 25.0)


def make_moe(dtype=torch.float64, **overrides) -> StableLatentMoE:
    fields = dict(
        hidden_size=D, moe_intermediate_size=FF, num_experts=E, top_k=K, latent_size=L,
        num_shared_experts=1, routed_scaling_factor=2.5, init_std=0.3,
    ) | overrides  # fmt: skip
    torch.manual_seed(0)
    return StableLatentMoE(StableLatentMoE.Config(**fields)).to(dtype)


def tokens(shape=(3, 11), width=D, dtype=torch.float64, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, width, generator=gen, dtype=torch.float64).to(dtype)


def run(moe, x, dispatch):
    """Output and gradients (input and every parameter) under a fixed random cotangent."""
    moe.zero_grad()
    x = x.clone().requires_grad_()
    out = moe(x, dispatch=dispatch)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * cot).sum().backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dispatch", ["dense", "segment", "grouped"])
def test_dispatch_paths_match_the_naive_loop_in_float64(dispatch):
    moe, x = make_moe(), tokens()
    out_ref, dx_ref, grads_ref = run(moe, x, "naive")
    out, dx, grads = run(moe, x, dispatch)
    assert out.abs().mean() > 0.1
    assert max_diff(out, out_ref) < 1e-12 and max_diff(dx, dx_ref) < 1e-12
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert max_diff(grads[name], grads_ref[name]) < 1e-12, name
        assert grads[name].abs().sum() > 0, name


def test_sorted_dispatch_backward_gathers_what_autograd_would_scatter():
    """_Dispatch and _Permute (sorted_experts' own backwards) against plain indexing."""
    gen = torch.Generator().manual_seed(4)
    indices_TK = torch.rand(13, E, generator=gen).topk(K, dim=-1).indices
    order_S = torch.argsort(indices_TK.reshape(-1), stable=True)
    inverse_S = torch.argsort(order_S)
    z_TL = torch.randn(13, L, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = _Dispatch.apply(z_TL, order_S, inverse_S, K)
    plain = z_TL[order_S // K]
    cot = torch.randn(plain.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(ours, plain)
    want, got = (torch.autograd.grad((y * cot).sum(), z_TL)[0] for y in (plain, ours))
    assert torch.allclose(got, want, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda z: _Dispatch.apply(z, order_S, inverse_S, K), z_TL)
    x_SL = torch.randn(13 * K, L, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.equal(_Permute.apply(x_SL, inverse_S, order_S), x_SL[inverse_S])
    assert torch.autograd.gradcheck(lambda x: _Permute.apply(x, inverse_S, order_S), x_SL)


def test_dispatch_paths_agree_with_idle_experts():
    moe, x = make_moe(), tokens()
    moe.gate.e_score_correction_bias[:] = torch.tensor([9.0, 9.0] + [0.0] * (E - 2))
    out_ref, _, grads_ref = run(moe, x, "naive")
    for dispatch in ("dense", "segment", "grouped"):
        out, _, grads = run(moe, x, dispatch)
        assert max_diff(out, out_ref) < 1e-12
        assert grads["experts.down_proj"][2:].abs().max() == 0
        assert max_diff(grads["experts.gate_up_proj"], grads_ref["experts.gate_up_proj"]) < 1e-12


def test_grouped_mm_path_matches_the_naive_loop_in_float32():
    moe, x = make_moe(torch.float32), tokens(dtype=torch.float32)
    z = torch.randn(40, L)
    assert grouped_mm_supported(z, moe.experts.gate_up_proj)
    assert grouped_mm_supported(torch.randn(40, FF), moe.experts.down_proj)
    out_ref, dx_ref, grads_ref = run(moe, x, "naive")
    for dispatch in ("grouped", "segment"):
        out, dx, grads = run(moe, x, dispatch)
        scale = out_ref.abs().max().item()
        assert max_diff(out, out_ref) < 1e-5 * scale and max_diff(dx, dx_ref) < 1e-4
        for name in grads:
            tol = 1e-5 * grads_ref[name].abs().max().item()
            assert max_diff(grads[name], grads_ref[name]) < tol, (dispatch, name)


def test_grouped_mm_support_rules_and_fallback():
    w = torch.randn(E, 8, 12)
    assert grouped_mm_supported(torch.randn(5, 12), w)
    assert not grouped_mm_supported(torch.randn(5, 12).double(), w.double())
    assert not grouped_mm_supported(torch.randn(5, 13), torch.randn(E, 8, 13))  # 52-byte rows
    assert not grouped_mm_supported(torch.randn(5, 12).bfloat16(), w.bfloat16())  # 24-byte rows
    counts = torch.tensor([2, 0, 1, 0, 0, 1, 1, 0])
    x = torch.randn(5, 12)
    fast, slow = grouped_linear(x, w, counts), grouped_linear(x, w, counts, use_grouped_mm=False)
    assert max_diff(fast, slow) < 1e-5


def test_bfloat16_grouped_path_is_close_to_float64():
    moe64 = make_moe()
    moe16 = make_moe(torch.bfloat16)
    x = tokens()
    want, got = moe64(x, dispatch="naive"), moe16(x.bfloat16(), dispatch="grouped")
    assert got.dtype == torch.bfloat16
    assert max_diff(got, want) < 0.05 * want.abs().max().item()


def test_latent_moe_with_identity_projections_is_a_plain_moe():
    latent = make_moe(latent_size=D, use_latent_norm=False)
    plain = make_moe(latent_size=None)
    assert latent.routed_expert_norm is None and plain.routed_expert_down_proj is None
    with torch.no_grad():
        latent.routed_expert_down_proj.weight.copy_(torch.eye(D))
        latent.routed_expert_up_proj.weight.copy_(torch.eye(D))
    plain.load_state_dict(latent.state_dict(), strict=False)
    x = tokens()
    assert max_diff(latent(x), plain(x)) < 1e-12
    # and the plain MoE is route -> experts -> combine -> + shared, written out by hand
    routing = plain.gate(x.reshape(-1, D))
    hand = naive_experts(
        x.reshape(-1, D), routing.indices_TK, routing.weights_TK,
        plain.experts.gate_up_proj, plain.experts.down_proj, BETAS,
    ) + plain.shared_experts(x.reshape(-1, D))  # fmt: skip
    assert max_diff(plain(x).reshape(-1, D), hand) < 1e-12


def per_expert_outputs(moe, x_TD):
    """Weighted expert outputs in the latent space, one per selected slot: [T, K, L]."""
    routing = moe.gate(x_TD)
    z = moe.routed_expert_down_proj(x_TD)
    slots = []
    for k in range(K):
        idx = routing.indices_TK[:, k]
        gate, up = torch.einsum("tl,tfl->tf", z, moe.experts.gate_up_proj[idx]).chunk(2, -1)
        out = torch.einsum("tf,tlf->tl", situ_glu(gate, up, *BETAS), moe.experts.down_proj[idx])
        slots.append(routing.weights_TK[:, k, None] * out)
    return torch.stack(slots, dim=1)


def test_norm_is_applied_once_to_the_combined_latent_output():
    moe = make_moe(num_shared_experts=0)
    with torch.no_grad():
        moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
    x = tokens().reshape(-1, D)
    slots = per_expert_outputs(moe, x)
    up, norm = moe.routed_expert_up_proj, moe.routed_expert_norm
    assert max_diff(moe(x), up(norm(slots.sum(1)))) < 1e-12
    assert max_diff(moe(x), up(norm(slots).sum(1))) > 1e-3  # not per expert
    assert max_diff(moe(x), up(slots.sum(1))) > 1e-3  # and not skipped


def test_without_norm_combine_then_project_equals_project_then_combine():
    moe = make_moe(num_shared_experts=0, use_latent_norm=False)
    x = tokens().reshape(-1, D)
    slots = per_expert_outputs(moe, x)
    up = moe.routed_expert_up_proj
    assert max_diff(moe(x), up(slots).sum(1)) < 1e-12


def test_shapes_names_and_routing_output():
    moe = make_moe()
    assert moe.experts.gate_up_proj.shape == (E, 2 * FF, L)
    assert moe.experts.down_proj.shape == (E, L, FF)
    assert moe.gate.weight.shape == (E, D) and moe.gate.weight.dtype == torch.float64
    assert moe.shared_experts.gate_proj.weight.shape == (FF, D)
    assert set(moe.state_dict()) == {
        "gate.weight", "gate.e_score_correction_bias",
        "experts.gate_up_proj", "experts.down_proj",
        "routed_expert_down_proj.weight", "routed_expert_up_proj.weight",
        "routed_expert_norm.weight",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    }  # fmt: skip
    x = tokens((2, 5, 7))
    out, routing = moe(x, return_routing=True)
    assert out.shape == x.shape
    assert routing.indices_TK.shape == (70, K) and routing.scores_TE.shape == (70, E)
    replayed, again = moe(x, replay_indices_TK=routing.indices_TK, return_routing=True)
    assert torch.equal(again.indices_TK, routing.indices_TK) and torch.equal(replayed, out)


def test_replay_through_the_moe_follows_the_recorded_experts():
    moe, x = make_moe(), tokens()
    _, recorded = moe(x, return_routing=True)
    with torch.no_grad():
        moe.gate.weight.add_(torch.randn(E, D, dtype=torch.float64))
    out, live = moe(x, replay_indices_TK=recorded.indices_TK, return_routing=True)
    assert torch.equal(live.indices_TK, recorded.indices_TK)
    assert not torch.equal(moe(x, return_routing=True)[1].indices_TK, recorded.indices_TK)
    out.sum().backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_config_from_k3_and_rejects_unknown_dispatch():
    cfg = StableLatentMoE.Config.from_k3(k3_preset("k3-debug"))
    assert (cfg.hidden_size, cfg.latent_size, cfg.num_experts, cfg.top_k) == (64, 32, 8, 2)
    assert (cfg.situ_beta, cfg.situ_linear_beta, cfg.num_shared_experts) == (4.0, 25.0, 1)
    with pytest.raises(ValueError):
        StableLatentMoE.Config.from_k3(k3_preset("k3-debug"), dispatch="magic")
    experts = GroupedExperts(E, L, FF)
    with pytest.raises(ValueError):
        experts(torch.randn(4, L), torch.zeros(4, K, dtype=torch.long), torch.ones(4, K), "x")
