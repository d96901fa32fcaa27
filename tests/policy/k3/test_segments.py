"""The segmented K3 decoder (policy/k3/segments.py): the same hidden states and gradients as one
forward over the whole sequence (float64), with left padding, routing replay and segment sizes
that do and do not divide T; peak memory of forward + backward that grows with the segment, not
with T; bf16 autocast keeps the sensitive parts in fp32."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from policy.k3.attn_res import attn_res
from policy.k3.footprint import PeakBytes
from policy.k3.segments import segmented_hidden
from policy.logprobs import decoder_hidden
from tests.policy.k3.test_engine import make_model

F64 = torch.float64
LAYERS = {"kda_layers": [1, 3], "full_attn_layers": [2, 4]}  # two MLA layers, two KDA


def two_mla_model(dtype=F64):
    la = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, **LAYERS}
    return make_model(dtype, linear_attn_config=la)


def batch(length=300, pad=37, seed=0, vocab=512):
    """Two rows, the second left-padded by `pad` tokens (mask [2, T])."""
    gen = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(1, vocab, (2, length), generator=gen)
    mask_BT = torch.ones(2, length, dtype=torch.long)
    mask_BT[1, :pad] = 0
    ids_BT[1, :pad] = 0
    return ids_BT, mask_BT


def hidden_and_grads(model, ids_BT, mask_BT, segment, replay=None):
    """Hidden states at real positions and every parameter's gradient of a fixed projection."""
    model.zero_grad(set_to_none=True)
    decoder = model.get_decoder()
    if segment:
        hidden_BTD, _ = segmented_hidden(
            decoder, ids_BT, mask_BT, segment=segment, replay_experts=replay
        )
    else:
        out = decoder(ids_BT, attention_mask=mask_BT, replay_experts=replay)
        hidden_BTD = out.last_hidden_state
    real_ND = hidden_BTD[mask_BT.bool()]
    weights_ND = torch.randn(real_ND.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (real_ND * weights_ND.to(real_ND.dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return real_ND.detach(), grads


def random_replay(model, ids_BT, seed=2):
    """Valid expert choices (distinct per token) unlike the live routing: [M, B*T, K]."""
    config = model.config
    sparse = sum(kind == "sparse" for kind in config.mlp_types)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(sparse, ids_BT.numel(), config.num_experts, generator=gen)
    return scores.argsort(-1)[..., : config.num_experts_per_token]


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("segment", [64, 100])
def test_segmented_hidden_and_gradients_equal_unsegmented(segment, replay):
    """300 tokens: segments of 64 (not dividing T; a segment boundary inside the left padding
    of row 1) and 100 (dividing T), against one forward, to 1e-10 in float64."""
    model = two_mla_model()
    ids_BT, mask_BT = batch()
    experts = random_replay(model, ids_BT) if replay else None
    ref_hidden, ref_grads = hidden_and_grads(model, ids_BT, mask_BT, 0, experts)
    seg_hidden, seg_grads = hidden_and_grads(model, ids_BT, mask_BT, segment, experts)
    torch.testing.assert_close(seg_hidden, ref_hidden, rtol=0, atol=1e-10)
    assert seg_grads.keys() == ref_grads.keys() and len(ref_grads) > 50
    for name, grad in ref_grads.items():
        torch.testing.assert_close(seg_grads[name], grad, rtol=1e-10, atol=1e-10, msg=name)


class _LatentConcats(TorchDispatchMode):
    """Records the shape of every aten.cat output [B, n, width] with n > `longest` tokens."""

    def __init__(self, width: int, longest: int) -> None:
        super().__init__()
        self.width, self.longest, self.long, self.short = width, longest, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.dim() == 3 and out.shape[-1] == self.width:
            if out.shape[1] > self.longest:
                self.long.append(tuple(out.shape))
            else:
                self.short += 1
        return out


def test_segments_attend_over_the_latent_chunks_without_concatenating_them():
    """Forward and backward (each segment recomputed) over 120 tokens in segments of 32: no
    op concatenates latents [B, n, L] over more than one segment's tokens (the earlier
    segments' chunks are read in place); the probe does see each segment's own latents made
    by a concatenation ([c_kv | k_rope], 32 tokens at most)."""
    model = two_mla_model()
    mla = next(layer.self_attn for layer in model.model.layers if not layer.is_kda)
    ids_BT, mask_BT = batch(length=120, pad=20)
    with _LatentConcats(mla.kv_lora_rank + mla.qk_rope_head_dim, 32) as probe:
        hidden_BTD, _ = segmented_hidden(model.get_decoder(), ids_BT, mask_BT, segment=32)
        hidden_BTD.square().sum().backward()
    assert probe.long == [] and probe.short > 0, (probe.long, probe.short)


def test_routing_record_and_logprob_path_match():
    """return_routing concatenates the segments' choices in K3Model's token order, and
    decoder_hidden(segment_tokens=...) gives the unsegmented result."""
    model = two_mla_model()
    ids_BT, mask_BT = batch(length=120, pad=50)
    with torch.no_grad():
        ref_BTD, ref_MXK = decoder_hidden(model, ids_BT, mask_BT, return_routing=True)
        seg_BTD, seg_MXK = decoder_hidden(
            model, ids_BT, mask_BT, segment_tokens=32, return_routing=True
        )
    real_BT = mask_BT[:, :-1].bool()
    torch.testing.assert_close(seg_BTD[real_BT], ref_BTD[real_BT], rtol=0, atol=1e-10)
    valid_X = mask_BT.bool().reshape(-1)
    assert torch.equal(seg_MXK[:, valid_X], ref_MXK[:, valid_X])


def test_segments_need_a_k3_decoder(tiny_model):
    ids_BT = torch.randint(1, 50, (1, 20))
    with pytest.raises(ValueError, match="needs a K3 policy"):
        decoder_hidden(tiny_model, ids_BT, torch.ones_like(ids_BT), segment_tokens=8)


def peak_bytes(model, ids_BT, mask_BT, segment: int) -> int:
    with PeakBytes() as meter:
        hidden_BTD = decoder_hidden(model, ids_BT, mask_BT, segment_tokens=segment)
        hidden_BTD.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


def test_segmented_peak_memory_is_several_times_smaller():
    """2048 tokens: segments of 256 keep a fraction of the unsegmented forward + backward's
    peak (which holds every position's activations at once)."""
    model = make_model(torch.float32)
    ids_BT = torch.randint(1, 512, (1, 2048), generator=torch.Generator().manual_seed(0))
    mask_BT = torch.ones_like(ids_BT)
    whole = peak_bytes(model, ids_BT, mask_BT, 0)
    segmented = peak_bytes(model, ids_BT, mask_BT, 256)
    assert segmented * 3 < whole, (segmented, whole)


def test_bf16_autocast_keeps_attn_res_in_fp32():
    """Under autocast the AttnRes depth softmax is computed from fp32 (only its result is
    rounded to the input's bf16), not from bf16 matmuls."""
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, 5, 64, generator=gen).bfloat16() for _ in range(3)]
    partial = torch.randn(2, 5, 64, generator=gen).bfloat16()
    proj, norm = torch.randn(1, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    exact = attn_res(partial.float(), [b.float() for b in blocks], proj, norm, 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = attn_res(partial, blocks, proj, norm, 1e-6)
    assert mixed.dtype == torch.bfloat16
    assert torch.equal(mixed, exact.bfloat16())


def test_bf16_autocast_segmented_forward_close_to_fp32():
    model = two_mla_model(torch.float32)
    ids_BT, mask_BT = batch(length=96, pad=20)
    real_BT = mask_BT[:, :-1].bool()
    with torch.no_grad():
        exact_BTD = decoder_hidden(model, ids_BT, mask_BT, segment_tokens=40)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed_BTD = decoder_hidden(model, ids_BT, mask_BT, segment_tokens=40)
    error = (mixed_BTD.float() - exact_BTD)[real_BT].norm() / exact_BTD[real_BT].norm()
    assert torch.isfinite(mixed_BTD[real_BT]).all() and error < 0.05, error
