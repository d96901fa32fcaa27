"""Shared fixtures of the K3 layer tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add scheduling latency on busy shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
