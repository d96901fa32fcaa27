"""The K3 policy on CUDA against the CPU: forward and backward in fp32 (TF32 off), under bf16
autocast (trainer.autocast: bf16) and with bf16 parameters (what FSDP2's mixed precision
computes in), each compared with the fp32 CPU model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.common import gradients, relative_error
from tests.policy.k3.test_engine import make_model

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def inputs(vocab: int, seed: int = 0):
    """Left-padded ids [3, 40], their mask and random targets."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :7], mask[2, :19] = 0, 0
    return ids, mask, torch.randint(0, vocab, (3, 40), generator=gen)


def forward_backward(model, ids, mask, targets, *, autocast: bool = False, replay=None):
    """(logits, loss, routed experts [M, B*T, K]) of a masked next-token loss, the experts
    replayed from `replay` when given; gradients left in the model."""
    device = next(model.parameters()).device
    ids, mask, targets = ids.to(device), mask.to(device), targets.to(device)
    replay = None if replay is None else replay.to(device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, attention_mask=mask, replay_experts=replay, return_routing=True)
    token_loss = F.cross_entropy(
        out.logits.float().flatten(0, 1), targets.flatten(), reduction="none"
    )
    loss = (token_loss * mask.flatten()).sum() / mask.sum()
    loss.backward()
    return out.logits.detach().float(), loss.detach(), out.routed_experts


@pytest.fixture(params=["k3-debug", "k3-tiny"])
def models(request):
    """(the fp32 CPU model, its fp32 copy on the GPU)."""
    cpu = make_model(dtype=torch.float32, preset=request.param)
    return cpu, copy.deepcopy(cpu).to(CUDA)


def test_forward_backward_fp32_equal_the_cpu(models):
    cpu, gpu = models
    batch = inputs(cpu.config.vocab_size)
    want_logits, want_loss, want_routes = forward_backward(cpu, *batch)
    got_logits, got_loss, got_routes = forward_backward(gpu, *batch)
    assert relative_error(got_logits, want_logits) < 1e-4
    assert abs(float(got_loss) - float(want_loss)) < 1e-4
    assert relative_error(gradients(gpu), gradients(cpu)) < 1e-3
    same = (got_routes.cpu().sort(-1).values == want_routes.sort(-1).values).all(-1)
    assert same.float().mean() > 0.99  # the same experts (a near-tie may flip a token)


@pytest.mark.parametrize("mode", ["autocast", "bf16-params"])
def test_bf16_on_cuda_equals_the_cpu_within_bf16_noise(models, mode):
    """bf16 on the GPU (trainer.autocast: bf16, or bf16 weights: what FSDP2's mixed precision
    computes in; its fp32 gradient reduction needs several ranks, not tested here) against the
    same bf16 computation on the CPU, the CPU's fp32 experts replayed on both (a flipped
    near-tie is not an error). bf16 itself is far from fp32 (logits ~5%, gradients up to ~50%
    on these random models, measured on the CPU), so the bound is relative to that distance:
    the GPU's bf16 may not be farther from the CPU's bf16 than bf16 is from fp32."""
    cpu, gpu = models
    cpu16 = copy.deepcopy(cpu)
    if mode == "bf16-params":
        gpu, cpu16 = gpu.to(torch.bfloat16), cpu16.to(torch.bfloat16)
    batch = inputs(cpu.config.vocab_size, seed=1)
    fp32_logits, fp32_loss, routes = forward_backward(cpu, *batch)
    bf16 = dict(autocast=mode == "autocast", replay=routes)
    want_logits, want_loss, _ = forward_backward(cpu16, *batch, **bf16)
    got_logits, got_loss, _ = forward_backward(gpu, *batch, **bf16)
    assert torch.isfinite(got_logits).all() and torch.isfinite(gradients(gpu)).all()
    noise = relative_error(want_logits, fp32_logits)
    assert relative_error(got_logits, want_logits) <= max(2 * noise, 1e-3), noise
    noise = relative_error(gradients(cpu16), gradients(cpu))
    assert relative_error(gradients(gpu), gradients(cpu16)) <= max(2 * noise, 1e-3), noise
    noise = abs(float(want_loss) - float(fp32_loss))
    assert abs(float(got_loss) - float(want_loss)) <= max(2 * noise, 1e-4), noise
    if mode == "autocast":
        assert all(p.dtype == torch.float32 for p in gpu.parameters())  # fp32 weights, grads
