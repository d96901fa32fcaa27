"""The `agentrl` command.

agentrl train configs/quickstart.yaml [section.key=value ...]
agentrl train --resume runs/quickstart-YYYYmmdd-HHMMSS [section.key=value ...]
agentrl check configs/quickstart.yaml [section.key=value ...]   # validate only
agentrl config schema [--output agentrl.schema.json]             # JSON Schema of a run file
agentrl config docs [--output docs/run-files.md]                  # every key, as markdown
agentrl plot runs/quickstart-YYYYmmdd-HHMMSS [--output PATH]  # default <run>/reward_curve.png
agentrl monitor runs/quickstart-YYYYmmdd-HHMMSS      # or: --redis URL --run NAME
agentrl show runs/quickstart-YYYYmmdd-HHMMSS [--id ID | --worst | --best] [--step N] [--list]
agentrl envs list
agentrl envs check agentrl/Calculator-v0 [difficulty=2 ...]
agentrl eval runs/quickstart-YYYYmmdd-HHMMSS [--tasks N] [--samples K] [--no-greedy] [--json]
agentrl eval MODEL_DIR --config configs/quickstart.yaml   # a model directory: name the run file
agentrl export runs/quickstart-YYYYmmdd-HHMMSS [STEP] [-o OUT]  # default <run>/export-step-N
agentrl serve TARGET [--host 127.0.0.1] [--port 8000] [--max-batch 16]  # OpenAI-compatible URL
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rl.config.runfile import (
    ConfigError,
    RunConfig,
    build_config,
    read_yaml,
    run_file_data,
    run_file_schema,
)
from rl.observe.trackers import check_installed
from rl.run.commands import add_after_training, run_dir_arg
from rl.run.devices import check_devices
from rl.run.env_checks import check_env, check_env_id, check_prompt_room


def output_arg(path: str, default_name: str) -> Path:
    """Where `--output PATH` asks to write (into PATH when it is a directory), its parent
    directories created; a ConfigError when they cannot be."""
    out = Path(path)
    if out.is_dir():
        out = out / default_name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        file = next((p for p in (out.parent, *out.parent.parents) if p.is_file()), None)
        why = f"{file} is a file" if file is not None else exc.strerror
        raise ConfigError(
            "--output", f"cannot create the directory {out.parent}: {why}; pick another path"
        ) from None
    return out


def load(args) -> RunConfig:
    if getattr(args, "resume", None):
        if args.config and "=" in args.config:  # `train --resume DIR key=value`: no run file
            args.overrides.insert(0, args.config)
        elif args.config:
            raise ConfigError(
                "", "with --resume the run's own config.yaml is used; pass only overrides"
            )
        args.config = str(run_dir_arg(args.resume, "config.yaml", "--resume") / "config.yaml")
    elif not args.config:
        raise ConfigError("", "name a run file, e.g. agentrl train configs/quickstart.yaml")
    data = run_file_data(args.config, args.overrides)
    check_env_id(data)
    cfg = build_config(data)
    check_env(cfg)
    check_prompt_room(cfg)  # with policy.path's tokenizer (a fresh one: when the run builds it)
    check_installed(cfg)  # metrics.wandb / metrics.mlflow on without its package
    check_devices(cfg)  # an explicit cuda this machine cannot serve (local Ray)
    return cfg


def cmd_train(args) -> int:
    cfg = load(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from rl.run.train import Resume, make_run_dir, say, train

    resume = None
    if args.resume:
        run_dir = Path(args.resume).resolve()  # `--resume .`: the run id is the dir's name
        skip = set(args.resume_skip or [])
        resume = Resume(rng="rng" not in skip, stream="stream" not in skip)
    else:
        run_dir = make_run_dir(cfg)
    from rl.learner.checkpoint import CheckpointError, latest_named
    from rl.run.failures import explain
    from rl.run.placement import PlacementError

    try:
        if resume is not None:  # nothing to resume from: say so before Redis and Ray start
            latest_named(run_dir / "checkpoints")
        summary = train(cfg, run_dir, resume)
    except CheckpointError as exc:
        print(f"agentrl: cannot resume: {exc}", file=sys.stderr)
        return 2
    except PlacementError as exc:
        print(f"agentrl: cannot place the run on the Ray cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say(f"interrupted; Ray and Redis are stopped. Partial results in {run_dir}")
        return 130
    except Exception as exc:  # a fault we can name gets one clear message, not a traceback
        message = explain(exc, run_dir)
        if message is None:
            raise
        print(f"agentrl: {message}", file=sys.stderr)
        return 1
    say(f"done: {run_dir}")
    return strict_exit(summary) if args.strict else 0


def strict_exit(summary: dict) -> int:
    """`train --strict`: 0 when RL beat the warm start beyond the 95% intervals, else 3 (also
    when nothing was compared: eval.tasks 0, or no sampled evaluation before and after)."""
    if "rl_beats_base_beyond_intervals" not in summary:
        print(
            "agentrl: --strict: no sampled evaluation before and after RL to compare",
            file=sys.stderr,
        )
        return 3
    return 0 if summary["rl_beats_base_beyond_intervals"] else 3


def cmd_check(args) -> int:
    load(args)
    print("config ok")
    return 0


def cmd_config(args) -> int:
    if args.action == "docs":
        from rl.config.docs import run_file_reference

        text, what = run_file_reference(), "the run-file reference"
    else:
        text, what = json.dumps(run_file_schema(), indent=2) + "\n", "the JSON Schema of a run file"
    if args.output:
        out = output_arg(args.output, "run-files.md" if args.action == "docs" else "schema.json")
        try:
            out.write_text(text)
        except OSError as exc:
            raise ConfigError("--output", f"cannot write {out}: {exc.strerror}") from None
        print(f"wrote {what} to {out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_plot(args) -> int:
    run_dir = run_dir_arg(args.run_dir, "metrics.jsonl")  # bad input fails before the imports
    out = output_arg(args.output, "reward_curve.png") if args.output else None
    from rl.observe.plot import plot_run

    print(plot_run(run_dir, out))
    return 0


def cmd_monitor(args) -> int:
    import redis

    from rl.observe.monitor import JsonlSource, RedisSource, run_monitor
    from rl.observe.monitor_state import MonitorState

    if args.redis:
        if not args.run:
            raise ConfigError("--run", "name the run to follow, e.g. --run quickstart-2026...")
        try:
            client = redis.Redis.from_url(args.redis)
        except ValueError as exc:
            raise ConfigError("--redis", f"{exc}; e.g. --redis redis://HOST:6379") from None
        source = RedisSource(client, args.run)
        state, finished = MonitorState(stall_after_s=args.stall_after), lambda: False
    elif args.run_dir:
        run_dir = run_dir_arg(args.run_dir, "config.yaml")
        raw = read_yaml(run_dir / "config.yaml", "the run's config")
        raw = raw if isinstance(raw, dict) else {}
        metrics = raw.get("metrics") or {}
        state = MonitorState(
            total_steps=(raw.get("trainer") or {}).get("steps"),
            collapse_window=metrics.get("collapse_window", 10),
            collapse_drop=metrics.get("collapse_drop", 0.2),
            stall_after_s=args.stall_after,
        )
        source = JsonlSource(run_dir / "metrics.jsonl")
        finished = (run_dir / "summary.json").exists
    else:
        raise ConfigError("", "name a run directory, or --redis URL --run NAME")
    try:
        run_monitor(source, state, finished=finished, once=args.once)
    except redis.exceptions.ConnectionError as exc:
        why = str(exc).rstrip(".")
        raise ConfigError("--redis", f"cannot reach {args.redis}: {why}; is Redis up?") from None
    except json.JSONDecodeError as exc:  # a metrics line not written by agentrl
        key, where = ("--redis", source.stream) if args.redis else ("RUN_DIR", source.path)
        raise ConfigError(key, f"a record in {where} is not JSON ({exc})") from None
    return 0


def cmd_show(args) -> int:
    from rl.observe.show import ShowError, run

    run_dir_arg(args.run_dir)
    try:
        return run(args)
    except ShowError as exc:
        print(f"agentrl show: {exc}", file=sys.stderr)
        return 2


def cmd_envs(args) -> int:
    from envs.check import check_tool_env, list_envs
    from rl.config.runfile import parse_overrides

    if args.action == "list":
        print(list_envs())
        return 0
    if not args.env_id:
        raise ConfigError("envs check", "name the env to check, e.g. agentrl envs check ID")
    kwargs = dict(parse_overrides(args.kwargs))
    if ":" not in args.env_id:  # an entry point is registered by the check itself
        from envs.registry import RegistrationError, ensure_registered

        try:
            ensure_registered(args.env_id)
        except RegistrationError as exc:
            raise ConfigError("envs check", str(exc)) from None
    report = check_tool_env(
        args.env_id, kwargs=kwargs, episodes=args.episodes, long_steps=args.long_steps
    )
    print(report.format())
    return 0 if report.passed else 1


def cmd_serve(args) -> int:
    from rl.run.serve_model import serve

    flags = ("host", "port", "max_batch", "max_tokens", "device")
    try:  # Ctrl-C while serving stops it cleanly (0); while the model loads: 130
        serve(Path(args.target), **{name: getattr(args, name) for name in flags})
    except KeyboardInterrupt:
        return 130
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentrl", description="Agentic RL post-training on Ray + Redis"
    )
    common = argparse.ArgumentParser(add_help=False)
    loud = common.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_true", help="also print debug records")
    loud.add_argument("-q", "--quiet", action="store_true", help="print only warnings and errors")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("train", cmd_train, "run a training job"),
        ("check", cmd_check, "validate a run file and overrides"),
    ):
        sp = sub.add_parser(name, help=text, parents=[common])
        sp.add_argument("config", nargs="?", help="YAML run file, e.g. configs/quickstart.yaml")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")
        sp.set_defaults(fn=fn, strict=False, resume=None)
        if name == "train":
            sp.add_argument(
                "--resume",
                metavar="RUN_DIR",
                help="continue a run from its latest checkpoint (exactly)",
            )
            sp.add_argument(
                "--resume-skip", action="append", choices=["rng", "stream"], help=argparse.SUPPRESS
            )  # negative controls for the resume test
            sp.add_argument(
                "--strict",
                action="store_true",
                help="exit 3 unless RL beats the warm start beyond the 95%% intervals",
            )
    sp = sub.add_parser("config", help="the run-file format, for editors", parents=[common])
    sp.add_argument(
        "action",
        choices=["schema", "docs"],
        help="schema: print its JSON Schema; docs: print the reference of every key (markdown)",
    )
    sp.add_argument("--output", metavar="PATH", help="write it to PATH instead")
    sp.set_defaults(fn=cmd_config)
    sp = sub.add_parser("plot", help="draw a run's reward curve", parents=[common])
    sp.add_argument("run_dir")
    sp.add_argument(
        "--output", metavar="PATH", help="write the PNG here (default: <run>/reward_curve.png)"
    )
    sp.set_defaults(fn=cmd_plot)
    sp = sub.add_parser("monitor", help="follow a run's metrics live", parents=[common])
    sp.add_argument("run_dir", nargs="?", help="a run directory (live or finished)")
    sp.add_argument("--redis", metavar="URL", help="read the metrics stream from this Redis")
    sp.add_argument("--run", metavar="NAME", help="the run's name (its directory's name)")
    sp.add_argument("--once", action="store_true", help="print every panel once and exit")
    sp.add_argument(
        "--stall-after", type=float, default=120.0, help="alarm after this many silent seconds"
    )
    sp.set_defaults(fn=cmd_monitor)
    add_show(sub, common)
    sp = sub.add_parser("envs", help="tool environments: list them, or check one", parents=[common])
    sp.add_argument("action", choices=["list", "check"])
    sp.add_argument("env_id", nargs="?", help="env id to check, e.g. agentrl/Calculator-v0")
    sp.add_argument("kwargs", nargs="*", help="env kwargs, e.g. difficulty=2")
    sp.add_argument("--episodes", type=int, default=5, help="seeded episodes per check")
    sp.add_argument("--long-steps", type=int, default=32, help="steps of the long episode")
    sp.set_defaults(fn=cmd_envs)
    add_after_training(sub, common)  # eval, export (rl/run/commands.py)
    add_serve(sub, common)
    return p


def add_serve(sub, common) -> None:
    text = "serve a model at an OpenAI-compatible URL (Ctrl-C stops it), e.g. for a judge"
    sp = sub.add_parser("serve", help=text, description=text, parents=[common])
    sp.add_argument("target", metavar="TARGET", help="a model directory, or a run directory")
    for flag, kind, default, what in (
        ("--host", str, "127.0.0.1", "the address to listen on"),
        ("--port", int, 8000, "0: any free port"),
        ("--max-batch", int, 16, "the most requests sampled together"),
        ("--max-tokens", int, 1024, "the most tokens of one reply"),
        ("--device", str, "auto", "cpu, cuda or auto (cuda where torch sees one)"),
    ):
        sp.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")
    sp.set_defaults(fn=cmd_serve)


def add_show(sub, common) -> None:
    sp = sub.add_parser(
        "show", help="print one recorded trajectory as a transcript", parents=[common]
    )
    sp.add_argument("run_dir")
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--id", help="the trajectory id (see --list), e.g. 12-3/5")
    which.add_argument("--worst", action="store_true", help="the lowest reward")
    which.add_argument("--best", action="store_true", help="the highest reward")
    which.add_argument("--list", action="store_true", help="list the recorded trajectories")
    sp.add_argument("--step", type=int, help="only trajectories trained at this step")
    sp.set_defaults(fn=cmd_show)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rl.observe.console import configure, level_from_flags

    configure(level_from_flags(args.verbose, args.quiet))
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"agentrl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
