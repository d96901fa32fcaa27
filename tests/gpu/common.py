"""Helpers of the GPU tests."""

from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def gradients(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient (zeros where there is none), flattened into one vector."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu().ravel()
        for p in model.parameters()
    ])  # fmt: skip
