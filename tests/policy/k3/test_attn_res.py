"""Attention Residuals: formula vs an independent float64 transcription, invariants, bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from policy.k3.attn_res import (
    AttnRes,
    AttnResState,
    attn_res,
    attn_res_layer,
    attn_res_reference,
    closes_block,
    num_stored_sources,
)

F64 = torch.float64


def numpy_attn_res(partial, blocks, proj_w, norm_w, eps):
    """Independent transcription of reference sec. 4.3, one token at a time, in float64."""
    partial, proj_w, norm_w = (np.asarray(x, dtype=np.float64) for x in (partial, proj_w, norm_w))
    blocks = [np.asarray(b, dtype=np.float64) for b in blocks]
    query = norm_w * proj_w.reshape(-1)
    out = np.empty_like(partial)
    for idx in np.ndindex(*partial.shape[:-1]):
        sources = [b[idx] for b in blocks] + [partial[idx]]
        logits = np.array([(s / math.sqrt(np.mean(s * s) + eps)) @ query for s in sources])
        weights = np.exp(logits - logits.max())
        weights /= weights.sum()
        out[idx] = sum(w * s for w, s in zip(weights, sources, strict=True))
    return out


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def test_matches_float64_transcription():
    partial, blocks = rand(2, 5, 16), [rand(2, 5, 16, seed=s, scale=s) for s in (1, 2, 3)]
    proj_w, norm_w = rand(1, 16, seed=4), rand(16, seed=5).abs() + 0.5
    got = attn_res(partial, blocks, proj_w, norm_w, 1e-6)
    want = numpy_attn_res(partial, blocks, proj_w, norm_w, 1e-6)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_blocks", [1, 2, 4])
def test_fast_path_equals_the_reference_in_outputs_and_every_gradient(num_blocks):
    """attn_res's hand-written backward against autograd through attn_res_reference (float64)."""

    def run(fn):
        partial = rand(3, 7, 16, seed=9).requires_grad_()
        seeds = range(1, 1 + num_blocks)
        blocks = [rand(3, 7, 16, seed=s, scale=s).requires_grad_() for s in seeds]
        proj_w = rand(1, 16, seed=20).requires_grad_()
        norm_w = (rand(16, seed=21).abs() + 0.5).requires_grad_()
        out = fn(partial, blocks, proj_w, norm_w, 1e-6)
        (out * rand(3, 7, 16, seed=22)).sum().backward()
        return [out.detach()] + [x.grad for x in (partial, *blocks, proj_w, norm_w)]

    for got, want in zip(run(attn_res), run(attn_res_reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_fast_path_passes_gradcheck():
    partial, blocks = rand(2, 3, 8).requires_grad_(), [rand(2, 3, 8, seed=1).requires_grad_()]
    proj_w, norm_w = rand(1, 8, seed=2).requires_grad_(), rand(8, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *xs: attn_res(xs[0], [xs[1]], xs[2], xs[3], 1e-6), (partial, *blocks, proj_w, norm_w)
    )


def test_low_precision_input_is_computed_in_fp32_and_cast_back():
    partial, blocks = rand(2, 3, 8).bfloat16(), [rand(2, 3, 8, seed=1).bfloat16()]
    got = attn_res(partial, blocks, rand(8, seed=2), torch.ones(8, dtype=F64), 1e-6)
    want = numpy_attn_res(partial.double(), [blocks[0].double()], rand(8, seed=2), np.ones(8), 1e-6)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.double().numpy(), want, atol=2e-2, rtol=0)


def test_zero_query_gives_uniform_mean_and_one_source_is_identity():
    partial, blocks = rand(3, 4, 8), [rand(3, 4, 8, seed=s) for s in (1, 2)]
    mean = (partial + blocks[0] + blocks[1]) / 3
    torch.testing.assert_close(
        attn_res(partial, blocks, torch.zeros(8, dtype=F64), rand(8), 1e-6), mean
    )
    torch.testing.assert_close(
        attn_res(partial, [], rand(8, seed=3), rand(8, seed=4), 1e-6), partial
    )
    module = AttnRes(8).double()  # pseudo-queries start at zero
    state = AttnResState(blocks=tuple(blocks), partial=partial)
    torch.testing.assert_close(module(state), mean)
    assert module(AttnResState.start(partial)) is partial


def test_scaling_a_source_keeps_its_weight_but_scales_its_value():
    partial, block = rand(1, 1, 8), rand(1, 1, 8, seed=1)
    proj_w = rand(8, seed=2)
    ones = torch.ones(8, dtype=F64)

    def weight_of_block(b):
        out = attn_res(partial, [b], proj_w, ones, 0.0)
        return ((out - partial) / (b - partial)).mean()  # out = p + w (b - p) along the segment

    w1 = weight_of_block(block)
    w3 = weight_of_block(3.0 * block)
    torch.testing.assert_close(w1, w3, atol=1e-12, rtol=0)
    out3 = attn_res(partial, [3.0 * block], proj_w, ones, 0.0)
    torch.testing.assert_close(out3, (1 - w1) * partial + w1 * 3.0 * block, atol=1e-12, rtol=0)


def test_output_is_a_convex_combination():
    partial, blocks = rand(4, 6, 8, scale=10), [rand(4, 6, 8, seed=s, scale=s) for s in (1, 2, 5)]
    out = attn_res(partial, blocks, rand(8, seed=9, scale=5), rand(8, seed=8), 1e-6)
    biggest = torch.stack([*blocks, partial]).norm(dim=-1).amax(0)
    assert (out.norm(dim=-1) <= biggest + 1e-12).all()


def test_token_locality_permutation_commutes_with_the_whole_stack():
    """Run 5 layers of AttnRes bookkeeping with token-local toy sub-layers, then permute tokens."""
    torch.manual_seed(0)
    sites = [(AttnRes(8).double(), AttnRes(8).double()) for _ in range(5)]
    for a, b in sites:
        torch.nn.init.normal_(a.proj.weight)
        torch.nn.init.normal_(b.proj.weight)
    mixers = [torch.nn.Linear(8, 8).double() for _ in range(10)]
    output_site = AttnRes(8).double()

    def run(x):
        state = AttnResState.start(x)
        for layer, (site_in, site_mid) in enumerate(sites):
            state = attn_res_layer(
                state, layer_idx=layer, block_size=2, attn_res_in=site_in, attn_res_mid=site_mid,
                mixer=lambda h, m=mixers[2 * layer]: torch.tanh(m(h)),
                ffn=lambda h, m=mixers[2 * layer + 1]: torch.tanh(m(h)),
            )  # fmt: skip
        return output_site(state), state

    x = rand(2, 7, 8, seed=1)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(2))
    out, state = run(x)
    out_perm, _ = run(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-12, rtol=0)
    assert len(state.blocks) == num_stored_sources(5, 2) == 3


