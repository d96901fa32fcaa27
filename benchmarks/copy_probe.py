"""How many steps until a freshly built policy copies from its context: k3-tiny (as
initialised by default, and with `mla_fan_in_init`) against the template's dense Qwen3, on the
copy warm-up's task (policy/warmup.py: up to `--lead` random tokens, a random span of 32
tokens, a random gap of 0-31, the span again, the loss on the repeat; 32 sequences a step,
AdamW lr 2e-3), up the warm-up's ladder (spans of 8 from 16 tokens, then 16 from 64, then the
full task) or, with --no-ladder, straight on the full task.

    .venv/bin/python benchmarks/copy_probe.py                      # all three, up to 3,000 steps
    .venv/bin/python benchmarks/copy_probe.py --models qwen3 --steps 1500 --no-ladder
    .venv/bin/python benchmarks/copy_probe.py --models k3-tiny --lead 0   # spans at position 0
    .venv/bin/python benchmarks/copy_probe.py --evaluate RUN_DIR/policy-init  # a saved model

Every 25 steps: the copy loss and greedy copy accuracy on that step's batch (chance 1 / 764 on
the full task). Printed per model: the first step at 50% and at 90% accuracy on the full task,
the seconds it took, and the share of held-out spans copied when they start the sequence
(lead 0) and when they start anywhere in its first 128 or 512 tokens: a model trained with
every span at position 0 learns to copy the sequence's start, which no document needs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policy.warmup import LEAD  # noqa: E402

LEADS = (0, 128, 512)  # where held-out spans may start (copied_from_anywhere)
MODELS = {
    "k3-tiny": ("agentrl_k3", {"preset": "k3-tiny"}),
    "k3-tiny-fan-in": ("agentrl_k3", {"preset": "k3-tiny", "mla_fan_in_init": True}),
    "qwen3": ("qwen3", {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
                        "num_attention_heads": 4, "num_key_value_heads": 2}),  # configs/template
}  # fmt: skip


def probe(name: str, steps: int, seed: int, ladder: bool, lead: int) -> dict[str, float | None]:
    from policy.hf import build_model
    from policy.warmup import CopyWarmup, copy_warmup

    model_type, config = MODELS[name]
    model = build_model(model_type, config, vocab_size=768, seed=seed)
    out: dict[str, float | None] = {"at_50": None, "at_90": None}

    settings = CopyWarmup(steps, seed=seed, done_at=0.9)  # 32 x (lead + 32 + gap + 32), 2e-3
    settings = replace(settings, lead=lead, ladder=_ladder(settings.ladder, ladder, lead))
    rungs = iter(settings.ladder)
    rung = next(rungs, None)

    def check(step: int, loss: float, accuracy: float) -> None:
        nonlocal rung
        task = "full task" if rung is None else f"spans of {rung[1]} from {rung[0]} tokens"
        print(f"{name} step {step} ({task}): loss {loss:.3f}, copy accuracy {accuracy:.1%}",
              flush=True)  # fmt: skip
        if rung is not None:
            rung = next(rungs, None) if accuracy >= settings.done_at else rung
            return
        for key, bar in (("at_50", 0.5), ("at_90", 0.9)):
            if out[key] is None and accuracy >= bar:
                out[key] = step

    result = copy_warmup(model, range(4, 768), settings, on_check=check)
    out["seconds"] = result["copy_warmup/seconds"]
    out.update(copied_from_anywhere(model, seed))
    return out


def _ladder(default, ladder: bool, lead: int):
    """The warm-up's ladder, none (--no-ladder), or with every span at position 0 (--lead 0)."""
    if not ladder:
        return ()
    return default if lead else tuple((count, length, 0) for count, length, _ in default)


def copied_from_anywhere(model, seed: int, token_ids=range(4, 768)) -> dict[str, float]:
    """Greedy copy accuracy on 64 held-out sequences of the full task per lead (0: every span
    at position 0; 128, 512: the span after up to that many random tokens)."""
    from policy.warmup import copy_batch, copy_loss

    generator = torch.Generator().manual_seed(seed + 10_007)
    token_ids_V = torch.tensor(list(token_ids))
    model.eval()
    out = {}
    with torch.no_grad():
        for lead in LEADS:
            ids, copyable = copy_batch(token_ids_V, 64, 32, generator, lead)
            out[f"lead_{lead}"] = copy_loss(model, ids, copyable)[1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-ladder", action="store_true", help="straight on the full task")
    p.add_argument(
        "--evaluate",
        metavar="MODEL_DIR",
        help="only measure a saved model's copying (e.g. a run's policy-init)",
    )
    p.add_argument(
        "--lead",
        type=int,
        default=LEAD,
        help="most random tokens before the span (0: the span starts every sequence)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.evaluate:
        return evaluate(args.evaluate, args.seed)
    results = {name: probe(name, args.steps, args.seed, not args.no_ladder, args.lead)
               for name in args.models}  # fmt: skip
    for name, result in results.items():
        print(f"{name} (trained at lead {args.lead}): 50% copy accuracy at step "
              f"{result['at_50']}, 90% at step {result['at_90']} ({result['seconds']:.0f} s); "
              f"held-out copies: {_by_lead(result)}")  # fmt: skip


def evaluate(model_dir: str, seed: int) -> None:
    from policy.hf import load_model, load_tokenizer
    from policy.warmup import ordinary_token_ids

    model = load_model(model_dir)
    ordinary = ordinary_token_ids(load_tokenizer(model_dir))
    copied = copied_from_anywhere(model, seed, ordinary)
    print(f"{model_dir}: held-out copies: {_by_lead(copied)}")


def _by_lead(copied) -> str:
    return ", ".join(f"{copied[f'lead_{lead}']:.1%} at lead {lead}" for lead in LEADS)


if __name__ == "__main__":
    main()
