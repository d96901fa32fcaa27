"""`agentrl export RUN_DIR [STEP]`: a run's checkpoint as a model directory users can take away
(weights, config, generation config, tokenizer and, for agentrl_k3, the model's code; written by
policy/export.py, as the run's final-model/ is).

The checkpoint holds the learner's state (rl/learner/state.py); its policy weights are read into
the model the run started from (sft-model/, policy-init/ or policy.path, named in the
checkpoint's driver.json), whose tokenizer goes with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from policy.export import export_model
from policy.hf import load_model, load_tokenizer
from rl.config.runfile import ConfigError
from rl.learner import checkpoint as ckpt
from rl.learner.state import load_policy_weights

logger = logging.getLogger(__name__)
START_DIRS = ("sft-model", "policy-init")
"""The starting models a run writes into its own directory (rl/run/train.py)."""


@dataclass(frozen=True, slots=True)
class Exported:
    path: Path
    step: int
    checkpoint: Path


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the committed checkpoints in `run_dir` (those with a manifest), ascending."""
    root = Path(run_dir) / "checkpoints"
    return sorted(
        int(p.name[5:])
        for p in root.glob("step-*")
        if p.name[5:].isdigit() and (p / "manifest.json").is_file()
    )


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The verified checkpoint of `step` (None: the latest); a ConfigError listing the steps
    there are when it is missing or corrupt."""
    run_dir = Path(run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ConfigError(
            "RUN_DIR",
            f"{run_dir} has no checkpoint ({run_dir / 'checkpoints'} holds none): a run writes "
            "one every checkpoint_every steps and at its end",
        )
    root, listed = run_dir / "checkpoints", ", ".join(str(s) for s in steps)
    if step is not None and step not in steps:
        raise ConfigError(
            "STEP",
            f"{run_dir} has no checkpoint of step {step}; its checkpoints are of steps {listed} "
            "(checkpoint.keep_last keeps only the newest)",
        )
    try:
        if step is None and (root / "latest").is_file():
            return ckpt.latest(root)
        return _verified(root, steps[-1] if step is None else step)
    except ckpt.CheckpointError as exc:
        raise ConfigError(
            "STEP",
            f"{exc}; name another step: {listed} (`agentrl export RUN_DIR STEP` writes that "
            f"step's model; `agentrl eval` and `agentrl serve` take the directory it writes)",
        ) from None


def _verified(root: Path, step: int) -> Path:
    path = root / f"step-{step:06d}"
    ckpt.verify(path)
    return path


def start_dir(run_dir: Path, recorded: str) -> Path:
    """The model directory the run started from, as its driver.json records it; a run moved
    since (or recorded relative to another working directory) is found by the name."""
    path = Path(recorded)
    if path.name in START_DIRS and (Path(run_dir) / path.name).is_dir():
        return Path(run_dir) / path.name
    if path.is_dir():
        return path
    raise ConfigError(
        "RUN_DIR",
        f"the model the run started from, {recorded}, is missing (its tokenizer and architecture "
        f"come from there); restore it, or the run directory's {' or '.join(START_DIRS)}",
    )


def checkpoint_model(run_dir: Path, checkpoint: Path):
    """(model with the checkpoint's policy weights, the run's tokenizer, step)."""
    quiet_transformers()
    driver = ckpt.read_json(checkpoint / "driver.json")
    start = start_dir(run_dir, driver["model_dir"])
    model = load_model(start)
    try:
        load_policy_weights(model, checkpoint)
    except ckpt.CheckpointError as exc:  # another model than the one the run started from
        raise ConfigError("RUN_DIR", str(exc)) from None
    return model, load_tokenizer(start), int(driver["step"])


def export_checkpoint(run_dir: Path, step: int | None = None, out: Path | None = None) -> Exported:
    """Write the policy of checkpoint `step` (None: the latest) to `out` (default
    RUN_DIR/export-step-N)."""
    run_dir = Path(run_dir)
    checkpoint = find_checkpoint(run_dir, step)
    logger.info(f"reading {checkpoint}")
    model, tokenizer, at = checkpoint_model(run_dir, checkpoint)
    out = Path(out) if out is not None else run_dir / f"export-step-{at}"
    export_model(model, tokenizer, out)
    return Exported(out, at, checkpoint)


def quiet_transformers() -> None:
    """No per-file progress bars from transformers on the console (as `agentrl train`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
