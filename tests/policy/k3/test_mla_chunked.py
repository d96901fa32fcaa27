"""Blockwise (flash) MLA attention == the dense reference paths, and it never holds a [T, S] tensor.

float64 parity of outputs and gradients (flash_attention alone, also over key chunks;
GatedMLA.forward, also after a cache of latent chunks; the fused prefill of decode.py) with left
padding, a cache offset, T and S not multiples of the blocks and blocks smaller than T; then
deterministic memory measures at T = 2048: the largest tensor autograd saves for the backward,
and the largest tensor any op creates (forward and backward).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from policy.k3 import K3Cache, footprint
from policy.k3 import mla as mla_module
from policy.k3.engine import decode as k3_decode
from policy.k3.engine.decode import forward_tokens
from policy.k3.engine.plan import build_plan
from policy.k3.flash import _prefix_width, flash_attention
from policy.k3.mla import _masked_softmax, fused_causal_attention
from tests.policy.k3.test_engine import make_model
from tests.policy.k3.test_mla import hidden, make_mla

F64 = torch.float64


def dense_attention(q_BTHK, k, v, *, scale, offset, key_mask_BS):
    """Reference: full scores, mla._masked_softmax, rows that see no key zeroed."""
    shared = k.dim() == 3
    scores_BHTS = torch.einsum("bthk,bsk->bhts" if shared else "bthk,bshk->bhts", q_BTHK, k)
    rows_T = torch.arange(offset, offset + q_BTHK.shape[1])
    allowed_BTS = (torch.arange(k.shape[1])[None, :] <= rows_T[:, None])[None] & key_mask_BS[
        :, None
    ]
    p_BHTS = _masked_softmax(scores_BHTS * scale, allowed_BTS)
    o_BTHV = torch.einsum("bhts,bsv->bthv" if shared else "bhts,bshv->bthv", p_BHTS, v)
    return o_BTHV * allowed_BTS.any(-1)[..., None, None]


def random_inputs(shared: bool, length=37, past=14, heads=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = past + length
    kshape, vshape = ((2, keys, 7), (2, keys, 5)) if shared else ((2, keys, heads, 7),
                                                                   (2, keys, heads, 5))  # fmt: skip
    tensors = [torch.randn(2, length, heads, 7, generator=gen, dtype=F64)]
    tensors += [torch.randn(s, generator=gen, dtype=F64) for s in (kshape, vshape)]
    key_mask = torch.ones(2, keys, dtype=torch.bool)
    key_mask[0, :20] = False  # row 0: left padding into the new tokens (queries 0..5 see no key)
    key_mask[1, 3:9] = False  # row 1: a hole in the cached part
    return [t.requires_grad_() for t in tensors], key_mask


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("blocks", [(8, 16), (5, 3), (64, 64)])
def test_flash_attention_equals_dense_outputs_and_gradients(shared, blocks):
    (q, k, v), key_mask = random_inputs(shared)
    kwargs = {"scale": 0.3, "offset": 14, "key_mask_BS": key_mask}
    out = flash_attention(q, k, v, **kwargs, block_q=blocks[0], block_k=blocks[1])
    ref = dense_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert (out[0, :6] == 0).all()  # padding queries that see no key output zero
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for g, r in zip(grads, refs, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_flash_attention_without_grad_and_with_a_value_slice_of_the_keys():
    """The engine's form: v is a slice of k (the latent's c_kv), no autograd, no key mask."""
    (q, k, _), _ = random_inputs(True, seed=3)
    with torch.no_grad():
        out = flash_attention(q, k, k[..., :4], scale=0.5, offset=14, block_q=4, block_k=8)
        ref = dense_attention(q, k, k[..., :4], scale=0.5, offset=14,
                              key_mask_BS=torch.ones(k.shape[:2], dtype=torch.bool))  # fmt: skip
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_values_that_are_the_keys_first_columns_share_the_keys_gradient():
    """MLA's absorbed form passes c_kv = latent[..., :R]: recognised as a prefix of the keys
    (one gradient buffer per chunk, dv added into dk's first columns), with the same output and
    gradients as a separate copy of the values, float64."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 9, 3, 6, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(2, 12, 6, generator=gen, dtype=F64, requires_grad=True)
    assert _prefix_width((k,), (k[..., :4],)) == 4
    assert _prefix_width((k,), (k[..., :4].clone(),)) is None  # other memory
    assert _prefix_width((k,), (k[..., 2:],)) is None  # not the first columns
    assert _prefix_width((k,), (k,)) is None  # the whole keys: the plain path
    kwargs = {"scale": 0.5, "offset": 3, "block_q": 4, "block_k": 4}
    out = flash_attention(q, k, k[..., :4], **kwargs)
    k2, v2 = k.detach().clone().requires_grad_(), k.detach()[..., :4].clone().requires_grad_()
    ref = flash_attention(q, k2, v2, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    weight = torch.randn(out.shape, generator=gen, dtype=F64)
    dq, dk = torch.autograd.grad((out * weight).sum(), (q, k))
    dq2, dk2, dv2 = torch.autograd.grad((ref * weight).sum(), (q, k2, v2))
    torch.testing.assert_close(dq, dq2, atol=1e-12, rtol=0)
    torch.testing.assert_close(dk, dk2 + torch.nn.functional.pad(dv2, (0, 2)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("form", ["shared", "per-head", "value slice"])
def test_flash_attention_over_key_chunks_equals_the_concatenated_keys(form):
    """Keys and values as chunks along S (uneven: 2, 11, 1 and 37 of the 51 keys, two shorter
    than a key block of 4) == over their concatenation: the output, and the gradients of q and
    of every chunk (a value chunk that is a slice of its key chunk, as MLA's c_kv of its
    latent: both gradients reach the chunk), float64, with padding and an offset of 14."""
    (q, k, v), key_mask = random_inputs(form != "per-head")
    sizes = [2, 11, 1, 37]
    k_chunks = [c.detach().requires_grad_() for c in k.split(sizes, 1)]
    if form == "value slice":
        v_chunks, leaves = [c[..., :4] for c in k_chunks], [q, *k_chunks]
    else:
        v_chunks = [c.detach().requires_grad_() for c in v.split(sizes, 1)]
        leaves = [q, *k_chunks, *v_chunks]
    kwargs = {"scale": 0.3, "offset": 14, "key_mask_BS": key_mask, "block_q": 8, "block_k": 4}
    out = flash_attention(q, k_chunks, v_chunks, **kwargs)
    ref = flash_attention(q, torch.cat(k_chunks, 1), torch.cat(v_chunks, 1), **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(flash_attention(q, k_chunks, v_chunks, **kwargs), ref)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    grads = torch.autograd.grad((out * weight).sum(), leaves)
    refs = torch.autograd.grad((ref * weight).sum(), leaves)
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["absorbed", "naive", "dense", "at positions"])
def test_gated_mla_over_latent_chunks_equals_one_latent(mode):
    """GatedMLA after a cache of latent chunks (ChunkedLatents, a segmented learner's) == after
    the same latents as one MLACache: outputs and the gradients of the new tokens, of every
    chunk and of the parameters (float64): the chosen (absorbed) form, naive, the dense
    reference and `forward_at`."""
    mla = make_mla(seed=21)
    mla.block_q, mla.block_k = 4, 7
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    chunks = [hidden(2, n, width, seed=22 + n).requires_grad_() for n in (9, 3, 12)]
    key_mask = torch.ones(2, 24, dtype=torch.bool)
    key_mask[1, :10] = False
    x = hidden(2, 11, 32, seed=25).requires_grad_()
    caches = (
        mla_module.ChunkedLatents(tuple(chunks), key_mask),
        mla_module.MLACache(torch.cat(chunks, 1), key_mask),
    )
    results = []
    for cache in caches:
        if mode == "at positions":
            out, _ = mla.forward_at(x, [0, 1, 5, 6, 7, 10], cache=cache)
        else:
            kw = {"absorbed": False} if mode == "naive" else {"dense": mode == "dense"}
            out, _ = mla(x, cache=cache, **kw)
        weights = hidden(*out.shape, seed=26)
        leaves = [x, *chunks, *mla.parameters()]
        results.append((out, torch.autograd.grad((out * weights).sum(), leaves)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def mla_loss(mla, x_prefix, x_new, mask_prefix, *, absorbed, dense):
    """Prefill a left-padded prefix, continue after it (cache offset), weighted sum of both."""
    out_a, cache = mla(x_prefix, mask=mask_prefix, absorbed=absorbed, dense=dense)
    out_b, _ = mla(x_new, cache=cache, absorbed=absorbed, dense=dense)
    gen = torch.Generator().manual_seed(9)
    return (out_a * torch.randn(out_a.shape, generator=gen, dtype=F64)).sum() + (
        out_b * torch.randn(out_b.shape, generator=gen, dtype=F64)
    ).sum(), torch.cat([out_a, out_b], 1)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_gated_mla_blockwise_equals_dense_with_parameter_gradients(absorbed, q_lora_rank):
    mla = make_mla(q_lora_rank=q_lora_rank, seed=2)
    mla.block_q, mla.block_k = 4, 7  # several blocks; T = 13, 19 and S = 13, 32 not multiples
    x_prefix = hidden(2, 13, 32, seed=3).requires_grad_()
    x_new = hidden(2, 19, 32, seed=4).requires_grad_()
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :6] = False
    results = []
    for dense in (True, False):
        loss, out = mla_loss(mla, x_prefix, x_new, mask, absorbed=absorbed, dense=dense)
        leaves = [x_prefix, x_new, *mla.parameters()]
        results.append((out, torch.autograd.grad(loss, leaves)))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert (out[1, :6] == 0).all()
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_fused_causal_attention_equals_dense_outputs_and_gradients():
    """The short-sequence fast path (torch's fused attention; Q = 7 and V = 5 differ)."""
    (q, k, v), _ = random_inputs(shared=False, past=0)
    everything = torch.ones(2, k.shape[1], dtype=torch.bool)
    out = fused_causal_attention(q, k, v, scale=0.3)
    ref = dense_attention(q, k, v, scale=0.3, offset=0, key_mask_BS=everything)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    grads = torch.autograd.grad((out * weights).sum(), [q, k, v])
    ref_grads = torch.autograd.grad((ref * weights).sum(), [q, k, v])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("limit", ["fits", "right padding", "too many scores", "left padding"])
def test_gated_mla_takes_the_fused_path_only_for_short_right_padded_sequences(monkeypatch, limit):
    """GatedMLA.forward (naive form, no cache) == the dense reference, parameter gradients too,
    through the fused path when B * H * T * S <= FUSED_MAX_SCORES and no token follows a pad."""
    calls = []
    real = mla_module.fused_causal_attention
    monkeypatch.setattr(mla_module, "fused_causal_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    if limit == "too many scores":
        monkeypatch.setattr(mla_module, "FUSED_MAX_SCORES", 2 * 3 * 19 * 19 - 1)
    mla, x = make_mla(seed=5), hidden(2, 19, 32, seed=6).requires_grad_()
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :4] = limit != "left padding"
    mask[0, 13:] = limit != "right padding"
    results = []
    for dense in (True, False):
        out, _ = mla(x, mask=mask, absorbed=False, dense=dense)
        weights = hidden(*out.shape, seed=7)
        results.append((out, torch.autograd.grad((out * weights).sum(), [x, *mla.parameters()])))
    assert len(calls) == (1 if limit in ("fits", "right padding") else 0)
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_fused_causal_attention_float32_equal_widths_and_under_autocast():
    """Equal q/k and v widths (k3-tiny's: torch's CPU flash kernel, not its math path) in
    float32 against the blockwise path; under bf16 autocast it still computes in float32."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 40, 2, 16, generator=gen).requires_grad_() for _ in range(3))
    weights = torch.randn(3, 40, 2, 16, generator=gen)
    out = fused_causal_attention(q, k, v, scale=0.25)
    ref = flash_attention(q, k, v, scale=0.25, block_q=8, block_k=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * weights).sum(), [q, k, v])
    ref_grads = torch.autograd.grad((ref * weights).sum(), [q, k, v])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = fused_causal_attention(q, k, v, scale=0.25)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, out.detach(), atol=1e-6, rtol=1e-6)


def test_blockwise_naive_equals_blockwise_absorbed():
    mla = make_mla(seed=8)
    mla.block_q, mla.block_k = 3, 5
    x = hidden(2, 23, 32, seed=6)
    torch.testing.assert_close(mla(x, absorbed=True)[0], mla(x, absorbed=False)[0],
                               atol=1e-10, rtol=0)  # fmt: skip


def test_fused_prefill_with_small_blocks_equals_the_model(monkeypatch):
    """decode.py's prefill by blocks (several per chunk), left padding, a second chunk after
    the cache, then decode steps == the model forward with the dense MLA reference."""
    small = functools.partial(flash_attention, block_q=3, block_k=4)
    monkeypatch.setattr(k3_decode, "flash_attention", small)
    model = make_model()
    plan = build_plan(model)
    tokens = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, :5], mask[1, :14] = 0, 0
    with torch.no_grad():
        for layer in model.model.layers:
            if not layer.is_kda:
                layer.self_attn.forward = functools.partial(layer.self_attn.forward, dense=True)
        full = model(tokens, attention_mask=mask).logits
        cache = K3Cache.empty(model.config, 3, dtype=F64)
        for start, end in ((0, 11), (11, 21)):
            logits, _ = forward_tokens(plan, cache, tokens[:, start:end], mask[:, start:end])
            torch.testing.assert_close(logits, full[:, end - 1], atol=1e-10, rtol=0)
        for t in range(21, 24):
            logits, _ = forward_tokens(plan, cache, tokens[:, t : t + 1])
            torch.testing.assert_close(logits, full[:, t], atol=1e-10, rtol=0)


class _Largest(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def train_step_sizes(length: int, dense: bool) -> tuple[int, int, int]:
    """(largest tensor saved for backward, all saved elements, largest tensor created by any op)
    for one GatedMLA forward + backward on [1, length] tokens, float32, left padding, blocks
    128 x 256."""
    mla = make_mla(seed=1).float()
    mla.block_q, mla.block_k = 128, 256
    x = hidden(1, length, 32, seed=2).float().requires_grad_()
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[0, :7] = False
    saved = []
    with _Largest() as largest:
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t
        ):
            out, _ = mla(x, mask=mask, dense=dense)
        out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    return max(saved), sum(saved), largest.numel


def test_training_memory_is_linear_in_length():
    """At T = 2048 (H = 3) the dense scores hold H*T*T = 12.6M values; blockwise, nothing
    saved or created is bigger than a block of scores or a per-token tensor, and all that is
    saved is a few per-token tensors (a plain autograd loop over the blocks saves ~22M)."""
    length, heads = 2048, 3
    largest_saved, all_saved, created = train_step_sizes(length, dense=False)
    block = heads * 128 * 256  # one block of scores
    per_token = length * max(32, heads * 10)  # hidden states, per-head q / k
    assert largest_saved <= per_token < length * length // 16
    assert all_saved <= 16 * per_token <= length * length // 4
    assert created <= max(block, per_token) < length * length // 16
    # the measure sees the quadratic tensors of the dense path (at T = 512 to stay cheap)
    largest_dense, _, created_dense = train_step_sizes(512, dense=True)
    assert largest_dense >= heads * 512 * 512 and created_dense >= heads * 512 * 512


def test_fused_prefill_memory_is_linear_in_length(monkeypatch):
    """decode.py's MLA over a 2048-token prefill (two rows, left padding) creates no [T, S]
    tensor: the dense form held B*H*T*S = 16.8M scores; one block here is B*H*256*512 = 0.5M."""
    sizes = []

    def measured(*args):
        with _Largest() as largest:
            out = mla(*args)
        sizes.append(largest.numel)
        return out

    mla = k3_decode._mla
    monkeypatch.setattr(k3_decode, "_mla", measured)
    model = make_model(dtype=torch.float32)
    tokens = torch.randint(0, 512, (2, 2048), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, :100] = 0
    cache = K3Cache.empty(model.config, 2, dtype=torch.float32, capacity=2048)
    with torch.no_grad():
        logits, _ = forward_tokens(build_plan(model), cache, tokens, mask)
    assert torch.isfinite(logits).all() and sizes
    assert max(sizes) <= 2 * 2 * 256 * 512 < 2048 * 2048 // 4, sizes


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_training_after_a_cache_absorbed_equals_expanded_outputs_and_gradients(q_lora_rank):
    """A later training segment (tokens after cached latents that need gradients): the
    absorbed form `choose_form` picks equals the expanded (naive) form, outputs and the
    gradients of the inputs, the earlier latents and every parameter, in float64."""
    mla = make_mla(q_lora_rank=q_lora_rank, seed=11)
    mla.block_q, mla.block_k = 4, 7
    x_prefix = hidden(2, 13, 32, seed=12).requires_grad_()
    x_new = hidden(2, 19, 32, seed=13).requires_grad_()
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, :5] = False
    assert mla.choose_form(19, 13) and not mla.choose_form(13, 0) and mla.choose_form(1, 0)
    results = []
    for absorbed in (False, None):  # None: the form the layer chooses (absorbed after a cache)
        _, cache = mla(x_prefix, mask=mask)
        out, _ = mla(x_new, cache=cache, absorbed=absorbed)
        weights = hidden(*out.shape, seed=14)
        leaves = [x_prefix, x_new, *mla.parameters()]
        results.append((out, torch.autograd.grad((out * weights).sum(), leaves)))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("absorb_past", [True, False])
def test_training_after_a_cache_saves_only_the_latents_per_earlier_key(absorb_past):
    """Bytes autograd saves per earlier key for a segment after S cached latents: the latent
    width (L values) absorbed, against at least H * (Q + Dv) + L expanded (here 6.25x the bytes)."""
    mla = make_mla(seed=15)
    mla.absorb_past = absorb_past
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    skip = {p.untyped_storage().data_ptr() for p in mla.parameters()}
    sizes = []
    for keys in (256, 512):
        latent = hidden(1, keys, width, seed=16).requires_grad_()
        cache = mla_module.MLACache(latent, torch.ones(1, keys, dtype=torch.bool))
        with footprint.SavedBytes(skip | {latent.untyped_storage().data_ptr()}) as meter:
            out, _ = mla(hidden(1, 8, 32, seed=17).requires_grad_(), cache=cache)
            sizes.append(sum(meter.by.values()))
        del out
    per_key = (sizes[1] - sizes[0]) / 256
    heads, q, v = mla.num_heads, mla.qk_head_dim, mla.v_head_dim
    if absorb_past:
        assert per_key == width * 8  # the concatenated latents, nothing per head
    else:
        assert per_key >= (heads * (q + v) + width) * 8  # per-head keys and values too
