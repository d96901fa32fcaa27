"""`trainer.mode: sync` against `trainer.mode: async`, through the real CLI, on two workloads.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 20] [--seeds 1] [--skip-quickstart]

Every run is `.venv/bin/python -m rl.cli train RUNFILE overrides...` in a subprocess, one after
another (never two at once); the figures are read from each run directory's metrics.jsonl.

0. SFT once: the quickstart run file (k3-tiny policy, SFT on 2,000 imperfect-expert
   demonstrations) with `trainer.steps=1 eval.tasks=0`; its `sft-model` is the starting policy
   of every run below (`policy.path=<it> sft.enabled=false`), so both modes start from the same
   weights and tokenizer. `--sft-model DIR` reuses one instead.
1. Long tail: `benchmarks/longtail_env.py` (the calculator; a tool call sleeps `--latency`
   seconds, and `--slow-factor` times as long on the ~`--slow-share` of tasks whose seed hashes
   slow), registered through the run file's `env.entry_point`.
2. The quickstart task (configs/quickstart.yaml), same comparison.

Both modes share every setting (2 rollout workers x 0.5 CPU + a 1-CPU learner on a 2-CPU Ray,
group 8, 16 tasks x 8 = 128 trajectories per step, lr 5e-4, token-mean GRPO, checkpoint every
10 steps, no evaluation); async adds `trainer.mode=async trainer.max_staleness=1
trainer.off_policy=decoupled trainer.tis_cap=2.0` (change with --max-staleness, --off-policy,
--tis-cap, --token-budget).

Reported per run: RL wall time (start of step 1 to the end of the last step), trained
trajectories per second of it (`learner/trajectories`), generated tokens per second (tokens of
the episodes that finished, `rollout/tokens_per_s x rollout/seconds` per step), trained sampled
tokens per second (`learner/loss_tokens`), the rolling training success (mean of
`rollout/success_rate` over --window steps) at the end and at best, and the wall time until the
rolling success first reaches a threshold (the highest of 0.70, 0.75, ... that every run of the
workload reaches, unless --threshold is given; "never" if a run does not). `--report-only DIR`
prints the tables again from a finished benchmark directory; `--skip-longtail` runs only the
quickstart pair. Figures measured on 2 cores: docs/benchmarks.md, "Async vs sync".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python")
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
LONGTAIL_ID = "benchmarks/LongTailCalculator-v0"
LONGTAIL_ENTRY = "benchmarks.longtail_env:LongTailCalculatorEnv"
GRID = [0.70, 0.75, 0.80, 0.85, 0.90, 0.95]

COMMON = [
    "ray.num_cpus=2",
    "rollout.num_workers=2",
    "rollout.cpus_per_worker=0.5",
    "trainer.cpus=1.0",
    "eval.tasks=0",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="RL steps per run (both workloads)")
    p.add_argument("--seeds", type=int, default=1, help="run seeds 0..N-1 per mode")
    p.add_argument("--skip-quickstart", action="store_true", help="long-tail workload only")
    p.add_argument("--skip-longtail", action="store_true", help="quickstart workload only")
    p.add_argument("--sft-model", help="reuse this SFT model dir instead of running SFT")
    p.add_argument("--window", type=int, default=5, help="rolling success window (steps)")
    p.add_argument("--threshold", type=float, help="rolling success threshold (default: auto)")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--off-policy", default="decoupled", choices=["none", "tis", "decoupled"])
    p.add_argument("--tis-cap", type=float, default=2.0)
    p.add_argument("--token-budget", type=int, help="async rollout.token_budget (default: none)")
    p.add_argument("--latency", type=float, default=0.05, help="long-tail tool latency (s)")
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--slow-share", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    p.add_argument("--out", help="benchmark directory (default runs/async-vs-sync-<time>)")
    p.add_argument("--report-only", metavar="DIR", help="re-read a finished benchmark's runs")
    p.add_argument(
        "--set", action="append", default=[], help="extra KEY=VALUE override for every run"
    )
    return p.parse_args(argv)


def async_overrides(args) -> list[str]:
    out = ["trainer.mode=async", f"trainer.max_staleness={args.max_staleness}"]
    out.append(f"trainer.off_policy={args.off_policy}")
    if args.off_policy != "none":
        out.append(f"trainer.tis_cap={args.tis_cap}")
    if args.token_budget:
        out.append(f"rollout.token_budget={args.token_budget}")
    return out


def longtail_runfile(args, out: Path) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["name"] = "longtail"
    data["env"] = {
        "id": LONGTAIL_ID,
        "entry_point": LONGTAIL_ENTRY,
        "kwargs": {
            **data["env"].get("kwargs", {}),
            "latency_s": args.latency,
            "slow_factor": args.slow_factor,
            "slow_share": args.slow_share,
        },
    }
    path = out / "longtail.yaml"
    path.write_text(
        "# the quickstart run file with the long-tail calculator (benchmarks/longtail_env.py)\n"
        + yaml.safe_dump(data, sort_keys=False)
    )
    return path


# -- running ---------------------------------------------------------------------------------
def run_cli(runfile: Path, name: str, overrides: list[str], out: Path, timeout: float) -> dict:
    """One `rl.cli train` subprocess; returns {run_dir, rc, seconds, log, error}."""
    cmd = [PY, "-m", "rl.cli", "train", str(runfile), f"name={name}", f"output_dir={out}"]
    cmd += overrides
    log = out / f"{name}.log"
    print(f"\n$ {' '.join(cmd)}", flush=True)
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 2)  # Ctrl-C: the CLI stops Ray and Redis
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
            rc = rc if rc else -1
            with log.open("a") as fh2:
                fh2.write(f"\n[bench] killed after {timeout:.0f} s\n")
    seconds = time.perf_counter() - start
    load = (load0, os.getloadavg()[0])  # other jobs share this machine
    dirs = sorted(p for p in out.glob(f"{name}-*") if p.is_dir())
    run_dir = dirs[-1] if dirs else None
    error = None
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        error = "\n".join(tail)
        print(f"[bench] {name} FAILED (exit {rc}) after {seconds:.0f} s; log {log}", flush=True)
        print("\n".join("    " + line for line in tail), flush=True)
    else:
        print(
            f"[bench] {name}: done in {seconds:.0f} s (load average "
            f"{load[0]:.1f} -> {load[1]:.1f}) -> {run_dir}",
            flush=True,
        )
    return {
        "name": name,
        "run_dir": run_dir,
        "rc": rc,
        "seconds": seconds,
        "load": load,
        "log": log,
        "error": error,
    }


# -- reading ---------------------------------------------------------------------------------
def records(run_dir: Path | None) -> list[dict]:
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return []
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return sorted((r for r in rows if r.get("phase") == "train"), key=lambda r: r["step"])


def summarize(rows: list[dict], window: int, batch: int) -> dict:
    """Throughput and learning figures of one run's train records."""
    if not rows:
        return {"steps": 0}
    t0 = rows[0]["time"] - rows[0]["step/seconds"]  # the start of step 1
    ends = [r["time"] - t0 for r in rows]  # wall time at the end of each step
    wall = ends[-1]
    trained = sum(r.get("learner/trajectories", batch) for r in rows)
    generated = sum(
        r.get("rollout/tokens_per_s", 0.0) * r.get("rollout/seconds", 0.0) for r in rows
    )
    loss_tokens = sum(r.get("learner/loss_tokens", 0.0) for r in rows)
    success = [r.get("rollout/success_rate") for r in rows]
    rolling, seen = [], []  # (step index, mean of the last `window` success values)
    for i, value in enumerate(success):  # (an async step that drained no episode has none)
        if value is not None:
            seen.append(value)
        if value is not None and len(seen) >= window:
            rolling.append((i, sum(seen[-window:]) / window))
    lags = [r["learner/policy_lag"] for r in rows if "learner/policy_lag" in r]
    return {
        "steps": len(rows),
        "wall": wall,
        "step_seconds": sum(r["step/seconds"] for r in rows),
        "trained": trained,
        "samples_per_s": trained / wall,
        "gen_tokens_per_s": generated / wall,
        "trained_tokens_per_s": loss_tokens / wall,
        "first_success": success[0],
        "rolling": rolling,
        "ends": ends,
        "rolling_last": rolling[-1][1] if rolling else None,
        "rolling_best": max(v for _, v in rolling) if rolling else None,
        "policy_lag": sum(lags) / len(lags) if lags else None,
        "paused": sum(r.get("workers/paused_seconds", 0.0) for r in rows),
        "push": sum(r.get("weights/push_seconds", 0.0) for r in rows),
        "learner_seconds": sum(r.get("learner/seconds", 0.0) for r in rows),
        "learner_wait": sum(r.get("learner/wait_seconds", 0.0) for r in rows),
        "idle": sum(r.get("workers/idle_seconds", 0.0) for r in rows),
        "learner_idle_share": 1.0 - sum(_busy(r) for r in rows) / wall,
    }


