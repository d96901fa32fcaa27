"""Copy warm-up (policy/warmup.py): its batches, and that it teaches a fresh model to copy."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from policy.hf import build_model
from policy.warmup import CopyWarmup, copy_batch, copy_examples, copy_warmup

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


def test_a_lead_moves_the_span_so_no_fixed_start_finds_it():
    """Spans at position 0 taught k3-tiny to copy the sequence's start, 0% of spans 128
    tokens in (docs/benchmarks.md "Copying from anywhere"): with a lead they start anywhere in
    0 .. lead, and the repeat still copies its own span."""
    token_ids = torch.arange(10, 60)
    ids, copyable = copy_batch(token_ids, 64, 8, torch.Generator().manual_seed(0), lead=40)
    assert ids.shape == (64, 64) and copyable.shape == (64, 63)
    starts = set()
    for row, mask in zip(ids, copyable, strict=True):
        marked = mask.nonzero().flatten().tolist()
        repeat = marked[0]
        assert marked == list(range(repeat, repeat + 7))
        span = [
            s
            for s in range(0, 41)
            if 8 <= repeat - s < 16 and torch.equal(row[s : s + 8], row[repeat : repeat + 8])
        ]
        assert span, "the repeat copies a span 8-15 tokens before it"
        starts.add(min(span))
    assert len(starts) > 20 and max(starts) > 30  # spread over the lead
    unled = copy_batch(token_ids, 64, 8, torch.Generator().manual_seed(0))[0]
    assert torch.equal(
        unled, copy_batch(token_ids, 64, 8, torch.Generator().manual_seed(0), lead=0)[0]
    )


def test_the_warm_up_teaches_a_fresh_model_to_copy():
    model = build_model("qwen3", TINY_DENSE, vocab_size=300, seed=0)
    before = copy_warmup(model, range(4, 300), CopyWarmup(0, length=8))
    # This 2-layer model climbs to ~60% by step ~700 and then plateaus at ~80% (measured: no
    # checked batch reached 90% in 4,000 steps), so the rung ends at 60%: well before the cap.
    after = copy_warmup(
        model, range(4, 300), CopyWarmup(3000, length=8, lead=16, done_at=0.6, ladder=())
    )
    assert before["copy_warmup/accuracy"] < 0.05  # chance is 1 / 296
    assert after["copy_warmup/accuracy"] > 0.4  # on a fresh batch, after a batch at 60%
    assert after["copy_warmup/steps"] < 3000  # it ended early, once a batch was copied


class _Induction(torch.nn.Module):
    """A fake causal LM that copies perfectly (predicts what followed the last earlier
    occurrence of the current token), recording the ids [B, T] it is shown."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.bias, self.seen = vocab, torch.nn.Parameter(torch.zeros(vocab)), []

    def forward(self, input_ids):
        self.seen.append(input_ids)
        batch, length = input_ids.shape
        logits = self.bias.expand(batch, length, self.vocab).clone()
        for b in range(batch):
            for t in range(1, length - 1):
                earlier = (input_ids[b, :t] == input_ids[b, t]).nonzero()
                if len(earlier):
                    logits[b, t, input_ids[b, earlier[-1, 0] + 1]] += 100.0
        return SimpleNamespace(logits=logits)


def test_the_ladder_climbs_from_few_tokens_and_short_spans_to_the_full_task():
    model = _Induction(vocab=300)
    settings = CopyWarmup(10, batch=4, length=8, lead=5, ladder=((16, 2, 1), (64, 4, 3)),
                          check_every=1, done_at=0.5)  # fmt: skip
    result = copy_warmup(model, range(4, 300), settings)
    assert result["copy_warmup/rungs"] == 3 and result["copy_warmup/steps"] == 3
    seen = zip(model.seen, (16, 64, 296), strict=False)  # the last call: the final check
    rungs = [(int(ids.max()) < 4 + count, ids.shape[1]) for ids, count in seen]
    assert rungs == [(True, 7), (True, 15), (True, 29)]  # lead + 3 x span length per rung


def test_copy_examples_label_exactly_the_tokens_the_context_determines():
    """SFT's layout (rl/sft): mask[t] = 1 when token t is a target; here the repeat's 2nd token
    on, each equal to the token one span-plus-gap earlier."""
    examples = copy_examples(range(10, 60), 16, 8, seed=3)
    assert len(examples) == 16
    for ids, mask in examples:
        assert len(ids) == len(mask) == 24
        marked = [t for t, m in enumerate(mask) if m]
        assert len(marked) == 7 and marked == list(range(marked[0], marked[0] + 7))
        repeat = marked[0] - 1  # the repeat's first token: not determined
        assert ids[repeat : repeat + 8] == ids[:8] and 8 <= repeat < 16
    assert copy_examples(range(10, 60), 16, 8, seed=3) == examples  # reproducible
