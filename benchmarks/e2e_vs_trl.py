"""End-to-end GRPO throughput, like for like: agentrl (`agentrl train`, Ray + Redis, sync and
async) against TRL 1.16's `GRPOTrainer(environment_factory=...)` on a fixed-length workload.

    .venv/bin/python benchmarks/e2e_vs_trl.py [--model qwen3] [--steps 6] [--tokens 64]
        [--seeds 0 1 2] [--systems sync async trl] [--max-busy 0.3]

Why fixed length: with free-running policies the two sides generate very different lengths (the
earlier version of this benchmark had TRL at ~186 generated tokens per sample, 97% at its length
cap, against ~28 for ours), so samples/s compared the policies' lengths, not the systems. Here
every sample on every side is exactly one assistant turn of `--tokens` sampled tokens:

- TRL: `max_completion_length=N` and `generation_kwargs={"min_new_tokens": N}` (transformers
  masks EOS until N new tokens, and N is also the cap).
- agentrl: `rollout.max_new_tokens=N` with the stop token removed from the `SamplingParams` the
  driver hands the rollout workers. There is no run-file knob for that (`rl/run/build.py sampling()`
  always adds the EOS stop token), so the driver runs in a subprocess of this script that
  replaces `sampling` in the loops and evaluations (`rl.run.sync_loop`, `async_loop`, `evals`)
  with a copy whose `stop_token_ids=()`; no library file is changed. A turn that reaches
  max_new_tokens ends the episode (truncated) on both sides, so every episode is exactly one
  N-token turn.

Both sides start from one freshly initialised model and one tokenizer (trained on both chat
formats), with no SFT (nothing is learned on this workload: no episode can finish, so task
success is 0 by construction and time-to-threshold is not measurable), and run the same GRPO
steps: group size 8, 16 tasks per step (128 samples), learning rate 5e-4 constant, token-mean
PPO-clip (eps 0.2), no KL, temperature 1.0. The prompts are each side's own format: TRL's
carries the tools as JSON schemas (its chat template), ours compact signatures; prompt tokens
per sample are printed for both.

Per run: generated tokens per sample (checked: every side must report exactly N), generated
tokens/s and samples/s over all GRPO steps (sum of per-step wall times: rollout + learner +
weight sync; TRL: `on_step_begin` to `on_step_end`) and over steps 2.. (without the first step's
warm-up). Runs go one after another, seeds interleaved (seed s: sync, async, TRL); on a shared
machine `--max-busy` makes each run wait until other jobs leave the CPUs mostly idle (two
processes running 2-thread torch on 2 cores slow each other down by up to ~18x, which swamps any
difference between the systems). The table gives mean and min-max over seeds;
`<out>/results.json` keeps every step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.learner_speed import MODEL as QWEN3  # noqa: E402  (the earlier quickstart Qwen3)

THINK = ["<think>", "</think>"]  # TRL's Qwen3 template writes an empty think block per turn
MODELS = {"qwen3": ("qwen3", QWEN3), "k3": ("agentrl_k3", {"preset": "k3-tiny"})}
SYSTEMS = {
    "sync": "agentrl sync",
    "async": "agentrl async (max_staleness 1)",
    "trl": "TRL GRPOTrainer",
}


def overrides(args) -> list[str]:
    model_type, config = MODELS[args.model]
    model = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in config.items()) + "}"
    return [
        "name=bench-e2e",
        f"policy.model_type={model_type}",
        f"policy.config={model}",
        f"trainer.steps={args.steps}",
        "trainer.algorithm=grpo",
        "trainer.loss_aggregation=token-mean",
        f"rollout.max_new_tokens={args.tokens}",
        "sft.enabled=false",
        "eval.tasks=0",
        *args.set,
    ]


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def trl_messages(demo) -> list[dict]:
    """Our demonstration in TRL's episode shape (the final answer is an `answer` tool call);
    used only to train the tokenizer on TRL's format too."""
    *head, last = demo.messages
    call = {
        "type": "function",
        "function": {"name": "answer", "arguments": {"answer": last["content"]}},
    }
    return [
        *head,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "answer", "content": "Episode finished."},
        {"role": "assistant", "content": ""},
    ]


