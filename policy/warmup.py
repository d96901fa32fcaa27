"""Copy warm-up: teach a freshly built policy to copy from its context before SFT.

Every pretrained LLM can continue a span it has seen earlier in its context (induction), and
tool use leans on it everywhere: a name from the question into a note, a tool's result into
the next call's argument. The tiny policies agentrl builds offline start from random weights
and see only a few thousand expert demonstrations, and a hybrid K3 policy does not pick the
skill up from those: measured (docs/benchmarks.md "In-context copying"), k3-tiny trained on
repeated random sequences stays at chance for ~1,700 steps before its copy loss falls, where a
dense Qwen3 of the same width learns it in ~100; SFT of k3-tiny on 3,000 LongHorizon
demonstrations (1,125 steps) left it writing invented names in place of the question's.

The warm-up trains on sequences `x y x z` (a random span x of `length` tokens, a random gap y of
0 .. length - 1 tokens, the span again, random tokens z) with the loss on the repeat only:
nothing to learn there but copying, at a distance that varies, so that no fixed offset does
it. Tokens are drawn from `token_ids` (the tokenizer's ordinary tokens: no chat markers), so no
word or task is taught. Plain torch; the caller saves the model.

Letters: B batch, N span length, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CopyWarmup:
    """Settings of `copy_warmup`: the most optimizer steps, sequences per step, span length,
    AdamW lr, and the copy accuracy on a step's batch that ends the warm-up early (checked every
    `check_every` steps; above 1: never)."""

    steps: int
    batch: int = 32
    length: int = 32
    lr: float = 2e-3
    seed: int = 0
    done_at: float = 0.95
    check_every: int = 50


def copy_batch(token_ids_V: Tensor, batch: int, length: int, generator: torch.Generator):
    """-> input ids [B, 3N] and the targets' mask [B, 3N - 1]: per row a span of N random tokens,
    `gap` random tokens (0 <= gap < N, per row), the span again, random tokens to the end; the
    mask is True where the next token is a copy the context determines (the repeat's 2nd token
    on). The gap varies the distance between the span and its repeat (N .. 2N - 1), so a fixed
    offset (a RoPE model's shortcut) does not solve it: only finding the earlier occurrence of
    the current token and copying what followed it does."""
    ids_B3N = token_ids_V[torch.randint(len(token_ids_V), (batch, 3 * length), generator=generator)]
    gap_B = torch.randint(length, (batch,), generator=generator)
    repeat_BN = length + gap_B[:, None] + torch.arange(length)  # where the span comes again
    ids_B3N.scatter_(1, repeat_BN, ids_B3N[:, :length])
    copyable = torch.zeros(batch, 3 * length - 1, dtype=torch.bool)
    copyable.scatter_(1, repeat_BN[:, :-1], True)  # position t predicts t + 1
    return ids_B3N, copyable


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
    """Train `model` (a causal LM, in place, on its own device) on copy sequences for up to
    `settings.steps` steps, until a step's batch is copied at `settings.done_at` ->
    {"copy_warmup/accuracy": greedy copy accuracy on a fresh batch after training (chance:
    1 / len(token_ids)), "copy_warmup/loss", "copy_warmup/steps", "copy_warmup/seconds"}.
    `progress` gets a line every `every_s` seconds; `on_check(step, loss, accuracy)` is called
    at every check (each `settings.check_every` steps)."""
    device = next(model.parameters()).device
    token_ids_V = torch.tensor(list(token_ids), dtype=torch.long)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    model.train()
    start = shown = time.perf_counter()
    step = 0
    for step in range(1, settings.steps + 1):
        ids, copyable = copy_batch(token_ids_V, settings.batch, settings.length, generator)
        loss, accuracy = copy_loss(model, ids.to(device), copyable.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if progress is not None and time.perf_counter() - shown > every_s:
            shown = time.perf_counter()
            progress(
                f"copy warm-up: step {step}/{settings.steps}, loss {loss.item():.3f}, "
                f"copy accuracy {accuracy:.1%} ({shown - start:.0f} s)"
            )
        if step % settings.check_every:
            continue
        if on_check is not None:
            on_check(step, loss.item(), accuracy)
        if accuracy >= settings.done_at:
            break
    model.eval()
    with torch.no_grad():
        ids, copyable = copy_batch(token_ids_V, settings.batch, settings.length, generator)
        loss, accuracy = copy_loss(model, ids.to(device), copyable.to(device))
    return {
        "copy_warmup/accuracy": accuracy,
        "copy_warmup/loss": loss.item(),
        "copy_warmup/steps": step,
        "copy_warmup/seconds": time.perf_counter() - start,
    }