@pytest.mark.parametrize(
    ("num_layers", "block_size"), [(93, 12), (5, 2), (4, 2), (3, 12), (1, 1), (7, 7)]
)
def test_stored_source_count_is_ceil_layers_over_block_size(num_layers, block_size):
    state = AttnResState.start(torch.zeros(1, 1, 2))
    for layer in range(num_layers):
        state = attn_res_layer(
            state, layer_idx=layer, block_size=block_size, attn_res_in=AttnRes(2),
            attn_res_mid=AttnRes(2), mixer=torch.ones_like, ffn=torch.ones_like,
        )  # fmt: skip
    assert len(state.blocks) == num_stored_sources(num_layers, block_size)
    assert len(state.blocks) == math.ceil(num_layers / block_size)
    assert [closes_block(i, 12) for i in (0, 11, 12, 84, 92)] == [True, False, True, True, False]
    # the live partial holds the sub-layer outputs since the last close: 2 per layer
    layers_in_last_block = num_layers - (len(state.blocks) - 1) * block_size
    torch.testing.assert_close(state.partial, torch.full((1, 1, 2), 2.0 * layers_in_last_block))
    assert state.blocks[0].abs().sum() == 0  # the embedding is the first stored source


def test_single_block_model_sees_embedding_and_partial_only():
    """S >= L: sources are {embedding, partial}; with zero queries each input is their mean."""
    emb = rand(1, 3, 4)
    seen = []

    def mixer(h):
        seen.append(h)
        return torch.ones_like(h)

    state = AttnResState.start(emb)
    for layer in range(3):
        state = attn_res_layer(
            state, layer_idx=layer, block_size=8, attn_res_in=AttnRes(4).double(),
            mixer=mixer, attn_res_mid=AttnRes(4).double(), ffn=torch.ones_like,
        )  # fmt: skip
    assert len(state.blocks) == 1
    torch.testing.assert_close(seen[0], emb)  # layer 0: no stored source yet -> the embedding
    torch.testing.assert_close(seen[1], (emb + 2.0) / 2)  # mean of embedding and partial (1 + 1)
