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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rl.config.mix import check_mix_expert
from rl.config.runfile import (
    ConfigError,
    RunConfig,
    build_config,
    read_yaml,
    run_file_data,
    run_file_schema,
)
from rl.observe.trackers import check_installed
from rl.run.devices import check_devices

RUN_FILES = {"config.yaml", "metrics.jsonl", "trajectories.jsonl", "summary.json"}
RUN_DIR_FIX = "pass a run directory made by agentrl train, e.g. runs/quickstart-YYYYmmdd-HHMMSS"


def run_dir_arg(path: str, needs: str | None = None, key: str = "RUN_DIR") -> Path:
    """A run directory named on the command line (plot, show, monitor, train --resume), or a
    ConfigError saying what is wrong with it and what to pass instead."""
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


def _check_env_id(data: dict) -> None:
    """An unknown `env.id` (no entry point) fails here, before the policy's settings are checked
    (that imports torch and transformers: seconds), with the closest registered ids."""
    env = data.get("env")
    env = env if isinstance(env, dict) else {}
    mix = env.get("mix") if isinstance(env.get("mix"), list) else []
    sections = [("env.id", env)] + [(f"env.mix[{i}].id", entry) for i, entry in enumerate(mix)]
    for key, section in sections:
        if not isinstance(section, dict):  # the typed build names what is wrong with it
            continue
        env_id = section.get("id")  # (none: the default, a built-in)
        if section.get("entry_point") is None and isinstance(env_id, str):
            from envs.registry import RegistrationError, ensure_registered

            try:
                ensure_registered(env_id)
            except RegistrationError as exc:
                raise ConfigError(key, str(exc)) from None


def _check_env(cfg: RunConfig) -> None:
    if cfg.env.mix is not None:  # each env of the mix as if alone (stages cannot change a mix)
        for i, entry in enumerate(cfg.env.mix):
            _check_one_env(entry, f"env.mix[{i}].", [(f"env.mix[{i}].kwargs", {})])
            check_mix_expert(cfg, entry, f"env.mix[{i}].id")
    else:
        stages = [
            (f"curriculum.{i}.env_kwargs", s.env_kwargs) for i, s in enumerate(cfg.curriculum)
        ]
        _check_one_env(cfg.env, "env.", [("env.kwargs", {}), *stages])
    if cfg.policy.path is not None and not Path(cfg.policy.path).is_dir():
        raise ConfigError("policy.path", f"{cfg.policy.path!r} is not a directory")


def _check_one_env(env, prefix: str, stages: list[tuple[str, dict]]) -> None:
    """Register `env` (an env section or a mix entry), bind and build it with its kwargs and
    each stage's; a ConfigError names the key (`prefix` + id, entry_point or kwargs.KEY)."""
    import envs
    from envs.registry import check_build

    try:  # an `env.entry_point` is registered under `env.id` here (and in each worker)
        envs.ensure_registered(env.id, env.entry_point)
    except envs.RegistrationError as exc:
        key = "entry_point" if env.entry_point else "id"
        raise ConfigError(prefix + key, str(exc)) from None
    for where, extra in stages:
        kwargs = {**env.kwargs, **extra}
        try:
            envs.check_kwargs(env.id, kwargs)  # the env's class takes these names
            check_build(env.id, kwargs)  # built once (and closed): values it refuses
        except envs.RegistrationError as exc:
            raise ConfigError(_env_key(env, where, exc.key), str(exc)) from None


def _env_key(env, where: str, key: str | None) -> str:
    """The run-file key an env build error names: env.dataset / env.grader (env.mix[i].dataset
    / ...grader for an entry of a mix) when the run file wrote the shorthand
    (rl/config/dataset.py), else `where`.`key`."""
    if env.dataset is not None and where.startswith("env.") and where.endswith(".kwargs"):
        prefix = where.removesuffix("kwargs")
        if key in (None, "path"):  # the task file's content
            return prefix + "dataset"
        if key == "grader" and env.grader is not None:
            return prefix + "grader"
    return f"{where}.{key}" if key else where


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
    _check_env_id(data)
    cfg = build_config(data)
    _check_env(cfg)
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
        run_dir = Path(args.resume)
        skip = set(args.resume_skip or [])
        resume = Resume(rng="rng" not in skip, stream="stream" not in skip)
    else:
        run_dir = make_run_dir(cfg)
    from rl.learner.checkpoint import CheckpointError
    from rl.run.failures import explain
    from rl.run.placement import PlacementError

    try:
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
    return 0 if summary.get("rl_beats_base_beyond_intervals", True) or not args.strict else 3


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
    from rl.observe.plot import plot_run

    run_dir = run_dir_arg(args.run_dir, "metrics.jsonl")
    out = output_arg(args.output, "reward_curve.png") if args.output else None
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


def cmd_eval(args) -> int:
    from rl.run.offline_eval import evaluate_target, run_file_of

    target = Path(args.target)
    data = run_file_data(run_file_of(target, args.config))
    _check_env_id(data)
    cfg = build_config(data)
    _check_env(cfg)
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
    add_after_training(sub, common)
    return p


def add_after_training(sub, common) -> None:
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
