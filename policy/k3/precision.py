"""Numerically sensitive K3 kernels run in full precision even under autocast.

`torch.autocast(..., dtype=torch.bfloat16)` (the learner's `trainer.autocast: bf16`) runs every
matmul in bf16, including the ones inside the KDA state recurrence, the blockwise attention's
softmax statistics, the AttnRes depth softmax and the router scores. Those functions already
compute in (at least) fp32 from whatever dtype they are given; `full_precision` makes autocast
leave them so: it switches autocast off for the call (on the device of the first tensor
argument). Their inputs and outputs keep the dtypes the surrounding autocast code produced.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def full_precision(fn):
    """Decorator: call `fn` with autocast disabled when it is enabled (otherwise unchanged)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        if not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return run
