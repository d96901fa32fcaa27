"""Held-out evaluation results, with 95% Wilson intervals at the effective sample size of the
task clustering (rl/observe/stats.py). rl/run/evals.py runs the evaluation on the workers."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rl.observe.stats import success_interval

EVAL_SEED_OFFSET = 1_000_000_000  # training seeds stay below this


@dataclass(frozen=True, slots=True)
class EvalResult:
    mode: str
    tasks: int
    samples: int
    success: float
    ci_low: float
    ci_high: float
    tool_calls: int = 0
    """Tool calls the policy attempted in the evaluation's episodes (unparsable ones too)."""
    bad_tool_calls: int = 0
    """Of those, calls that failed: unparsable, unknown tool, bad arguments, or the tool
    raised."""
    truncated: float = 0.0
    """Share of the episodes that ended truncated (out of turns, tokens or context)."""

    @property
    def tool_call_ok(self) -> float:
        """Share of tool calls that ran without an error (1.0 when there were none)."""
        return 1.0 - self.bad_tool_calls / self.tool_calls if self.tool_calls else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.success:6.1%} [{self.ci_low:.1%}, {self.ci_high:.1%}]"


def eval_result(mode: str, tasks: int, samples: int, answers: list) -> EvalResult:
    """One EvalResult from the workers' answers: (per-task successes, counters) each."""
    per_task = [task for chunk, _ in answers for task in chunk]
    counts = {k: sum(c[k] for _, c in answers) for k in answers[0][1]}
    mean, low, high = success_interval(per_task)
    return EvalResult(
        mode,
        tasks,
        samples,
        mean,
        low,
        high,
        tool_calls=counts["tool_calls"] + counts["parse_errors"],
        bad_tool_calls=counts["tool_errors"] + counts["parse_errors"],
        truncated=counts["truncated"] / max(counts["episodes"], 1),
    )
