"""The learner's AdamW: torch's fused kernel for plain tensors, the looped update's result."""

from __future__ import annotations

import torch

from rl.learner.optim import adamw, can_fuse


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5, 3), (7,), (2, 2, 2))]


def test_plain_tensors_take_the_fused_kernel_and_the_same_update():
    fused_params, loop_params = _params(0), _params(0)
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.1)
    looped = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True
    for step in range(3):
        grads = _params(10 + step)
        for opt, params in ((fused, fused_params), (looped, loop_params)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.detach().clone()
            opt.step()
    for a, b in zip(fused_params, loop_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_tensor_subclass_keeps_the_default():
    """FSDP2's parameters are DTensors; any subclass stays on torch's default path."""

    class Sub(torch.Tensor):
        pass

    params = [torch.nn.Parameter(torch.zeros(3).as_subclass(Sub))]
    assert not can_fuse(params)
    assert adamw(params, lr=1e-3, weight_decay=0.0).defaults["fused"] is None
