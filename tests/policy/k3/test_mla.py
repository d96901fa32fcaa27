"""Gated NoPE MLA: absorbed == naive, cached decode == full forward, NoPE, gate, cache size."""

from __future__ import annotations

import pytest
import torch

from policy.k3.mla import GatedMLA, MLACache

F64 = torch.float64
DIMS = {"kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5}


def make_mla(*, q_lora_rank=12, output_gate=True, seed=0):
    torch.manual_seed(seed)
    mla = GatedMLA(32, 3, q_lora_rank=q_lora_rank, output_gate=output_gate, **DIMS).double()
    with torch.no_grad():
        mla.kv_a_layernorm.weight.normal_(1, 0.3)
        if q_lora_rank is not None:
            mla.q_a_layernorm.weight.normal_(1, 0.3)
    return mla


def hidden(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_absorbed_equals_naive_prefill_and_decode(q_lora_rank):
    mla = make_mla(q_lora_rank=q_lora_rank)
    x = hidden(2, 9, 32)
    naive, cache_n = mla(x, absorbed=False)
    absorbed, cache_a = mla(x, absorbed=True)
    torch.testing.assert_close(absorbed, naive, atol=1e-10, rtol=0)
    step = hidden(2, 1, 32, seed=2)
    torch.testing.assert_close(
        mla(step, cache=cache_a, absorbed=True)[0], mla(step, cache=cache_n, absorbed=False)[0],
        atol=1e-10, rtol=0,
    )  # fmt: skip


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decode_equals_full_forward(absorbed):
    mla = make_mla()
    x = hidden(2, 12, 32)
    full, full_cache = mla(x)
    out, cache = mla(x[:, :5])
    outs = [out]
    for t in range(5, 12):
        out, cache = mla(x[:, t : t + 1], cache=cache, absorbed=absorbed)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=0)
    torch.testing.assert_close(cache.latent, full_cache.latent, atol=1e-14, rtol=0)
    out_a, _ = mla(x[:, :8])
    out_b, _ = mla(x[:, 8:], cache=mla(x[:, :8])[1])  # multi-token continuation
    torch.testing.assert_close(torch.cat([out_a, out_b], 1), full, atol=1e-10, rtol=0)


def test_nope_last_position_is_invariant_to_prefix_permutation():
    mla = make_mla()
    x = hidden(1, 10, 32)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    shuffled = torch.cat([x[:, perm], x[:, 9:]], 1)
    torch.testing.assert_close(mla(shuffled)[0][:, -1], mla(x)[0][:, -1], atol=1e-12, rtol=0)


def test_zero_gate_weights_halve_the_ungated_output():
    gated, plain = make_mla(seed=4), make_mla(output_gate=False, seed=4)
    with torch.no_grad():
        gated.g_proj.weight.zero_()
    shared = {n: t for n, t in gated.state_dict().items() if not n.startswith("g_proj")}
    plain.load_state_dict(shared, strict=True)
    x = hidden(2, 6, 32)
    torch.testing.assert_close(gated(x)[0], 0.5 * plain(x)[0], atol=1e-12, rtol=0)
    gate = torch.sigmoid(make_mla(seed=5).g_proj(x * 100))
    assert (gate <= 1).all() and (gate >= 0).all()


def test_cache_holds_exactly_latent_plus_rope_values_per_token():
    mla = make_mla()
    _, cache = mla(hidden(2, 7, 32))
    assert isinstance(cache, MLACache) and cache.length == 7
    assert cache.latent.shape == (2, 7, DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"])
    _, cache = mla(hidden(2, 1, 32, seed=5), cache=cache)
    assert cache.latent.shape == (2, 8, 12) and cache.key_mask.all()


def test_no_rotary_buffers_or_positional_parameters():
    mla = make_mla()
    assert list(mla.buffers()) == []
    names = [n for n, _ in mla.named_parameters()]
    assert not [n for n in names if "rotary" in n or "rope" in n or "pos" in n]
    assert "kv_a_proj_with_mqa.weight" in names and "g_proj.weight" in names


@pytest.mark.parametrize("absorbed", [False, True])
def test_left_padded_batch_equals_unpadded_sequences(absorbed):
    mla = make_mla(seed=6)
    seqs = [hidden(1, n, 32, seed=10 + n) for n in (4, 9)]
    nexts = [hidden(1, 2, 32, seed=20 + i) for i in range(2)]
    batch = torch.full((2, 9, 32), 7.0, dtype=F64)  # garbage in the padding must not leak
    mask = torch.zeros(2, 9, dtype=torch.bool)
    for b, s in enumerate(seqs):
        batch[b, 9 - s.shape[1] :], mask[b, 9 - s.shape[1] :] = s[0], True
    out, cache = mla(batch, mask=mask, absorbed=absorbed)
    assert torch.isfinite(out).all() and (out[~mask] == 0).all()
    steps = []
    for t in range(2):
        step, cache = mla(
            torch.cat([n[:, t : t + 1] for n in nexts]), cache=cache, absorbed=absorbed
        )
        steps.append(step)
    for b, s in enumerate(seqs):
        alone, alone_cache = mla(s, absorbed=absorbed)
        torch.testing.assert_close(out[b, 9 - s.shape[1] :], alone[0], atol=1e-12, rtol=0)
        for t in range(2):
            step_alone, alone_cache = mla(
                nexts[b][:, t : t + 1], cache=alone_cache, absorbed=absorbed
            )
            torch.testing.assert_close(steps[t][b], step_alone[0], atol=1e-12, rtol=0)


def test_padded_rows_have_finite_gradients():
    mla = make_mla(seed=7)
    mask = torch.tensor([[False, False, True, True]])
    out, _ = mla(hidden(1, 4, 32), mask=mask)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mla.parameters())
