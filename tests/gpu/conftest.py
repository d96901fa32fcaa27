"""The GPU tests: every module here is marked `gpu` and skips without a CUDA device
(tests/conftest.py); benchmarks/gpu_check.sh runs them on a GPU machine.

fp32 comparisons with the CPU run with TF32 off (cuDNN convolutions use it by default, which
would turn a 1e-6 agreement into a 1e-3 one); bf16 results are compared with fp32 CPU ones.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
