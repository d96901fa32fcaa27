"""Why a run stopped, in one message the CLI prints instead of a traceback.

`RunAborted` is raised by the driver when the run must not go on (the learner skipped
`trainer.max_skipped_steps` steps in a row for a non-finite loss, or more than
`rollout.max_env_error_rate` of a step's episodes ended in an env error, or more than
`rollout.max_grader_error_rate` in a grader error). `explain(exc,
run_dir)` turns the faults the chaos suite injects into such a message: the learner's process
died, the disk filled up, Redis was lost for good, a weight push failed or timed out (naming
the workers). Every message names the last complete checkpoint and the command that continues
the run: nothing acknowledged is lost (Redis keeps every acknowledged write in its AOF, and the
checkpoint never names an incomplete directory).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from pathlib import Path

import ray
import redis

from rl.run.launch import LaunchError, RedisLost
from rl.run.weights import WeightPushRejected, WeightPushTimeout


class RunAborted(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


def check_skipped(step: int, metrics: dict, limit: int, run_dir: Path) -> None:
    """Stop after `limit` learner steps in a row skipped for a NaN/Inf loss or gradient."""
    in_a_row = int(metrics.get("learner/nonfinite_in_a_row", 0))
    if stops_on_skips(metrics, limit):
        raise RunAborted(
            f"the learner skipped {in_a_row} steps in a row (steps {step - in_a_row + 1} to "
            f"{step}) for a non-finite loss or gradient (trainer.max_skipped_steps={limit}); "
            f"the run stops. Skipped steps never changed the weights, and their groups are "
            f"marked failed in ledger.jsonl. {_resume(run_dir)}"
        )


def stops_on_skips(metrics: dict, limit: int) -> bool:
    """Whether `check_skipped` will stop the run on this step's learner metrics (the async loop
    then starts no next step: its groups would be trained and acked with no ledger line)."""
    return bool(limit) and int(metrics.get("learner/nonfinite_in_a_row", 0)) >= limit


def check_env_errors(step: int, metrics: dict, limit: float, env_id: str, run_dir: Path) -> None:
    """Stop when more than `limit` of the step's episodes ended in an env error."""
    why = (
        "the env's reset or step raised (the workers' log names each distinct error) or a tool "
        "ran past rollout.tool_timeout_s. Env-error episodes are never trained on. Run "
        f"`agentrl envs check {env_id}` to see the env fail on seeded episodes, fix it, or raise"
    )
    _check_rate(step, metrics, "an env", "env", limit, why, run_dir)


def check_grader_errors(step: int, metrics: dict, limit: float, run_dir: Path) -> None:
    """Stop when more than `limit` of the step's episodes ended in a grader error."""
    why = (
        "a reward term raised or returned NaN or inf (the workers' log names each distinct "
        "error: `grader error in <task id>: reward raised ...`). Grader-error episodes are "
        "never trained on. Fix the reward or the env's step rewards, or raise"
    )
    _check_rate(step, metrics, "a grader", "grader", limit, why, run_dir)


def _check_rate(
    step: int, metrics: dict, an: str, kind: str, limit: float, why: str, run_dir: Path
) -> None:
    """RunAborted when rollout/<kind>_error_rate passes rollout.max_<kind>_error_rate."""
    rate = metrics.get(f"rollout/{kind}_error_rate")
    if rate is None or rate <= limit:
        return
    errors, episodes = metrics[f"rollout/{kind}_errors"], metrics["rollout/episodes"]
    key = f"rollout.max_{kind}_error_rate"
    raise RunAborted(
        f"{errors:.0f} of {episodes:.0f} episodes of step {step} ended in {an} error "
        f"({rate:.0%} > {key}={limit:g}): {why} {key} (1: never stop). {_resume(run_dir)}"
    )


def explain(exc: BaseException, run_dir: Path) -> str | None:
    """A message for a fault we know, or None (the CLI then shows the traceback)."""
    for err in _chain(exc):
        if isinstance(err, RedisLost):
            return f"{err}; the run stops. {_resume(run_dir)}"
        if isinstance(err, RunAborted | LaunchError):
            return str(err)
        if isinstance(err, WeightPushTimeout | WeightPushRejected):
            return f"{err}; the run stops. {_resume(run_dir)}"
        if isinstance(err, ray.exceptions.RayActorError):
            return _actor_died(err, run_dir)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return (
                f"the disk is full ({err.strerror}: {err.filename}); the run stops. A checkpoint "
                f"being written is left as a staging directory that is never loaded. "
                f"{_resume(run_dir)}"
            )
        if isinstance(err, redis.ConnectionError):
            return f"lost the connection to Redis ({err}); the run stops. {_resume(run_dir)}"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, what a Ray task error wraps (its `cause`, first), and the causes and contexts."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        todo += [err.__context__, err.__cause__, getattr(err, "cause", None)]
        if isinstance(getattr(err, "cause", None), BaseException):
            continue  # a RayTaskError: its cause (pushed last, popped next) speaks for it
        yield err


def _actor_died(err: ray.exceptions.RayActorError, run_dir: Path) -> str:
    text = str(err)
    name = re.search(r"name: (\S+)", text)
    pid = re.search(r"pid: (\d+)", text)
    who = "a Ray actor"
    if (name and name.group(1).endswith("-learner")) or "LearnerHost" in text:
        who = "the learner"
    elif name and name.group(1).endswith("-weights"):
        who = "the weight board"
    elif name and "-worker-" in name.group(1):
        who = f"rollout worker {name.group(1).rpartition('-')[2]} (rollout.max_restarts used up)"
    where = f" (process {pid.group(1)})" if pid else ""
    return (
        f"{who}{where} died: its process was killed or crashed (an OOM kill or a signal; "
        f"see the Ray logs); the run stops. {_resume(run_dir)}"
    )


def _resume(run_dir: Path) -> str:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return "There is no checkpoint yet: start the run again."
    return (
        f"The last complete checkpoint is {pointer.read_text().strip()}; every acknowledged "
        f"trajectory is in Redis: fix the cause, then continue with "
        f"`agentrl train --resume {run_dir}`."
    )
