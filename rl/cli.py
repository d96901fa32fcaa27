"""The `agentrl` command.

agentrl train configs/quickstart.yaml [section.key=value ...]
agentrl check configs/quickstart.yaml [section.key=value ...]   # validate only
agentrl plot runs/quickstart-YYYYmmdd-HHMMSS
agentrl envs list
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rl.config import RunConfig, load_config
from rl.schema import ConfigError


def _check_env(cfg: RunConfig) -> None:
    import gymnasium

    import envs  # noqa: F401

    if cfg.env.id not in gymnasium.registry:
        known = sorted(k for k in gymnasium.registry if k.startswith("agentrl/"))
        raise ConfigError(
            "env.id", f"no environment {cfg.env.id!r} is registered; agentrl's: {known}"
        )
    if cfg.policy.path is not None and not Path(cfg.policy.path).is_dir():
        raise ConfigError("policy.path", f"{cfg.policy.path!r} is not a directory")


def load(args) -> RunConfig:
    cfg = load_config(args.config, args.overrides)
    _check_env(cfg)
    return cfg


def cmd_train(args) -> int:
    cfg = load(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from rl.loop import make_run_dir, say, train

    run_dir = make_run_dir(cfg)
    try:
        summary = train(cfg, run_dir)
    except KeyboardInterrupt:
        say(f"interrupted; Ray and Redis are stopped. Partial results in {run_dir}")
        return 130
    say(f"done: {run_dir}")
    return 0 if summary else 1


def cmd_check(args) -> int:
    load(args)
    print("config ok")
    return 0


def cmd_plot(args) -> int:
    from rl.plot import plot_run

    print(plot_run(Path(args.run_dir)))
    return 0


def cmd_envs(args) -> int:
    import gymnasium

    import envs  # noqa: F401

    for env_id in sorted(k for k in gymnasium.registry if k.startswith("agentrl/")):
        print(env_id)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentrl", description="Agentic RL post-training on Ray + Redis"
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("train", cmd_train, "run a training job"),
        ("check", cmd_check, "validate a run file and overrides"),
    ):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("config", help="YAML run file, e.g. configs/quickstart.yaml")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("plot", help="draw a run's reward curve")
    sp.add_argument("run_dir")
    sp.set_defaults(fn=cmd_plot)
    sp = sub.add_parser("envs", help="tool environments")
    sp.add_argument("action", choices=["list"])
    sp.set_defaults(fn=cmd_envs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"agentrl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
