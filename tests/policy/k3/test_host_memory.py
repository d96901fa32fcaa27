"""The segmented forward hands the C heap's free pages back between segments (host_memory.py):
called once per segment on a CPU (and per recomputed segment in the backward) when a sequence
runs as several, never for one segment or when the decoder's `release_heap` is off, and it
keeps the process's resident memory down (a child process each, so that peak RSS is the step's
own)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3 import segments as segments_module
from policy.k3.host_memory import release_free_heap
from policy.k3.segments import segmented_hidden

CHILD = """
import json, sys, torch
from benchmarks.long_learner import reset_peak_rss, status_bytes
from policy.k3 import K3ForCausalLM, k3_preset
from policy.logprobs import TokenLogprobs
torch.set_num_threads(1)
torch.manual_seed(0)
model = K3ForCausalLM(k3_preset("k3-tiny"))
model.model.release_heap = sys.argv[1] == "1"
trunk = TokenLogprobs(model, segment_tokens=512)
def step(length):
    ids_BT = torch.randint(1, 768, (1, length), generator=torch.Generator().manual_seed(0))
    select_BT = torch.zeros(1, length - 1, dtype=torch.bool)
    select_BT[:, -16:] = True
    logp_BT, _, _, _ = trunk(ids_BT, torch.ones_like(ids_BT), 1.0, select_BT)
    (-(logp_BT * select_BT).sum()).backward()
step(1024)
before = reset_peak_rss()  # the high-water mark restarts from here
step(8192)
print(json.dumps((status_bytes("VmHWM") - before) / 2**20))
"""


def test_release_free_heap_runs_here():
    assert isinstance(release_free_heap(), bool)


@pytest.mark.parametrize("release", [True, False])
def test_each_segment_releases_the_heap_unless_switched_off(monkeypatch, release):
    calls = []
    monkeypatch.setattr(segments_module, "release_free_heap", lambda: calls.append(1))
    model = K3ForCausalLM(k3_preset("k3-debug"))
    model.model.release_heap = release
    ids_BT = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    hidden_BTD, _ = segmented_hidden(model.model, ids_BT, None, segment=16)
    assert len(calls) == (3 if release else 0)  # 16 + 16 + 8 tokens
    hidden_BTD.sum().backward()
    assert len(calls) == (6 if release else 0)  # and each recomputed segment


def test_a_forward_of_one_segment_leaves_the_heap_alone(monkeypatch):
    """A short micro-batch (one segment, as every shared-prefix forward of the learner) keeps
    its heap for the next one: trimming it there made an async learner's step ~1.5x as long."""
    calls = []
    monkeypatch.setattr(segments_module, "release_free_heap", lambda: calls.append(1))
    model = K3ForCausalLM(k3_preset("k3-debug"))
    ids_BT = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    for segment in (40, 64):
        hidden_BTD, _ = segmented_hidden(model.model, ids_BT, None, segment=segment)
        hidden_BTD.sum().backward()
    assert calls == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_released_heap_keeps_the_long_step_resident_memory_down():
    """k3-tiny, 8,192 tokens in segments of 512, forward + backward: the peak RSS growth with
    the heap released per segment is well under half of what glibc keeps otherwise."""
    growth = {}
    for release in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", CHILD, release], capture_output=True,
                             text=True, timeout=600, check=True)  # fmt: skip
        growth[release] = json.loads(out.stdout.strip().splitlines()[-1])
    assert growth["1"] * 2 < growth["0"], growth