def trl_tools(cfg) -> list[dict]:
    from transformers.utils import get_json_schema

    from envs.interop import trl_environment

    env = trl_environment(cfg.env.id, **cfg.env.kwargs)()
    names = [
        n for n in dir(type(env)) if not n.startswith("_") and n not in ("reset", "get_reward")
    ]
    return [get_json_schema(getattr(env, n)) for n in sorted(names) if callable(getattr(env, n))]


def build_policy(cfg, out: Path) -> Path:
    """One fresh model + tokenizer for both sides; the BPE is trained on both chat formats."""
    from policy.hf import build_model
    from policy.tokenizer import build_tokenizer, render_conversations
    from rl.run.build import ERROR_SAMPLES
    from rl.sft.warm_start import expert_demonstrations

    demos = expert_demonstrations(cfg, 400, error_rate=0.5, seed=cfg.seed + 7919)
    ours = render_conversations((d.messages, d.tools) for d in demos)
    bootstrap = build_tokenizer(ours, vocab_size=300)
    bootstrap.chat_template = trl_template("qwen3.jinja")
    tools = trl_tools(cfg)
    theirs = [
        bootstrap.apply_chat_template(trl_messages(d), tools=tools, tokenize=False) for d in demos
    ]
    tokenizer = build_tokenizer(ours + theirs + ERROR_SAMPLES, vocab_size=cfg.policy.vocab_size)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": THINK}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = trl_template("qwen3.jinja")
    model = build_model(
        cfg.policy.model_type, cfg.policy.config, vocab_size=len(tokenizer), seed=cfg.seed
    )
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(out / "policy-init")
    tokenizer.save_pretrained(out / "policy-init")
    return out / "policy-init"


def prompt_tokens(cfg, init: Path, tasks: int = 32) -> dict[str, float]:
    """Mean prompt length of the first `tasks` tasks, in each side's own format."""
    from envs.interop import trl_environment
    from policy.hf import load_tokenizer
    from rl.run.build import make_env
    from rollout.render import ChatRenderer

    tokenizer = load_tokenizer(init)
    renderer, env, tools = ChatRenderer(tokenizer), make_env(cfg), trl_tools(cfg)
    trl_env = trl_environment(cfg.env.id, **cfg.env.kwargs)()
    ours, theirs = [], []
    for seed in range(tasks):
        observation, info = env.reset(seed=seed)
        ours.append(len(renderer.prompt(observation, info.get("tools", []))))
        text = trl_env.reset(seed=seed)
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tools=tools,
            add_generation_prompt=True,
            return_dict=True,
        )
        theirs.append(len(enc["input_ids"]))
    return {"ours": statistics.mean(ours), "trl": statistics.mean(theirs)}


def ours_driver(argv: list[str]) -> int:
    """`agentrl train` with the stop token removed from the rollout SamplingParams."""
    import dataclasses

    import rl.run.async_loop
    import rl.run.build
    import rl.run.evals
    import rl.run.sync_loop
    from rl.cli import main

    original = rl.run.build.sampling

    def fixed_length(cfg, renderer, *, greedy: bool = False):
        return dataclasses.replace(original(cfg, renderer, greedy=greedy), stop_token_ids=())

    for module in (rl.run.build, rl.run.sync_loop, rl.run.async_loop, rl.run.evals):
        module.sampling = fixed_length
    return main(argv)


