"""The after-training commands of `agentrl` (rl/cli.py builds the parser and dispatches):
`agentrl eval` (rl/run/offline_eval.py) and `agentrl export` (rl/run/export.py), with
`run_dir_arg`, the check of a RUN_DIR argument every command shares. Heavy imports stay inside
the commands, so that `agentrl check` answers fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl.config.runfile import ConfigError, build_config, run_file_data
from rl.run.env_checks import check_env, check_env_id

RUN_FILES = {"config.yaml", "metrics.jsonl", "trajectories.jsonl", "summary.json"}
RUN_DIR_FIX = "pass a run directory made by agentrl train, e.g. runs/quickstart-YYYYmmdd-HHMMSS"


def run_dir_arg(path: str, needs: str | None = None, key: str = "RUN_DIR") -> Path:
    """A run directory named on the command line (plot, show, monitor, train --resume, export),
    or a ConfigError saying what is wrong with it and what to pass instead."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise ConfigError(key, f"{run_dir} does not exist; {RUN_DIR_FIX}")
    if not run_dir.is_dir():
        fix = f"pass its directory, {run_dir.parent}" if run_dir.name in RUN_FILES else RUN_DIR_FIX
        raise ConfigError(key, f"{run_dir} is a file, not a run directory; {fix}")
    if needs and not (run_dir / needs).is_file():
        if (run_dir / "config.yaml").is_file():
            raise ConfigError(
                key,
                f"{run_dir} has no {needs} yet: the run has not written it; try after its "
                "first step",
            )
        raise ConfigError(key, f"{run_dir} is not a run directory (no {needs}); {RUN_DIR_FIX}")
    return run_dir


def cmd_eval(args) -> int:
    from rl.run.offline_eval import evaluate_target, run_file_of

    target = Path(args.target)
    data = run_file_data(run_file_of(target, args.config))
    check_env_id(data)
    cfg = build_config(data)
    check_env(cfg)
    report = evaluate_target(
        target,
        cfg,
        tasks=args.tasks,
        samples=args.samples,
        greedy=args.greedy,
        json_output=args.json,
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else "\n".join(report.lines()))
    return 0


def cmd_export(args) -> int:
    from rl.run.export import export_checkpoint

    run_dir = run_dir_arg(args.run_dir, "config.yaml")
    out = Path(args.output) if args.output else None
    if out is not None and out.exists() and not out.is_dir():
        raise ConfigError("--output", f"{out} is a file; name a directory to write the model to")
    done = export_checkpoint(run_dir, args.step, out)
    print(f"exported step {done.step} ({done.checkpoint}) to {done.path}")
    return 0


def add_after_training(sub, common) -> None:
    """The `eval` and `export` subcommands on `sub` (argparse subparsers of rl/cli.py)."""
    sp = sub.add_parser(
        "eval", help="the held-out evaluation alone, with 95%% intervals", parents=[common]
    )
    sp.add_argument("target", metavar="TARGET", help="a run directory, or a model directory")
    sp.add_argument("--tasks", type=int, metavar="N", help="held-out tasks (default: eval.tasks)")
    sp.add_argument("--samples", type=int, metavar="K", help="per task (default: eval.samples)")
    sp.add_argument(
        "--greedy",
        action=argparse.BooleanOptionalAction,
        help="also evaluate greedily (default: eval.greedy)",
    )
    sp.add_argument(
        "--config",
        metavar="RUN_FILE",
        help="the run file whose env and eval settings apply (a model directory needs one)",
    )
    sp.add_argument(
        "--json", action="store_true", help="print one JSON object (progress goes to stderr)"
    )
    sp.set_defaults(fn=cmd_eval)
    sp = sub.add_parser(
        "export", help="a checkpoint as a model directory transformers loads", parents=[common]
    )
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("step", nargs="?", type=int, metavar="STEP", help="default: the latest")
    sp.add_argument(
        "-o", "--output", metavar="OUT", help="write it here (default: <run>/export-step-N)"
    )
    sp.set_defaults(fn=cmd_export)
