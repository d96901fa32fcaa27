"""Does a new environment learn on the defaults? `configs/template.yaml` (the run file a user
copies for their own env) on two envs of different shape that agentrl ships only as test
fixtures, never tuned for:

- `tests/fixtures/user_envs/weather.py` WeatherEnv: two tools chained over three turns (look up a
  temperature, convert it with the second tool, answer with the result);
- `tests/fixtures/user_envs/contacts.py` ContactsEnv: a lookup, then a two-argument call that
  ends the episode (`send(to, text)` with two different values).

    .venv/bin/python benchmarks/new_env_learns.py [--envs weather contacts] [ARG=VALUE ...]

Each env is one `agentrl train configs/template.yaml` in a subprocess (SFT on the env's expert,
then GRPO, held-out evaluation before and after with 95% Wilson intervals). Reported per env: the
SFT diagnostics (token accuracy, tool calls that ran, greedy success vs the expert's), success
after SFT and after RL (sampled and greedy), whether RL beat SFT beyond the intervals, and the
wall time. Extra ARG=VALUE overrides go to every run (e.g. trainer.steps=20).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {
    "weather": ("user/Weather-v0", "tests.fixtures.user_envs.weather:WeatherEnv"),
    "contacts": ("user/Contacts-v0", "tests.fixtures.user_envs.contacts:ContactsEnv"),
}


def run(name: str, out: Path, extra: list[str]) -> dict:
    env_id, entry = ENVS[name]
    args = [
        sys.executable,
        "-m",
        "rl.cli",
        "train",
        str(ROOT / "configs/template.yaml"),
        f"output_dir={out}",
        f"name={name}",
        f"env.id={env_id}",
        f"env.entry_point={entry}",
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the run failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (run_dir,) = sorted(out.glob(f"{name}-*"))[-1:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (diag,) = [r for r in records if r["phase"] == "sft"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "run_dir": str(run_dir),
        "seconds": seconds,
        "diag": diag,
        "base": summary["sft"],
        "rl": summary["grpo"],
        "beats": summary["rl_beats_base_beyond_intervals"],
        "warnings": [line for line in proc.stderr.splitlines() if "!!!" in line],
    }


def fmt(result: dict) -> str:
    return f"{result['success']:.1%} [{result['ci_low']:.1%}, {result['ci_high']:.1%}]"


def report(name: str, r: dict) -> str:
    d = r["diag"]
    lines = [
        f"{name}: {r['run_dir']} ({r['seconds'] / 60:.1f} min)",
        f"  after SFT: token accuracy {d['sft/token_accuracy']:.1%}, tool calls that ran "
        f"{d.get('sft/tool_call_ok', float('nan')):.1%}, greedy success "
        f"{d.get('sft/greedy_success', float('nan')):.1%} (expert {d['sft/expert_success']:.0%})",
    ]
    for mode in r["rl"]:
        lines.append(f"  {mode:<24} SFT {fmt(r['base'][mode])}  ->  RL {fmt(r['rl'][mode])}")
    lines.append(f"  RL beats SFT beyond the intervals (sampled): {r['beats']}")
    lines += [f"  {w}" for w in r["warnings"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--out", default=str(ROOT / "runs" / "new-env"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for name in args.envs:
        print(f"[new_env_learns] {name}: agentrl train configs/template.yaml ...", flush=True)
        print(report(name, run(name, Path(args.out), args.overrides)), flush=True)


if __name__ == "__main__":
    main()
