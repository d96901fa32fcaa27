"""Copy warm-up (policy/warmup.py): its batches, and that it teaches a fresh model to copy."""

from __future__ import annotations

import torch

from policy.hf import build_model
from policy.warmup import CopyWarmup, copy_batch, copy_warmup

TINY_DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip


def test_a_copy_batch_repeats_its_span_at_varying_distances_and_marks_the_copies():
    token_ids = torch.arange(10, 60)
    ids, copyable = copy_batch(token_ids, 64, 8, torch.Generator().manual_seed(0))
    assert ids.shape == (64, 24) and copyable.shape == (64, 23)
    assert bool(((ids >= 10) & (ids < 60)).all())
    starts = set()
    for row, mask in zip(ids, copyable, strict=True):
        marked = mask.nonzero().flatten().tolist()  # position t predicts t + 1
        start = marked[0]  # the repeat's first token: not determined by the context
        assert marked == list(range(start, start + 7)) and 8 <= start < 16
        assert torch.equal(row[start : start + 8], row[:8])
        starts.add(start)
    assert len(starts) > 4  # the distance varies


def test_the_warm_up_teaches_a_fresh_model_to_copy():
    model = build_model("qwen3", TINY_DENSE, vocab_size=300, seed=0)
    before = copy_warmup(model, range(4, 300), CopyWarmup(0, length=8))
    after = copy_warmup(model, range(4, 300), CopyWarmup(4000, length=8, done_at=0.9))
    assert before["copy_warmup/accuracy"] < 0.05  # chance is 1 / 296
    assert after["copy_warmup/accuracy"] > 0.7  # on a fresh batch, after a batch at 90%
    assert after["copy_warmup/steps"] < 4000  # it ended early, once a batch was copied
