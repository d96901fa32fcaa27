"""Kimi Delta Attention: chunked == recurrent (values and gradients), caches, padding, peers.

Tolerances follow ../shared/reference/k3-architecture.md sec. 11: float64 1e-10, float32 ~1e-5.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from policy.k3 import kda
from policy.k3.kda import (
    KimiDeltaAttention,
    kda_chunked,
    kda_gate_lower_bound,
    kda_gate_softplus,
    kda_recurrent,
    l2_normalize,
    short_conv,
    short_conv_reference,
)

F64 = torch.float64


def make_inputs(*, B=2, T=37, H=2, HV=4, K=6, V=5, gate="lower_bound", seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = randn(B, T, H, K), l2_normalize(randn(B, T, H, K)), randn(B, T, HV, V)
    f, A_log, dt_bias = randn(B, T, HV, K) * 2, randn(HV) * 0.5, randn(HV * K)
    gate_fn = kda_gate_lower_bound if gate == "lower_bound" else kda_gate_softplus
    g = gate_fn(f, A_log, dt_bias).to(dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    h0 = randn(B, HV, K, V)
    return q, k.to(dtype), v, g, beta, h0


def run_with_grads(fn, inputs, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    o, state = fn(q, k, v, g, beta, scale=0.37, initial_state=h0, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=gen, dtype=state.dtype)).sum()
    return o, state, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize(
    ("chunk_size", "length"), [(1, 37), (8, 37), (64, 37), (8, 150), (64, 150)]
)
def test_chunked_equals_recurrent_values_and_gradients(gate, chunk_size, length):
    inputs = make_inputs(T=length, gate=gate, seed=chunk_size + length)
    o_ref, s_ref, grads_ref = run_with_grads(kda_recurrent, inputs)
    o, s, grads = run_with_grads(kda_chunked, inputs, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"grad {name}")


def test_no_gva_and_no_initial_state():
    q, k, v, g, beta, _ = make_inputs(H=3, HV=3, K=4, V=7, T=20)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=0.5)
    o, s = kda_chunked(q, k, v, g, beta, scale=0.5, chunk_size=8)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)
    assert kda_chunked(q, k, v, g, beta, scale=0.5, output_final_state=False)[1] is None


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_long_sequence_strong_decay_is_chunk_size_independent(gate):
    """4096 tokens, decays near the bound (far beyond it for softplus): no underflow path."""
    q, k, v, _, beta, h0 = make_inputs(B=1, T=4096, H=1, HV=1, K=4, V=3, seed=7)
    f = torch.randn(1, 4096, 1, 4, generator=torch.Generator().manual_seed(8), dtype=F64) * 4
    if gate == "lower_bound":
        g = kda_gate_lower_bound(f + 6, torch.zeros(1), torch.zeros(4)).to(F64)
    else:
        g = kda_gate_softplus(f, torch.tensor([3.0]), torch.zeros(4)).to(F64)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=0.5, initial_state=h0)
    for chunk_size in (8, 16, 64):
        o, s = kda_chunked(q, k, v, g, beta, scale=0.5, initial_state=h0, chunk_size=chunk_size)
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)


def test_float32_chunked_close_to_float64_reference():
    inputs = make_inputs(B=1, T=300, H=2, HV=2, K=16, V=16, seed=3)
    o64, s64 = kda_recurrent(*inputs[:5], scale=0.25, initial_state=inputs[5])
    o32, s32 = kda_chunked(
        *(x.float() for x in inputs[:5]), scale=0.25, initial_state=inputs[5].float()
    )
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert (o32.double() - o64).norm() / o64.norm() < 1e-5
    assert (s32.double() - s64).norm() / s64.norm() < 1e-5


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_masked_positions_are_exact_noops(fn):
    q, k, v, g, beta, h0 = make_inputs(B=2, T=19, seed=11)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, [3, 4, 12]] = False  # holes anywhere
    o, s = fn(q, k, v, g, beta, scale=0.4, initial_state=h0, mask=mask)
    assert (o[~mask] == 0).all()
    for b in range(2):
        keep = mask[b]
        part = (x[b : b + 1, keep] for x in (q, k, v, g, beta))
        o_b, s_b = kda_recurrent(*part, scale=0.4, initial_state=h0[b : b + 1])
        torch.testing.assert_close(o[b : b + 1, keep], o_b, atol=1e-12, rtol=0)
        torch.testing.assert_close(s[b : b + 1], s_b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_beta_zero_is_pure_decay(fn):
    q, k, v, g, beta, h0 = make_inputs(T=13, seed=5)
    o, s = fn(q, k, v, g, torch.zeros_like(beta), scale=0.3, initial_state=h0)
    decay_BTHK = g.cumsum(1).exp()
    torch.testing.assert_close(s, decay_BTHK[:, -1, :, :, None] * h0, atol=1e-12, rtol=0)
    q_BTHK = q.repeat_interleave(2, dim=2) * 0.3
    want = torch.einsum("bthk,bhkv->bthv", q_BTHK * decay_BTHK, h0)
    torch.testing.assert_close(o, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_delta_rule_overwrites_and_retrieves_with_orthonormal_keys(fn):
    """alpha = 1, beta = 1: writing v under unit key k makes S^T k = v exactly (delta rule)."""
    keys = torch.linalg.qr(
        torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    )[0]
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    # steps: write keys 0..3 -> values 0..3, overwrite key 0 -> value 4, then read keys 0..3
    k_T4 = torch.cat([keys, keys[:1], keys])
    v_T3 = torch.cat([values, torch.zeros(4, 3, dtype=F64)])
    beta_T = torch.tensor([1.0] * 5 + [0.0] * 4, dtype=F64)
    q_T4 = torch.cat([torch.zeros(5, 4, dtype=F64), keys])
    o, _ = fn(q_T4[None, :, None], k_T4[None, :, None], v_T3[None, :, None],
              torch.zeros(1, 9, 1, 4, dtype=F64), beta_T[None, :, None], scale=1.0)  # fmt: skip
    want = torch.cat([values[4:5], values[1:4]])
    torch.testing.assert_close(o[0, 5:, 0], want, atol=1e-12, rtol=0)


def test_gate_formulas_and_invariants():
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(2, 9, 3, 4, generator=gen, dtype=F64) * 30
    A_log, dt_bias = (
        torch.randn(3, generator=gen, dtype=F64),
        torch.randn(12, generator=gen, dtype=F64),
    )
    x = f + dt_bias.view(3, 4)
    g_lb = kda_gate_lower_bound(f, A_log, dt_bias)
    assert g_lb.dtype == F64 and (g_lb >= -5).all() and (g_lb <= 0).all()
    want = -5.0 * torch.sigmoid(A_log.exp().view(3, 1) * x)
    torch.testing.assert_close(g_lb, want, atol=0, rtol=0)
    assert kda_gate_lower_bound(f.bfloat16(), A_log, dt_bias).dtype == torch.float32
    assert (
        kda_gate_lower_bound(-dt_bias.view(3, 4).expand(2, 9, 3, 4), A_log, dt_bias) == -2.5
    ).all()
    g_sp = kda_gate_softplus(f, A_log, dt_bias)
    want = -A_log.exp().view(3, 1) * torch.nn.functional.softplus(x)
    torch.testing.assert_close(g_sp, want, atol=0, rtol=1e-15)
    assert (g_sp < 0).all()
    layer = KimiDeltaAttention(16, 2, 4)
    g, beta = layer.decay(torch.randn(2, 5, 16)), torch.sigmoid(layer.b_proj(torch.randn(2, 5, 16)))
    assert g.shape == (2, 5, 2, 4) and (g > -5).all() and (g < 0).all()
    assert ((beta > 0) & (beta < 1)).all()


def test_short_conv_cache_carries_across_splits():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 10, 6, generator=gen, dtype=F64)
    weight = torch.randn(6, 1, 4, generator=gen, dtype=F64)
    y, cache = short_conv(x, weight)
    y1, c1 = short_conv(x[:, :3], weight)
    y2, c2 = short_conv(x[:, 3:], weight, c1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-14, rtol=0)
    torch.testing.assert_close(c2, cache, atol=0, rtol=0)
    torch.testing.assert_close(cache, x[:, -3:].transpose(1, 2), atol=0, rtol=0)
    manual = sum(
        weight[None, :, 0, j] * torch.nn.functional.pad(x, (0, 0, 3 - j, 0))[:, :10]
        for j in range(4)
    )
    torch.testing.assert_close(y, torch.nn.functional.silu(manual), atol=1e-14, rtol=0)


@pytest.mark.parametrize("length", [1, 2, 9])
def test_short_conv_equals_the_conv1d_reference_with_gradients(length):
    """The shifted multiply-adds against torch's depthwise conv1d, float64, with a carried cache
    (also T < W - 1, where the new cache still holds old inputs)."""

    def run(fn):
        gen = torch.Generator().manual_seed(length)
        x = torch.randn(2, length, 6, generator=gen, dtype=F64, requires_grad=True)
        weight = torch.randn(6, 1, 4, generator=gen, dtype=F64, requires_grad=True)
        cache = torch.randn(2, 6, 3, generator=gen, dtype=F64, requires_grad=True)
        y, new_cache = fn(x, weight, cache)
        (y * torch.randn(y.shape, generator=gen, dtype=F64)).sum().backward()
        return y.detach(), new_cache.detach(), x.grad, weight.grad, cache.grad

    for got, want in zip(run(short_conv), run(short_conv_reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-13, rtol=0)


def make_layer(*, gate_lower_bound=-5.0, full_rank_output_gate=True, num_v_heads=4, seed=0):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(
        24, 2, 6, num_v_heads=num_v_heads, gate_lower_bound=gate_lower_bound,
        full_rank_output_gate=full_rank_output_gate,
    )  # fmt: skip
    with torch.no_grad():
        layer.A_log.normal_(0, 0.5)
        layer.o_norm.weight.normal_(1, 0.2)
    return layer.double()


@pytest.mark.parametrize(("lower_bound", "full_rank"), [(-5.0, True), (None, False)])
def test_layer_split_sequence_and_decode_equal_one_shot(lower_bound, full_rank):
    layer = make_layer(gate_lower_bound=lower_bound, full_rank_output_gate=full_rank)
    x = torch.randn(2, 23, 24, generator=torch.Generator().manual_seed(1), dtype=F64)
    full, cache_full = layer(x)
    torch.testing.assert_close(layer(x, use_chunked=False)[0], full, atol=1e-12, rtol=0)
    out1, cache = layer(x[:, :9])
    out2, cache = layer(x[:, 9:], cache=cache)
    torch.testing.assert_close(torch.cat([out1, out2], 1), full, atol=1e-12, rtol=0)
    steps, cache = [out1], layer(x[:, :9])[1]
    for t in range(9, 23):
        out_t, cache = layer(x[:, t : t + 1], cache=cache)
        steps.append(out_t)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    for name in ("conv_q", "conv_k", "conv_v", "state"):
        torch.testing.assert_close(
            getattr(cache, name), getattr(cache_full, name), atol=1e-12, rtol=0
        )
    assert cache.conv_v.shape == (2, 4 * 6, 3) and cache.state.shape == (2, 4, 6, 6)


def test_layer_left_padded_batch_equals_unpadded_sequences():
    layer = make_layer(seed=3)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randn(1, n, 24, generator=gen, dtype=F64) for n in (7, 12)]
    nexts = [torch.randn(1, 3, 24, generator=gen, dtype=F64) for _ in seqs]
    batch = torch.zeros(2, 12, 24, dtype=F64)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    for b, s in enumerate(seqs):
        batch[b, 12 - s.shape[1] :], mask[b, 12 - s.shape[1] :] = s[0], True
    batch[0, :5] = 9.0  # garbage in the padding must not leak
    out, cache = layer(batch, mask=mask)
    assert (out[~mask] == 0).all()
    decoded = []
    for t in range(3):
        step, cache = layer(torch.cat([n[:, t : t + 1] for n in nexts]), cache=cache)
        decoded.append(step)
    for b, s in enumerate(seqs):
        alone, alone_cache = layer(s)
        torch.testing.assert_close(out[b, 12 - s.shape[1] :], alone[0], atol=1e-12, rtol=0)
        for t in range(3):
            step_alone, alone_cache = layer(nexts[b][:, t : t + 1], cache=alone_cache)
            torch.testing.assert_close(decoded[t][b], step_alone[0], atol=1e-12, rtol=0)


def test_layer_backward_reaches_every_parameter():
    layer = make_layer(seed=4)
    out, _ = layer(torch.randn(2, 10, 24, dtype=F64))
    out.square().sum().backward()
    missing = [
        n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert missing == []


# ------------------------------------------------------------------------------------------
# Peers: transformers' kimi_linear torch fallback (and fla's naive file, if one is on disk)


def _transformers_kda():
    module = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    return module


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_matches_transformers_torch_fallback(chunk_size):
    hf = _transformers_kda()
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 100, 2, 16
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    g = kda_gate_lower_bound(
        torch.randn(B, T, H, K, generator=gen), torch.zeros(H), torch.zeros(H * K)
    )
    beta, h0 = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, K, generator=gen)
    o, s = kda_chunked(l2_normalize(q), l2_normalize(k), v, g, beta, scale=K**-0.5,
                       initial_state=h0, chunk_size=chunk_size)  # fmt: skip
    o_rec, s_rec = kda_recurrent(
        l2_normalize(q), l2_normalize(k), v, g, beta, scale=K**-0.5, initial_state=h0
    )
    kwargs = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    o_hc, s_hc = hf.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    o_hr, s_hr = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, **kwargs)
    for got, want in ((o, o_hc), (s, s_hc), (o, o_hr), (s, s_hr), (o_rec, o_hr), (s_rec, s_hr)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_layer_matches_transformers_kimi_linear_layer():
    """48B form (softplus gate, low-rank output gate) vs transformers' KimiLinearDeltaAttention."""
    hf = _transformers_kda()
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(
        hidden_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        linear_attn_config={"num_heads": 2, "head_dim": 6, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": []},
        rms_norm_eps=1e-5, hidden_act="silu",
    )  # fmt: skip
    theirs = hf.KimiLinearDeltaAttention(config, layer_idx=0).double()
    ours = make_layer(gate_lower_bound=None, full_rank_output_gate=False, num_v_heads=2, seed=5)
    p = dict(ours.named_parameters())
    rename = {n: f"forget_gate.{n}" for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias")}
    state = {rename.get(n, n): t for n, t in p.items() if "conv1d" not in n and n != "A_log"}
    state["forget_gate.A_log"] = p["A_log"].view(1, 1, 2, 1)
    state["conv1d.weight"] = torch.cat([p[f"{n}_conv1d.weight"] for n in "qkv"])
    theirs.load_state_dict(state, strict=True)
    x = torch.randn(2, 70, 24, generator=torch.Generator().manual_seed(6), dtype=F64)
    torch.testing.assert_close(ours(x)[0], theirs(x), atol=1e-6, rtol=1e-5)


def _fla_naive_path() -> pathlib.Path | None:
    """fla's `naive.py`: from an installed fla, else the copy `make` unpacks under the venv
    (`<venv>/share/fla-ref`, see scripts/setup.sh; never installed, so transformers keeps its
    torch fallback)."""
    candidates = [pathlib.Path(sys.prefix) / "share" / "fla-ref" / "fla"]
    spec = importlib.util.find_spec("fla")
    if spec is not None and spec.submodule_search_locations:
        candidates.insert(0, pathlib.Path(next(iter(spec.submodule_search_locations))))
    paths = [c / "ops" / "kda" / "naive.py" for c in candidates]
    return next((p for p in paths if p.exists()), None)


def test_matches_fla_naive_reference_if_present():
    path = _fla_naive_path()
    if path is None or importlib.util.find_spec("einops") is None:
        pytest.skip("fla naive KDA (and einops) not on disk")
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    q, k, v, g, beta, h0 = make_inputs(T=64, seed=9)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.4, initial_state=h0,
                                             output_final_state=True)  # fmt: skip
    o, s = kda_chunked(q, k, v, g, beta, scale=0.4, initial_state=h0)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.float(), s_ref.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sub", [1, 4, 8])
def test_decayed_grams_factored_and_exact_paths_equal_the_definition(sub):
    gen = torch.Generator().manual_seed(sub)
    a = torch.randn(1, 2, 3, 2, 16, 5, generator=gen, dtype=F64)  # [B, H, N, P, C, K]
    b = torch.randn(1, 2, 3, 16, 5, generator=gen, dtype=F64)
    gam = -(torch.rand(1, 2, 3, 16, 5, generator=gen, dtype=F64) * 4).cumsum(-2)
    diff_CCK = gam[..., :, None, :] - gam[..., None, :, :]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()[..., None]
    decay = torch.where(causal, diff_CCK.clamp(max=0).exp(), torch.zeros((), dtype=F64))
    want = torch.einsum("...prk,...sk,...rsk->...prs", a, b, decay)
    for factored in (True, False):
        got = kda.decayed_grams(a, b, gam, sub, factored=factored)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"factored={factored}")


