"""Can a policy copy by a key longer than one token? The skill LongHorizon's notes need: a
document holds "Velveltan Group was founded by Jo Dargaros." and its near miss "Velveltan Labs
was founded by Eli Dargaros."; to write the founder after "Velveltan Group was founded by" the
policy must find the sentence whose subject matches, and the token that decides ("Group") sits
four tokens before the name. Copying by the previous token ("by") alone is a guess among them.

    .venv/bin/python benchmarks/lookalike_probe.py --model RUN_DIR/policy-init
    .venv/bin/python benchmarks/lookalike_probe.py --model RUN_DIR/policy-init --stems 3
    .venv/bin/python benchmarks/lookalike_probe.py --build '{"preset": "k3-tiny",
        "num_attention_heads": 4}'      # another shape: built fresh, copy warm-up first
    .venv/bin/python benchmarks/lookalike_probe.py --model-type qwen3 --build '{"hidden_size":
        128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2}' --straight  # the template's dense Qwen3, the peer

The task, in random ordinary tokens (no words): K = 3 facts `p d_i s c_i` in their own slots of
40 tokens, in random order, then the query `p d_j s c_j` in a last slot; p (2 tokens) and s (the
stem, `--stems` tokens) are shared by the facts, the deciders d_i and the 3-token continuations
c_i are distinct. The loss is on c_j. Fine-tuned from `--model` with AdamW at `--lr`, 32 such
sequences a step plus 16 of the copy warm-up's (policy/warmup.py, lead 128; `--mix` weighs their
loss) so that plain copying is kept. `--stems 1 2 3` climbs a ladder: stem length 1 until the
decider is right on 80% of the held-out set, then 2, then 3. Every 50 steps, on a fixed held-out
set (128 sequences at the current stem length, 64 of the warm-up's): the share of deciding
tokens right (c_j's first: chance 1 / K), of all c_j's tokens (after the first, a plain copy
under teacher forcing), and of the warm-up's copies. `--build CONFIG` (JSON: a K3 preset and
field overrides, or a transformers config with `--model-type`) starts from a fresh model of
that shape instead, on token ids 4-767, after the copy warm-up (policy/warmup.py, up to
`--warmup-steps`; `--straight`: the full copy task at once, no easier rungs first, which the
dense peer needs: up the ladder it sat on the first rung for 2,000 steps), so shapes can be
compared on the skill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policy.warmup import LEAD, copy_batch, copy_loss  # noqa: E402

FACTS, PREFIX, CONTINUATION, SLOT = 3, 2, 3, 40


def lookalike_batch(token_ids_V: Tensor, batch: int, stem: int, generator: torch.Generator):
    """-> ids [B, W] (W = (K + 1) x SLOT), the loss mask [B, W - 1] (position t predicts
    t + 1: c_j's tokens) and the decider's mask [B, W - 1] (c_j's first token only)."""
    width, fact = (FACTS + 1) * SLOT, PREFIX + 1 + stem + CONTINUATION
    ids_BW = token_ids_V[torch.randint(len(token_ids_V), (batch, width), generator=generator)]
    distinct = FACTS + PREFIX + stem + FACTS * CONTINUATION
    pick = torch.rand(batch, len(token_ids_V), generator=generator).argsort(1)[:, :distinct]
    words = token_ids_V[pick]  # [B, distinct]: no token twice in a row's facts
    deciders, prefix = words[:, :FACTS], words[:, FACTS : FACTS + PREFIX]
    stems = words[:, FACTS + PREFIX : FACTS + PREFIX + stem]
    continuations = words[:, FACTS + PREFIX + stem :].view(batch, FACTS, CONTINUATION)
    rows = torch.arange(batch)

    def place(slot: int, which: Tensor) -> Tensor:
        start_B = slot * SLOT + torch.randint(SLOT - fact + 1, (batch,), generator=generator)
        decider = deciders[rows, which, None]
        text = torch.cat([prefix, decider, stems, continuations[rows, which]], 1)  # [B, fact]
        ids_BW.scatter_(1, start_B[:, None] + torch.arange(fact), text)
        return start_B

    order = torch.rand(batch, FACTS, generator=generator).argsort(1)  # fact order in the slots
    for slot in range(FACTS):
        place(slot, order[:, slot])
    query_B = place(FACTS, torch.randint(FACTS, (batch,), generator=generator))
    targets = query_B[:, None] + (PREFIX + stem) + torch.arange(CONTINUATION)  # predict c_j
    loss_mask = torch.zeros(batch, width - 1, dtype=torch.bool).scatter_(1, targets, True)
    decider_mask = torch.zeros_like(loss_mask).scatter_(1, targets[:, :1], True)
    return ids_BW, loss_mask, decider_mask


def heldout(model, token_ids_V: Tensor, stem: int) -> tuple[float, float, float]:
    """(deciding tokens right, c_j's tokens right, warm-up copies right) on fixed sequences."""
    generator = torch.Generator().manual_seed(99)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids, loss_mask, decider_mask = lookalike_batch(token_ids_V, 128, stem, generator)
        hit = model(input_ids=ids).logits[:, :-1].argmax(-1) == ids[:, 1:]  # [B, W - 1]
        ids, copyable = copy_batch(token_ids_V, 64, 32, generator, LEAD)
        _, copied = copy_loss(model, ids, copyable)
    model.train(was_training)
    return hit[decider_mask].float().mean().item(), hit[loss_mask].float().mean().item(), copied


def _model(args):
    """The model to probe and its ordinary token ids [V]: loaded, or built and warmed up."""
    from policy.hf import build_model, load_model, load_tokenizer
    from policy.warmup import CopyWarmup, copy_warmup, ordinary_token_ids

    if args.model is not None:
        model = load_model(args.model)
        return model, torch.tensor(ordinary_token_ids(load_tokenizer(args.model)))
    model = build_model(args.model_type, args.build, vocab_size=768)
    token_ids_V = torch.arange(4, 768)
    settings = CopyWarmup(args.warmup_steps, ladder=() if args.straight else CopyWarmup.ladder)
    result = copy_warmup(model, token_ids_V.tolist(), settings, progress=print)
    print(f"copy warm-up: {result}", flush=True)
    return model, token_ids_V


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a saved model (a policy-init)")
    p.add_argument("--build", type=json.loads, help="or: a fresh model of this config (JSON)")
    p.add_argument("--model-type", default="agentrl_k3", help="with --build")
    p.add_argument("--warmup-steps", type=int, default=3000, help="with --build")
    p.add_argument("--straight", action="store_true", help="with --build: no ladder")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mix", type=float, default=1.0, help="weight of the plain-copy loss")
    p.add_argument("--stems", type=int, nargs="+", default=[1, 2, 3], help="the ladder")
    args = p.parse_args()
    if (args.model is None) == (args.build is None):
        p.error("give one of --model (a saved model) and --build (a config to build fresh)")
    model, token_ids_V = _model(args)
    stems = list(args.stems)
    print(f"before (stem {stems[-1]}): {heldout(model, token_ids_V, stems[-1])}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator, start = torch.Generator().manual_seed(0), time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        ids, loss_mask, _ = lookalike_batch(token_ids_V, 32, stems[0], generator)
        loss, _ = copy_loss(model, ids, loss_mask)
        copy_ids, copyable = copy_batch(token_ids_V, 16, 32, generator, LEAD)
        loss = loss + args.mix * copy_loss(model, copy_ids, copyable)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50:
            continue
        decider, continuation, copied = heldout(model, token_ids_V, stems[0])
        print(
            f"stem {stems[0]} step {step}: loss {loss.item():.3f}, decider {decider:.1%} "
            f"(chance {1 / FACTS:.0%}), continuation {continuation:.1%}, plain copies "
            f"{copied:.1%} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if decider >= 0.8 and len(stems) > 1:
            stems.pop(0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


if __name__ == "__main__":
    main()