def run_ours(args, mode: str, seed: int, init: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_ours", "train"]
    cmd += [str(ROOT / "configs/quickstart.yaml"), *overrides(args), f"seed={seed}"]
    cmd += [f"trainer.mode={mode}", f"policy.path={init}", f"output_dir={out}"]
    if mode == "async":
        cmd.append("trainer.max_staleness=1")
    print("agentrl:", " ".join(cmd[4:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    run_dir = sorted(out.glob("bench-e2e-*"))[-1]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = []
    for r in records:
        if r.get("phase") != "train":
            continue
        steps.append(
            {
                "seconds": r["step/seconds"],
                "samples": r.get("learner/trajectories", 0.0),
                "generated": r.get("learner/loss_tokens", 0.0),
                "success": r.get("rollout/success_rate", float("nan")),
                "rollout_length": r.get("rollout/response_length", float("nan")),
                "turns": r.get("rollout/turns", float("nan")),
            }
        )
    return steps


def trl_grpo(args, cfg, seed: int, init: Path, out: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.interop import trl_environment
    from policy.hf import load_model, load_tokenizer

    model, tokenizer = load_model(init), load_tokenizer(init)
    tokenizer.chat_template = trl_template("qwen3.jinja")
    t, r = cfg.trainer, cfg.rollout
    tasks = args.steps * t.tasks_per_step
    first = seed * tasks
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": ""}]] * tasks,
            "seed": list(range(first, first + tasks)),
        }
    )
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append({"seconds": time.perf_counter() - self.start})

        def on_log(self, *a, logs=None, **k):
            if logs and "reward" in logs and steps and "success" not in steps[-1]:
                n = t.batch_size
                steps[-1].update(
                    samples=float(n),
                    generated=logs["completions/mean_length"] * n,
                    min_length=logs["completions/min_length"],
                    max_length=logs["completions/max_length"],
                    clipped=logs["completions/clipped_ratio"],
                    success=logs["reward"],
                    num_tokens=logs.get("num_tokens", float("nan")),
                )

    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=args.steps,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.batch_size // t.micro_batch_size,
        num_generations=t.group_size,
        shuffle_dataset=False,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},  # EOS masked until N: exactly N
        max_tool_calling_iterations=r.max_turns - 1,
        temperature=r.temperature,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss_type="dapo",  # token-mean over the batch, as our `loss_aggregation: token-mean`
        beta=0.0,
        epsilon=0.2,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=trl_environment(cfg.env.id, **cfg.env.kwargs),
        callbacks=[Clock()],
    )
    trainer.train()
    previous = 0.0
    for s in steps:  # num_tokens is cumulative (prompt + completion tokens seen)
        s["prompt_tokens"] = (s["num_tokens"] - previous - s["generated"]) / s["samples"]
        previous = s["num_tokens"]
    return steps


def summarise(system: str, seed: int, steps: list[dict], args) -> dict:
    def rate(part: list[dict]) -> tuple[float, float]:
        seconds = sum(s["seconds"] for s in part)
        return (
            sum(s["generated"] for s in part) / seconds,
            sum(s["samples"] for s in part) / seconds,
        )

    success = [s.get("success", float("nan")) for s in steps]
    reached = None
    for i in range(args.window - 1, len(steps)):
        if sum(success[i - args.window + 1 : i + 1]) / args.window >= args.threshold:
            reached = i
            break
    samples = sum(s["samples"] for s in steps)
    tokens_s, samples_s = rate(steps)
    tokens_s2, samples_s2 = rate(steps[1:]) if len(steps) > 1 else (tokens_s, samples_s)
    row = {
        "system": system,
        "seed": seed,
        "steps": len(steps),
        "samples": samples,
        "seconds": sum(s["seconds"] for s in steps),
        "s_per_step": sum(s["seconds"] for s in steps) / len(steps),
        "generated_per_sample": sum(s["generated"] for s in steps) / samples,
        "tokens_per_s": tokens_s,
        "samples_per_s": samples_s,
        "tokens_per_s_after_1": tokens_s2,
        "samples_per_s_after_1": samples_s2,
        "success_mean": statistics.mean([x for x in success if x == x] or [float("nan")]),
        # (an async step in which no episode finished reports none)
        "threshold_s": None if reached is None else sum(s["seconds"] for s in steps[: reached + 1]),
        "per_step": steps,
    }
    if system == "trl":
        row["min_length"] = min(s["min_length"] for s in steps)
        row["max_length"] = max(s["max_length"] for s in steps)
        row["clipped"] = statistics.mean(s["clipped"] for s in steps)
        row["prompt_tokens"] = statistics.mean(s["prompt_tokens"] for s in steps)
    else:
        row["rollout_length"] = statistics.mean(s["rollout_length"] for s in steps)
    return row


def spread(values: list[float], fmt: str) -> str:
    mean = statistics.mean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(rows: list[dict], args) -> str:
    head = (
        "| system | seeds | generated tokens/sample | generated tokens/s | samples/s | "
        "tokens/s, steps 2.. | s/step | tokens/s vs TRL | success (mean) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["system"], []).append(r)
    trl = by.get("trl")
    lines = []
    for system in [s for s in SYSTEMS if s in by]:
        rs = by[system]
        tps = [r["tokens_per_s"] for r in rs]
        vs = (
            f"{statistics.mean(tps) / statistics.mean(r['tokens_per_s'] for r in trl):.2f}x"
            if trl
            else "-"
        )
        lines.append(
            f"| {SYSTEMS[system]} | {len(rs)} | "
            f"{spread([r['generated_per_sample'] for r in rs], '.1f')} | "
            f"{spread(tps, ',.0f')} | {spread([r['samples_per_s'] for r in rs], '.1f')} | "
            f"{spread([r['tokens_per_s_after_1'] for r in rs], ',.0f')} | "
            f"{spread([r['s_per_step'] for r in rs], '.2f')} | {vs} | "
            f"{statistics.mean(r['success_mean'] for r in rs):.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def busy_fraction(seconds: float = 3.0) -> float:
    """Share of the machine's CPU time spent busy over `seconds` (Linux /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(max_busy: float | None, timeout_s: float = 900.0) -> float:
    """On a shared machine: wait (up to timeout_s) until other jobs leave the CPUs mostly idle,
    so that every run starts on a quiet box; returns the busy share measured last."""
    busy, start = busy_fraction(), time.perf_counter()
    while max_busy is not None and busy > max_busy and time.perf_counter() - start < timeout_s:
        print(f"machine {busy:.0%} busy (other jobs); waiting", flush=True)
        time.sleep(20)
        busy = busy_fraction()
    return busy


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        sys.exit(ours_driver(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per sample")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--threshold", type=float, default=0.85)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-e2e")
    parser.add_argument(
        "--max-busy",
        type=float,
        default=None,
        help="before each run, wait until the machine is at most this share busy (shared boxes)",
    )
    parser.add_argument("--set", nargs="*", default=[], help="more run-file overrides (k=v)")
    args = parser.parse_args()
    from rl.config.runfile import load_config

    cfg = load_config(ROOT / "configs/quickstart.yaml", overrides(args))
    args.out.mkdir(parents=True, exist_ok=True)
    init = build_policy(cfg, args.out)
    prompts = prompt_tokens(cfg, init)
    print(f"prompt tokens per sample: ours {prompts['ours']:.0f}, TRL {prompts['trl']:.0f}")
    rows = []
    for seed in args.seeds:
        for system in args.systems:
            busy = wait_for_quiet(args.max_busy)
            out, load = args.out / f"{system}-seed{seed}", os.getloadavg()[0]
            if system == "trl":
                steps = trl_grpo(args, cfg, seed, init, out)
            else:
                steps = run_ours(args, system, seed, init, out)
            rows.append(summarise(system, seed, steps, args))
            rows[-1]["busy_before"] = busy  # other jobs' share of the CPUs just before the run
            rows[-1]["load_avg_1min"] = [load, os.getloadavg()[0]]  # before, after (shared box)
            brief = {k: v for k, v in rows[-1].items() if k != "per_step"}
            print(json.dumps(brief), flush=True)
            wrong = [s for s in steps if abs(s["generated"] - args.tokens * s["samples"]) > 0.5]
            if wrong:
                print(f"!!! {system} seed {seed}: not {args.tokens} tokens/sample: {wrong}")
            (args.out / "results.json").write_text(
                json.dumps({"prompt_tokens": prompts, "runs": rows}, indent=1)
            )
    print(table(rows, args))


if __name__ == "__main__":
    main()