@pytest.mark.parametrize(("mildness", "want_sub"), [(0.05, 64), (1.0, 8)])
def test_row_blocks_as_large_as_the_decay_allows_and_equal_to_recurrent(
    monkeypatch, mildness, want_sub
):
    """`_sub_block`: a mild decay (a 64-token chunk decays by less than e^-40) takes the whole
    chunk as one block of the Gram (`one_block_grams`), the strong test gate 8-token blocks
    (`decayed_grams`); both equal the loop."""
    subs = []
    pick = kda._sub_block
    monkeypatch.setattr(kda, "_sub_block", lambda *a: subs.append(pick(*a)[0]) or pick(*a))
    q, k, v, g, beta, h0 = make_inputs(T=150, seed=11)
    inputs = (q, k, v, g * mildness, beta, h0)
    o_ref, s_ref, grads_ref = run_with_grads(kda_recurrent, inputs)
    o, s, grads = run_with_grads(kda_chunked, inputs, chunk_size=64)
    assert subs == [want_sub]
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=0)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"grad {name}")


def test_unit_lower_solve_equals_the_triangular_solve_with_gradients():
    """The explicit-inverse solve (`kda.unit_lower_solve`) against torch's triangular solve, in
    float64: the solution and the gradients of L (strictly lower part only) and R; L's diagonal
    and upper part are ignored by both; gradcheck on the hand-written backward."""
    gen = torch.Generator().manual_seed(5)
    L = (torch.randn(2, 3, 8, 8, generator=gen, dtype=F64) * 0.5).requires_grad_()
    R = torch.randn(2, 3, 8, 7, generator=gen, dtype=F64, requires_grad=True)
    dX = torch.randn(2, 3, 8, 7, generator=gen, dtype=F64)
    got = kda.unit_lower_solve(L, R)
    want = torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(got, (L, R), dX)
    grads_ref = torch.autograd.grad(want, (L, R), dX)
    for name, g, g_ref in zip(("L", "R"), grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0, msg=f"grad {name}")
    assert grads[0].triu().abs().max() == 0, "no gradient on the ignored diagonal and upper part"
    torch.autograd.gradcheck(kda.unit_lower_solve, (L[:1, :1], R[:1, :1]))
