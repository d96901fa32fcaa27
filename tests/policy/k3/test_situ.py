"""SiTU-GLU (k3-architecture.md section 6): bounds, SiLU limit, SwiGLU limit, fp32 compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from policy.k3.situ import SituGLU, scaled_tanh, situ, situ_glu, situ_glu_reference

BETA, LINEAR_BETA = 4.0, 25.0


def test_situ_bounds_on_a_wide_grid():
    g = torch.linspace(-1e3, 1e3, 200_001, dtype=torch.float64)
    s = situ(g, BETA)
    # tanh saturates to exactly 1 in floating point for large g, so the sup beta is reached
    assert s.max() <= BETA and s.min() > -0.2701
    assert situ(torch.tensor(30.0, dtype=torch.float64), BETA) < BETA
    # minimum -0.2700 near g = -1.22, above SiLU's minimum of -0.2785
    fine = torch.linspace(-3, 0, 30_001, dtype=torch.float64)
    s_fine = situ(fine, BETA)
    assert abs(s_fine.min().item() + 0.2700) < 1e-3
    assert abs(fine[s_fine.argmin()].item() + 1.22) < 0.02
    assert s_fine.min() > F.silu(fine).min()


def test_scaled_tanh_is_tanh_within_float32_rounding():
    # the fast form (2 sigmoid(2x) - 1) below float64, torch.tanh in float64
    x = torch.cat([
        torch.linspace(-60, 60, 100_001, dtype=torch.float64),
        torch.logspace(-30, 3, 2_000, dtype=torch.float64),
        -torch.logspace(-30, 3, 2_000, dtype=torch.float64),
        torch.tensor([0.0, float("inf"), -float("inf")], dtype=torch.float64),
    ])  # fmt: skip
    for scale in (1.0, 1 / BETA, 1 / LINEAR_BETA):
        want = torch.tanh(x * scale)
        assert torch.equal(scaled_tanh(x, scale), want)
        got = scaled_tanh(x.float(), scale)
        assert got.dtype == torch.float32 and got.abs().max() <= 1.0
        assert (got.double() - want).abs().max() < 2.5e-7
        assert torch.equal(got[x.abs() > 60 / scale].sign(), want[x.abs() > 60 / scale].sign())
        bf = scaled_tanh(x.bfloat16(), scale)
        assert (bf.double() - want).abs().max() < 1e-2


def test_hidden_activation_is_bounded_by_beta_times_linear_beta():
    grid = torch.linspace(-1e3, 1e3, 801, dtype=torch.float64)
    gate, up = torch.meshgrid(grid, grid, indexing="ij")
    h = situ_glu(gate, up, BETA, LINEAR_BETA)
    assert h.abs().max() <= BETA * LINEAR_BETA  # reached only where tanh rounds to 1
    assert h[(gate.abs() < 50) & (up.abs() < 50)].abs().max() < BETA * LINEAR_BETA


def test_matches_silu_times_up_for_small_inputs():
    gen = torch.Generator().manual_seed(0)
    gate = (torch.rand(4096, generator=gen, dtype=torch.float64) - 0.5) * 0.2
    up = (torch.rand(4096, generator=gen, dtype=torch.float64) - 0.5) * 0.2
    err = (situ_glu(gate, up, BETA, LINEAR_BETA) - F.silu(gate) * up).abs()
    # |tanh(y) - y| <= |y|^3 / 3 gives the bound term by term
    bound = gate.abs() ** 3 / (3 * BETA**2) * torch.sigmoid(gate) * up.abs()
    bound = bound + F.silu(gate).abs() * up.abs() ** 3 / (3 * LINEAR_BETA**2)
    assert torch.all(err <= bound * (1 + 1e-9) + 1e-18)
    assert err.max() < 1e-5


def test_converges_to_swiglu_as_betas_grow():
    gen = torch.Generator().manual_seed(1)
    gate = torch.randn(2048, generator=gen, dtype=torch.float64) * 3
    up = torch.randn(2048, generator=gen, dtype=torch.float64) * 3
    swiglu = F.silu(gate) * up
    errors = [
        (situ_glu(gate, up, BETA * scale, LINEAR_BETA * scale) - swiglu).abs().max().item()
        for scale in (1, 10, 100, 1000)
    ]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 1e-4
    assert (situ_glu(gate, up, None, None) - swiglu).abs().max() < 1e-14


def test_gradients_are_finite_everywhere():
    values = torch.tensor([-1e4, -300.0, -20.0, -1.0, 0.0, 1.0, 20.0, 300.0, 1e4])
    gate, up = torch.meshgrid(values, values, indexing="ij")
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    situ_glu(gate, up, BETA, LINEAR_BETA).sum().backward()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    g64 = torch.randn(6, dtype=torch.float64, requires_grad=True)
    u64 = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, BETA, LINEAR_BETA), (g64, u64))


def test_low_precision_inputs_are_computed_in_float32():
    gen = torch.Generator().manual_seed(2)
    gate = (torch.randn(1000, generator=gen) * 4).bfloat16()
    up = (torch.randn(1000, generator=gen) * 40).bfloat16()
    out = situ_glu(gate, up, BETA, LINEAR_BETA)
    assert out.dtype == torch.bfloat16
    want = situ_glu(gate.float(), up.float(), BETA, LINEAR_BETA).bfloat16()
    assert torch.equal(out, want)
    # float64 is not rounded through float32
    g64 = torch.randn(100, dtype=torch.float64)
    exact = BETA * torch.tanh(g64 / BETA) * torch.sigmoid(g64)
    assert (situ(g64, BETA) - exact).abs().max() < 1e-15


def test_situ_glu_module_is_down_of_situ_of_gate_times_capped_up():
    torch.manual_seed(0)
    mlp = SituGLU(8, 12).double()
    assert {n for n, _ in mlp.named_parameters()} == {
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    }
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    h = BETA * torch.tanh(gate / BETA) * torch.sigmoid(gate) * LINEAR_BETA * torch.tanh(up / 25)
    assert (mlp(x) - h @ mlp.down_proj.weight.T).abs().max() < 1e-13


def test_fast_path_equals_the_reference_in_outputs_and_gradients():
    """The hand-written backward against autograd through situ_glu_reference (float64), on
    inputs that reach both caps' saturated ranges."""
    gen = torch.Generator().manual_seed(0)
    make = lambda scale: torch.randn(64, 24, generator=gen, dtype=torch.float64) * scale  # noqa: E731
    gate, up, grad = make(6.0), make(40.0), make(1.0)

    def run(fn):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fn(g, u, 4.0, 25.0)
        (out * grad).sum().backward()
        return out.detach(), g.grad, u.grad

    for got, want in zip(run(situ_glu), run(situ_glu_reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    g, u = gate[:4, :3].clone().requires_grad_(), up[:4, :3].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))
