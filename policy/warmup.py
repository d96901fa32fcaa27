"""Copy warm-up: teach a freshly built policy to copy from its context before SFT.

Every pretrained LLM can continue a span it has seen earlier in its context (induction), and
tool use leans on it everywhere: a name from the question into a note, a tool's result into
the next call's argument. The tiny policies agentrl builds offline start from random weights
and see only a few thousand expert demonstrations, and a hybrid K3 policy does not pick the
skill up from those: measured (docs/benchmarks.md "In-context copying"), SFT of k3-tiny on
3,000 LongHorizon demonstrations (1,125 steps) left it writing invented names in place of the
question's (0 of 50 first notes copied it).

The warm-up trains on sequences `w x y x z` (0 .. `lead` random tokens w, a random span x of
`length` tokens, a random gap y of 0 .. length - 1 tokens, the span again, random tokens z) with
the loss on the repeat only: nothing to learn there but copying, at a distance and from a place
that vary, so that neither a fixed offset nor "copy the sequence's start" does it (the second
shortcut is what k3-tiny learned while every span started at position 0, and it is of no use
in a document). Tokens are drawn from `token_ids` (the tokenizer's ordinary tokens: no chat
markers), so no word or task is taught. Plain torch; the caller saves the model.

It climbs a ladder: first spans of 8 tokens drawn from 16 of them, then 16 from 64, then the
full task (`CopyWarmup.ladder`), each rung until a batch is copied at `done_at`. Measured
(docs/benchmarks.md "In-context copying"), k3-tiny put straight on the full task was still at
chance after 4,050 steps; up the ladder it copied 50% of the full task at step 700 and 90% at
925, in ~3 minutes (the first two rungs take ~525 steps: with few distinct tokens a
previous-token feature is cheap to learn, and the circuit that uses it carries over to the full
vocabulary). The dense Qwen3 of the template needs no ladder (straight: 50% at 650). Those
figures put every span at position 0; with the lead (docs/benchmarks.md "Copying from
anywhere") the ladder takes 1,275 steps and the full task reaches 90% at step 2,300 (~21 min),
and the model copies 86% of spans that start anywhere in the first 512 tokens (the old: 31%).

Letters: B batch, N span length, V vocabulary, W sequence width (lead + 3N).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LEAD = 128  # the full task's most random tokens before the span (the warm-up's and SFT's)


@dataclass(frozen=True)
class CopyWarmup:
    """Settings of `copy_warmup`: the most optimizer steps (all rungs together), sequences per
    step, span length of the full task, the most random tokens before its span (`lead`), AdamW
    lr, and the copy accuracy on a step's batch that ends a rung (checked every `check_every`
    steps; above 1: never; 90%: with a lead, a rung of 16 distinct tokens holds the same token
    several times, the copy is ambiguous, and k3-tiny stayed at ~94% on it for 1,900 steps).
    `ladder`: the easier rungs before the full task, as (distinct tokens, span length, lead)
    triples; () puts the model straight on the full task. Rungs without a lead do not prepare
    the full task's: k3-tiny then sat at chance on it for 450 steps (their spans at position 0
    teach the shortcut the lead removes)."""

    steps: int
    batch: int = 32
    length: int = 32
    lead: int = LEAD
    lr: float = 2e-3
    seed: int = 0
    done_at: float = 0.9
    check_every: int = 25
    ladder: tuple[tuple[int, int, int], ...] = ((16, 8, 56), (64, 16, 96))


def copy_batch(
    token_ids_V: Tensor, batch: int, length: int, generator: torch.Generator, lead: int = 0
):
    """-> input ids [B, L + 3N] (L = `lead`) and the targets' mask [B, L + 3N - 1]: per row
    0 .. L random tokens, a span of N random tokens, `gap` random tokens (0 <= gap < N, per
    row), the span again, random tokens to the end; the mask is True where the next token is a
    copy the context determines (the repeat's 2nd token on). The gap varies the distance
    between the span and its repeat (N .. 2N - 1), so a fixed offset (a RoPE model's shortcut)
    does not solve it; the lead varies where the span starts, so "copy from the start of the
    sequence" does not either (a model warmed up with every span at position 0 copied 95% of
    such spans and 0% of spans 128 tokens in: docs/benchmarks.md "Copying from anywhere").
    Only finding the earlier occurrence of the current tokens and copying what followed does."""
    width = lead + 3 * length
    ids_BW = token_ids_V[torch.randint(len(token_ids_V), (batch, width), generator=generator)]
    start_B1 = torch.zeros(batch, 1, dtype=torch.long)  # lead 0: the stream of old runs
    if lead:
        start_B1 = torch.randint(lead + 1, (batch, 1), generator=generator)
    gap_B1 = torch.randint(length, (batch, 1), generator=generator)
    span_BN = start_B1 + torch.arange(length)
    repeat_BN = span_BN + length + gap_B1  # where the span comes again
    ids_BW.scatter_(1, repeat_BN, ids_BW.gather(1, span_BN))
    copyable = torch.zeros(batch, width - 1, dtype=torch.bool)
    copyable.scatter_(1, repeat_BN[:, :-1], True)  # position t predicts t + 1
    return ids_BW, copyable


def copy_examples(
    token_ids: Sequence[int], count: int, length: int = 32, *, seed: int = 0, lead: int = 0
) -> list[tuple[list[int], list[int]]]:
    """`count` of `copy_batch`'s sequences as SFT examples: (ids, labels mask) pairs, the mask
    1 on each token the context determines (the repeat's 2nd token on), in the layout of an
    SFT example's assistant mask (token t is a target), so that SFT can rehearse copying."""
    generator = torch.Generator().manual_seed(seed)
    token_ids_V = torch.tensor(list(token_ids), dtype=torch.long)
    ids_BW, copyable = copy_batch(token_ids_V, count, length, generator, lead)
    targets = torch.nn.functional.pad(copyable, (1, 0))  # [B, W]: t predicts t + 1
    return [(ids, mask) for ids, mask in zip(ids_BW.tolist(), targets.int().tolist(), strict=True)]


def ordinary_token_ids(tokenizer) -> list[int]:
    """A tokenizer's ids less its special ones (chat markers, padding): what copy tasks use."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def copy_loss(model, ids_BT: Tensor, copyable: Tensor) -> tuple[Tensor, float]:
    """Cross-entropy over the copyable next tokens (`copy_batch`'s ids [B, T] and mask
    [B, T - 1]) -> (loss, their greedy accuracy)."""
    logits = model(input_ids=ids_BT).logits[:, :-1]  # [B, T - 1, V]
    targets = ids_BT[:, 1:]
    chosen_logits, chosen_targets = logits[copyable], targets[copyable]
    loss = torch.nn.functional.cross_entropy(chosen_logits.float(), chosen_targets)
    accuracy = (chosen_logits.argmax(-1) == chosen_targets).float().mean().item()
    return loss, accuracy


def copy_warmup(
    model,
    token_ids: Sequence[int],
    settings: CopyWarmup,
    *,
    progress: Callable[[str], None] | None = None,
    every_s: float = 30.0,
    on_check: Callable[[int, float, float], None] | None = None,
) -> dict[str, float]:
    """Train `model` (a causal LM, in place, on its own device) on copy sequences up the ladder
    for up to `settings.steps` steps in all, each rung until a step's batch is copied at
    `settings.done_at` -> {"copy_warmup/accuracy": greedy copy accuracy of the full task on a
    fresh batch after training (chance: 1 / len(token_ids)), "copy_warmup/loss",
    "copy_warmup/steps", "copy_warmup/seconds", "copy_warmup/rungs" (rungs passed, the full
    task included)}. `progress` gets a line every `every_s` seconds;
    `on_check(step, loss, accuracy)` is called at every check (each `settings.check_every`
    steps)."""
    device = next(model.parameters()).device
    token_ids_V = torch.tensor(list(token_ids), dtype=torch.long)
    rungs = [(token_ids_V[:count], length, lead) for count, length, lead in settings.ladder]
    rungs.append((token_ids_V, settings.length, settings.lead))
    run = _Run(model, settings, device, progress=progress, every_s=every_s, on_check=on_check)
    model.train()
    passed = 0
    for rung_ids_V, length, lead in rungs:
        if run.step >= settings.steps or not run.climb(rung_ids_V, length, lead):
            break
        passed += 1
    model.eval()
    with torch.no_grad():
        ids, copyable = copy_batch(
            token_ids_V, settings.batch, settings.length, run.generator, settings.lead
        )
        loss, accuracy = copy_loss(model, ids.to(device), copyable.to(device))
    return {
        "copy_warmup/accuracy": accuracy,
        "copy_warmup/loss": loss.item(),
        "copy_warmup/steps": run.step,
        "copy_warmup/seconds": time.perf_counter() - run.start,
        "copy_warmup/rungs": passed,
    }


class _Run:
    """One warm-up's step count, data stream and progress output."""

    def __init__(self, model, settings: CopyWarmup, device, *, progress, every_s, on_check):
        self.model, self.settings, self.device = model, settings, device
        self.progress: Callable[[str], None] | None = progress
        self.every_s = every_s
        self.on_check: Callable[[int, float, float], None] | None = on_check
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step = 0
        self.start = self.shown = time.perf_counter()

    def climb(self, token_ids_V: Tensor, length: int, lead: int) -> bool:
        """Train on spans of `length` tokens from `token_ids_V` (after 0 .. `lead` others)
        until a checked batch is copied at done_at (-> True) or the step budget ends
        (-> False). Each rung starts a fresh AdamW: with the moments carried over (their
        estimates for the tokens a rung never used are ~0), k3-tiny reached 50% on the full task
        at step ~1,025, fresh at ~700 (one run each, spans at position 0)."""
        settings = self.settings
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr)
        while self.step < settings.steps:
            self.step += 1
            ids, copyable = copy_batch(token_ids_V, settings.batch, length, self.generator, lead)
            loss, accuracy = copy_loss(self.model, ids.to(self.device), copyable.to(self.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            value = loss.item()
            self._report(value, accuracy, len(token_ids_V), length)
            if self.step % settings.check_every:
                continue
            if self.on_check is not None:
                self.on_check(self.step, value, accuracy)
            if accuracy >= settings.done_at:
                return True
        return False

    def _report(self, loss: float, accuracy: float, tokens: int, length: int) -> None:
        if self.progress is None or time.perf_counter() - self.shown <= self.every_s:
            return
        self.shown = time.perf_counter()
        self.progress(
            f"copy warm-up: step {self.step}/{self.settings.steps} (spans of {length} from "
            f"{tokens} tokens), loss {loss:.3f}, copy accuracy {accuracy:.1%} "
            f"({self.shown - self.start:.0f} s)"
        )
