"""SFT diagnostics (rl/sft/check.py): token accuracy counts only assistant tokens, and each sign
that SFT did not take becomes a warning that says what to change."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rl.config.runfile import load_config
from rl.observe.evaluate import EvalResult
from rl.sft.check import diagnose, token_accuracy


class Oracle(torch.nn.Module):
    """Predicts the next token of `sequence` exactly, except where `wrong_at` says."""

    def __init__(self, sequence: list[int], wrong_at: set[int], vocab: int = 16):
        super().__init__()
        self.sequence, self.wrong_at, self.vocab = sequence, wrong_at, vocab

    def forward(self, input_ids):
        t = input_ids.shape[1]
        logits = torch.zeros(1, t, self.vocab)  # [1, T, V]
        for i in range(t - 1):
            target = self.sequence[i + 1]
            logits[0, i, (target + 1) % self.vocab if i in self.wrong_at else target] = 1.0
        return SimpleNamespace(logits=logits)


def test_token_accuracy_counts_assistant_tokens_only():
    ids = [1, 2, 3, 4, 5, 6]
    example = {"input_ids": ids, "assistant_masks": [0, 0, 0, 1, 1, 1]}  # predict 4, 5, 6
    assert token_accuracy(Oracle(ids, wrong_at=set()), [example]) == 1.0
    assert token_accuracy(Oracle(ids, wrong_at={0, 1}), [example]) == 1.0  # masked positions
    assert token_accuracy(Oracle(ids, wrong_at={3}), [example]) == 2 / 3


def result(success=0.9, tool_calls=10, bad=0, truncated=0.0) -> EvalResult:
    return EvalResult(
        "greedy",
        10,
        1,
        success,
        0.5,
        1.0,
        tool_calls=tool_calls,
        bad_tool_calls=bad,
        truncated=truncated,
    )


def test_a_warm_start_that_took_gives_no_warning():
    cfg = load_config(None)
    report = {"sft/token_accuracy": 0.97, "sft/expert_success": 1.0}
    assert diagnose(cfg, report, {"greedy": result()}) == []
    assert report["sft/tool_call_ok"] == 1.0 and report["sft/greedy_success"] == 0.9


def test_each_sign_of_a_failed_warm_start_says_what_to_change():
    cfg = load_config(None, ["sft.demonstrations=300"])
    report = {"sft/token_accuracy": 0.6, "sft/expert_success": 1.0}
    warnings = diagnose(cfg, report, {"greedy": result(0.1, 20, 8, 0.5)})
    text = "\n".join(warnings)
    assert len(warnings) == 4
    assert "token accuracy on held-out ones is 60%" in text
    assert "sft.demonstrations, now 300" in text and "policy.config" in text
    assert "only 60% of the policy's 20 tool calls ran without an error" in text
    assert "solves 10% of held-out tasks greedily, the expert 100%" in text
    assert "50% of the post-SFT evaluation episodes were truncated" in text
    assert "rollout.max_new_tokens (now 48)" in text


def test_a_policy_that_fits_the_tokens_but_fails_the_tasks_is_told_to_look_at_copies():
    """Token accuracy 98% and greedy success 10% (the Weather fixture after 5 epochs: the city
    was never copied): the warning points at copying and at more epochs."""
    cfg = load_config(None)
    report = {"sft/token_accuracy": 0.98, "sft/expert_success": 1.0}
    (warning,) = diagnose(cfg, report, {"greedy": result(0.1)})
    assert "solves 10% of held-out tasks greedily" in warning
    assert "predicts 98% of the demonstrations' tokens" in warning
    assert "agentrl show RUN_DIR --worst" in warning and "sft.epochs" in warning
    truncated = diagnose(cfg, dict(report), {"greedy": result(0.0, truncated=0.9)})
    assert not any("must copy" in w for w in truncated)  # cut-off turns get their own warning


def test_sft_that_erased_the_warm_ups_copying_is_told_to_rehearse_it():
    """Measured on k3-tiny (docs/benchmarks.md "12-05 (later)"): after the copy warm-up (94%
    of random spans copied), SFT on demonstrations alone left 7-10%."""
    cfg = load_config(None, ["policy.copy_warmup_steps=3000"])
    report = {"sft/token_accuracy": 0.98, "sft/expert_success": 1.0, "sft/copy_accuracy": 0.1}
    (warning,) = diagnose(cfg, report, {})
    assert "copies 10% of random spans" in warning and "sft.copy_rehearsal, now 0" in warning
    assert diagnose(cfg, {**report, "sft/copy_accuracy": 0.6}, {}) == []
    no_warmup = load_config(None)  # nothing taught, nothing erased: no warning
    assert diagnose(no_warmup, dict(report), {}) == []