def _busy(r: dict) -> float:
    """The learner's compute in one step: its step less the wait for groups (async records
    also count the export of the push it starts, `learner/busy_seconds`)."""
    if "learner/busy_seconds" in r:
        return r["learner/busy_seconds"]
    return r.get("learner/seconds", 0.0) - r.get("learner/wait_seconds", 0.0)


def time_to(summary: dict, threshold: float) -> tuple[float, int] | None:
    for i, value in summary.get("rolling", []):
        if value >= threshold - 1e-9:
            return summary["ends"][i], i + 1
    return None


# -- reporting -------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def report(workload: str, runs: list[dict], args) -> dict:
    """Print the workload's table; returns the figures (also written to results.json)."""
    ok = [r for r in runs if r["summary"].get("steps")]
    threshold = args.threshold
    if threshold is None:
        reached = [t for t in GRID if ok and all(time_to(r["summary"], t) for r in ok)]
        threshold = max(reached) if reached else GRID[0]
    sync = [r for r in ok if r["mode"] == "sync"]
    base = {}
    for key in ("samples_per_s", "gen_tokens_per_s"):
        vals = [r["summary"][key] for r in sync]
        base[key] = sum(vals) / len(vals) if vals else None
    print(
        f"\n## {workload}: sync vs async ({args.window}-step rolling success; "
        f"threshold {threshold:.2f})\n"
    )
    head = (
        "| mode | seed | steps | RL wall (s) | s/step | samples/s | vs sync | gen tok/s | vs sync "
        "| trained tok/s | success step 1 | rolling, last | rolling, best "
        f"| time to {threshold:.2f} | policy lag | load avg |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in runs:
        s = r["summary"]
        if not s.get("steps"):
            print(f"| {r['mode']} | {r['seed']} | 0 | FAILED (exit {r['rc']}) |" + " |" * 12)
            continue
        hit = time_to(s, threshold)
        failed = "" if r["rc"] == 0 else f" (FAILED, exit {r['rc']})"
        print(
            f"| {r['mode']}{failed} | {r['seed']} | {s['steps']} | {s['wall']:.0f} "
            f"| {s['wall'] / s['steps']:.2f} | {s['samples_per_s']:.1f} "
            f"| {_ratio(s, base, 'samples_per_s')} "
            f"| {s['gen_tokens_per_s']:,.0f} | {_ratio(s, base, 'gen_tokens_per_s')} "
            f"| {s['trained_tokens_per_s']:,.0f} | {fmt(s['first_success'], '.2f')} "
            f"| {fmt(s['rolling_last'], '.2f')} | {fmt(s['rolling_best'], '.2f')} "
            f"| {f'{hit[0]:.0f} s (step {hit[1]})' if hit else 'never'} "
            f"| {fmt(s['policy_lag'], '.2f')} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    print(f"\nwhere the time went ({workload}):")
    for r in ok:
        s = r["summary"]
        print(
            f"  {r['mode']}/s{r['seed']}: RL wall {s['wall']:.0f} s; learner.step "
            f"{s['learner_seconds']:.0f} s (of it waiting for groups {s['learner_wait']:.0f} s); "
            f"weight pushes {s['push']:.1f} s; workers idle {s['idle']:.0f} s and paused "
            f"{s['paused']:.0f} s (async, summed over workers); learner idle "
            f"{s.get('learner_idle_share', float('nan')):.0%} of the wall time"
        )
    print(f"\nwall time to rolling success thresholds ({workload}):")
    for t in GRID:
        cells = []
        for r in ok:
            hit = time_to(r["summary"], t)
            cells.append(f"{r['mode']}/s{r['seed']}: " + (f"{hit[0]:.0f} s" if hit else "never"))
        print(f"  {t:.2f}: " + ", ".join(cells))
    return {
        "threshold": threshold,
        "runs": [
            {k: (str(v) if isinstance(v, Path) else v) for k, v in r.items() if k != "summary"}
            | {"summary": {k: v for k, v in r["summary"].items() if k not in ("ends",)}}
            for r in runs
        ],
    }


def _ratio(s: dict, base: dict, key: str) -> str:
    return f"{s[key] / base[key]:.2f}x" if base.get(key) else "-"


def workload(label: str, runfile: Path, sft: Path, args, out: Path) -> list[dict]:
    runs = []
    start = ["policy.path=" + str(sft), "sft.enabled=false", f"trainer.steps={args.steps}"]
    batch = yaml.safe_load(QUICKSTART.read_text())["trainer"]["batch_size"]
    for seed in range(args.seeds):
        for mode in ("sync", "async"):
            extra = async_overrides(args) if mode == "async" else ["trainer.mode=sync"]
            name = f"{label}-{mode}-s{seed}"
            res = run_cli(
                runfile,
                name,
                [*COMMON, *start, f"seed={seed}", *extra, *args.set],
                out,
                args.timeout,
            )
            res.update(
                mode=mode, seed=seed, summary=summarize(records(res["run_dir"]), args.window, batch)
            )
            runs.append(res)
    return runs


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            text=True,
            capture_output=True,
        ).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        return head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")
    except OSError:
        return "unknown"


def report_only(out: Path, args) -> int:
    """Print the tables again from DIR/results.json and the run directories it names."""
    results = json.loads((out / "results.json").read_text())
    batch = yaml.safe_load(QUICKSTART.read_text())["trainer"]["batch_size"]
    for key, title in (("longtail", "Long-tail tool latency"), ("quickstart", "Quickstart task")):
        if key not in results:
            continue
        runs = results[key]["runs"]
        for r in runs:
            r["run_dir"] = Path(r["run_dir"]) if r.get("run_dir") else None
            r["summary"] = summarize(records(r["run_dir"]), args.window, batch)
        report(title, runs, args)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return report_only(Path(args.report_only), args)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or ROOT / "runs" / f"async-vs-sync-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    print(f"[bench] output: {out}; code: {git_state()}", flush=True)
    print(f"[bench] async settings: {' '.join(async_overrides(args))}", flush=True)
    if args.sft_model:
        sft = Path(args.sft_model).resolve()
    else:  # SFT once (one sync RL step is the least a run does), reused by every run below
        res = run_cli(QUICKSTART, "sft", [*COMMON, "trainer.steps=1", *args.set], out, args.timeout)
        if res["run_dir"] is None or not (res["run_dir"] / "sft-model").is_dir():
            print("[bench] SFT failed; nothing to compare", flush=True)
            return 1
        sft = res["run_dir"] / "sft-model"
    print(f"[bench] starting policy: {sft}", flush=True)
    results = {"sft_model": str(sft), "args": vars(args), "code": git_state()}
    if not args.skip_longtail:
        runs = workload("longtail", longtail_runfile(args, out), sft, args, out)
        results["longtail"] = report("Long-tail tool latency", runs, args)
    if not args.skip_quickstart:
        runs = workload("quickstart", QUICKSTART, sft, args, out)
        results["quickstart"] = report("Quickstart task", runs, args)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(
        f"\n[bench] total {time.perf_counter() - began:.0f} s; results in {out}/results.json",
        flush=True,
    )
    failed = [
        r["name"]
        for k in ("longtail", "quickstart")
        for r in results.get(k, {}).get("runs", [])
        if r["rc"] != 0
    ]
    if failed:
        print(f"[bench] FAILED runs: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
