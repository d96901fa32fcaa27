"""Does SFT take on LongHorizon-v0? Held-out greedy success, and whether the policy answers on
time (right after the document holding the chain's last link), at the SFT length and longer.

    .venv/bin/python benchmarks/sft_probe.py --out runs/probe sft.demonstrations=500 sft.epochs=4
    .venv/bin/python benchmarks/sft_probe.py --out runs/pde-1m --eval-only     # an existing SFT
    .venv/bin/python benchmarks/sft_probe.py --model runs/X/sft-model --stages \
        configs/long_curriculum.yaml --tasks 24      # at each curriculum stage, greedy and T=1

SFT (`rl.run.train.warm_start`) runs on `configs/long_horizon.yaml` with the dotted overrides
given (kept in `--out/sft-model`; skipped with --eval-only); then 50 held-out tasks greedy
through the run's RolloutWorker at the run file's documents and at `--long` documents
(1,000 tokens, 3 apart: 8K-token episodes). Printed per setting: success, answered, on time,
how many episodes wrote a `Chain:` note every turn, and in how many the first note copied the
question's start entity (`copies`: the plainest copy the task asks for); `founder`: episodes
whose notes name the chain's first link whole, `founder_surname`: its surname (a near miss
shares it). `--stages RUNFILE` instead evaluates `--model` at each of the run file's
curriculum stages (its env kwargs, turns and max_seq_len), greedy and sampled at the run
file's temperature (`--only 2k`: one stage), and first prints the share of random spans the
model copies (`sft/copy_accuracy`). Wrong answers are split into planted distractors
(`decoy`), another entity of the chain, and anything else;
`answer_in_last_note` counts answers that copy the policy's own last note (the expert's do).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LONG = ["env.kwargs.doc_tokens=1000", "env.kwargs.distance=3", "env.kwargs.max_turns=9",
        "rollout.max_turns=9", "rollout.max_seq_len=8704"]  # fmt: skip
TASKS = range(7_100_000, 7_100_050)  # held out: disjoint from the demonstrations' seeds


def evaluate(model_dir: Path, cfg, tasks: range = TASKS, greedy: bool = True) -> dict[str, int]:
    """The counts above for `model_dir` on `tasks` under run config `cfg`."""
    from rl.run.build import build_worker, sampling

    worker = build_worker(cfg, model_dir, None, "probe", 0)
    trajs = worker.run(list(tasks), sampling(cfg.rollout, worker.renderer, greedy=greedy))
    out = {"tasks": len(trajs), "success": 0, "answered": 0, "on_time": 0, "notes": 0, "copies": 0}
    out.update(dict.fromkeys(("decoy", "chain_entity", "other", "answer_in_last_note"), 0))
    out.update(dict.fromkeys(("founder", "founder_surname"), 0))
    kinds = _answer_kinds(cfg, tasks)
    for traj, kind in zip(trajs, kinds, strict=True):
        turns = [m for m in traj.messages if m["role"] == "assistant"]
        calls = [c["function"]["name"] for m in turns for c in m.get("tool_calls") or []]
        outcome = traj.outcome or {}
        details = outcome.get("details", outcome)
        _count_answer(out, details.get("given"), traj.success, turns, kind)
        out["success"] += traj.success
        out["notes"] += all((m.get("content") or "").startswith("Chain:") for m in turns)
        out["copies"] += _copies_start(traj.messages)
        _count_founder(out, turns, kind[2])
        if calls and calls[-1] == "answer":
            out["answered"] += 1
            evidence = details.get("evidence_docs") or [-2]
            out["on_time"] += details.get("docs_read") == max(evidence) + 1
    return out


def _answer_kinds(cfg, tasks: range) -> list[tuple[set[str], set[str], list[str]]]:
    """Per task, the normalised planted distractors of its last link, its chain's entities
    normalised, and the chain as written."""
    import gymnasium

    from envs.long_horizon import normalize

    env = gymnasium.make(cfg.env.id, **cfg.env.kwargs).unwrapped
    kinds = []
    for seed in tasks:
        env.reset(seed=seed)
        archive = env.archive
        decoys, chain = archive.decoys, archive.chain
        kinds.append(({normalize(x) for x in decoys}, {normalize(x) for x in chain}, chain))
    return kinds


def _count_answer(
    out: dict[str, int], given: str | None, success: bool, turns: list[dict], kind
) -> None:
    """A wrong answer as a planted distractor, another entity of the chain, or anything else;
    and whether the answer copies the last note (the expert's answer always does)."""
    from envs.long_horizon import normalize

    if given is None:
        return
    decoys, chain, _ = kind
    if not success:
        name = normalize(given)
        out["decoy" if name in decoys else "chain_entity" if name in chain else "other"] += 1
    out["answer_in_last_note"] += bool(turns) and given.strip() in (turns[-1].get("content") or "")


def _count_founder(out: dict[str, int], turns: list[dict], chain: list[str]) -> None:
    """Whether a note names the chain's first link (the founder) whole, and its surname: the
    near misses share the surname and differ in the first name (docs/benchmarks.md)."""
    notes = " ".join(m.get("content") or "" for m in turns)
    out["founder"] += chain[1] in notes
    out["founder_surname"] += chain[1].split()[-1] in notes


def _copies_start(messages: list[dict]) -> bool:
    """Whether the first note names the question's own start entity ("Chain: <start>.", the
    name copied from the question): the plainest copy the task asks for."""
    question = next((m["content"] for m in messages if m["role"] == "user"), "")
    first = next((m.get("content") or "" for m in messages if m["role"] == "assistant"), "")
    found = re.match(r"Chain: ([^.]+)\.", first)
    return bool(found) and f"of {found.group(1)} " in question.replace(".", " ")


def long_horizon(overrides: list[str]):
    from rl.config.runfile import load_config

    return load_config(ROOT / "configs/long_horizon.yaml", overrides)


def probe_stages(model: Path, runfile: Path, tasks: int, only: list[str] | None = None) -> None:
    """`model` at each curriculum stage of `runfile` as the run sees it (`staged`), or at the
    stages named in `only`; first, the share of random spans it copies (rl/sft/check.py)."""
    from policy.hf import load_model, load_tokenizer
    from rl.config.runfile import load_config
    from rl.run.curriculum import staged
    from rl.sft.check import HELDOUT_COPIES, HELDOUT_SEED, token_accuracy
    from rl.sft.warm_start import rehearsal_examples

    copies = rehearsal_examples(load_tokenizer(model), HELDOUT_COPIES, seed=HELDOUT_SEED)
    print(f"random spans copied: {token_accuracy(load_model(model), copies):.1%}", flush=True)
    cfg = load_config(runfile, [])
    seeds = range(TASKS.start, TASKS.start + tasks)  # held out, as TASKS (more than 50 allowed)
    for index, stage in enumerate(cfg.curriculum):
        if only and stage.name not in only:
            continue
        for greedy in (True, False):
            counts = evaluate(model, staged(cfg, index), seeds, greedy=greedy)
            print(f"stage {stage.name}, {'greedy' if greedy else 'sampled'}: {counts}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--stages", type=Path, help="a run file: evaluate --model at its stages")
    p.add_argument("--model", type=Path, help="the model --stages evaluates")
    p.add_argument("--tasks", type=int, default=len(TASKS), help="held-out tasks per setting")
    p.add_argument("--only", nargs="*", help="with --stages: just these stages (by name)")
    p.add_argument("overrides", nargs="*", help="run-file overrides for the SFT")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # progress lines
    if args.stages is not None:
        if args.model is None:
            p.error("--stages needs --model (a saved model directory)")
        return probe_stages(args.model, args.stages, args.tasks, args.only)
    if args.out is None:
        p.error("--out is required (the SFT's run directory)")
    if not args.eval_only:
        from rl.run.train import warm_start

        _, report = warm_start(long_horizon(args.overrides), args.out)
        print(f"SFT: {report}", flush=True)
    for name, overrides in (("run file's documents", []), ("1,000-token documents", LONG)):
        print(f"{name}: {evaluate(args.out / 'sft-model', long_horizon(overrides))}", flush=True)


if __name__ == "__main__":
    main()
