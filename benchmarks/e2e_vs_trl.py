"""End-to-end GRPO on the quickstart task: agentrl (`agentrl train`, Ray + Redis) against TRL
1.16's `GRPOTrainer(environment_factory=...)`, same model, env, demonstrations and settings.

    .venv/bin/python benchmarks/e2e_vs_trl.py [--steps 40] [--threshold 0.85] [--window 3]

The model is the tiny dense Qwen3 of the earlier quickstart (`--model qwen3`, the default: the
model TRL's generation is built for) or the quickstart's k3-tiny (`--model k3`: TRL generates
through `K3ForCausalLM.generate`, cached; we roll out with the K3Policy engine). Both sides start
from one freshly initialised model and one tokenizer (trained on both chat formats), are warmed
up by SFT on the same 2,000 imperfect-expert demonstrations with the same SFT settings (ours in
our chat format, TRL's in its Qwen3 tool-calling format, where the final answer is an `answer`
tool call), then run GRPO with the same group size (8), tasks per step (16), learning rate
(5e-4, constant), loss (token-mean PPO-clip, eps 0.2, no KL), temperature (1.0) and length
budget (4 turns x 48 tokens). Every group of 8 shares one task on both sides.

Reported per side: GRPO samples/s (episodes per second of GRPO wall time), seconds per step, and
the GRPO wall time until the rolling mean (over --window steps) of the training success rate
first reaches --threshold. Takes about 20-30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
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


def overrides(args) -> list[str]:
    model_type, config = MODELS[args.model]
    model = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in config.items()) + "}"
    return [
        "name=bench-e2e",
        f"policy.model_type={model_type}",
        f"policy.config={model}",
        f"trainer.steps={args.steps}",
        "eval.tasks=0",
        *args.set,
    ]


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def trl_messages(demo) -> list[dict]:
    """Our demonstration in TRL's episode shape: the final answer is an `answer` tool call (TRL
    ends an episode when the model stops calling tools), then an empty closing turn."""
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
    from rl.build import ERROR_SAMPLES
    from rl.sft import expert_demonstrations

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
    model = build_model(
        cfg.policy.model_type, cfg.policy.config, vocab_size=len(tokenizer), seed=cfg.seed
    )
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(out / "policy-init")
    tokenizer.save_pretrained(out / "policy-init")
    return out / "policy-init"


def run_ours(args, init: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "rl.cli", "train", str(ROOT / "configs/quickstart.yaml")]
    cmd += [*overrides(args), f"policy.path={init}", f"output_dir={out / 'ours'}"]
    print("agentrl:", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    (run_dir,) = (out / "ours").glob("bench-e2e-*")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {"success": r["rollout/success_rate"], "seconds": r["step/seconds"]}
        for r in records
        if r.get("phase") == "train"
    ]


def trl_sft(cfg, model, tokenizer, out: Path) -> float:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rl.sft import _sft_args, expert_demonstrations

    demos = expert_demonstrations(
        cfg, cfg.sft.demonstrations, error_rate=cfg.sft.expert_error_rate, seed=cfg.seed
    )
    tools = trl_tools(cfg)
    tokenizer.chat_template = trl_template("qwen3_training.jinja")
    rows = []  # pre-tokenized, as our SFT is (datasets' Arrow would merge the tool schemas)
    for demo in demos:
        enc = tokenizer.apply_chat_template(
            trl_messages(demo), tools=tools, return_dict=True, return_assistant_tokens_mask=True
        )
        rows.append({"input_ids": enc["input_ids"], "assistant_masks": enc["assistant_masks"]})
    steps_per_epoch = max(1, len(rows) // cfg.sft.batch_size)
    args = _sft_args(cfg, out / "trl-sft", steps_per_epoch, SFTConfig)
    args.report_to = []
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    start = time.perf_counter()
    trainer.train()
    tokenizer.chat_template = trl_template("qwen3.jinja")
    return time.perf_counter() - start


def trl_grpo(args, cfg, model, tokenizer, out: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.interop import trl_environment

    t, r = cfg.trainer, cfg.rollout
    tasks = args.steps * t.tasks_per_step
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": ""}]] * tasks, "seed": list(range(tasks))}
    )
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append({"seconds": time.perf_counter() - self.start})

        def on_log(self, *a, logs=None, **k):
            if logs and "reward" in logs and steps and "success" not in steps[-1]:
                steps[-1]["success"] = logs["reward"]

    config = GRPOConfig(
        output_dir=str(out / "trl-grpo"),
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
        max_completion_length=r.max_new_tokens * r.max_turns,
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
        seed=cfg.seed,
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
    return steps


def summarise(name: str, steps: list[dict], samples_per_step: int, args) -> dict:
    seconds = [s["seconds"] for s in steps]
    success = [s.get("success", float("nan")) for s in steps]
    reached = None
    for i in range(args.window - 1, len(steps)):
        if sum(success[i - args.window + 1 : i + 1]) / args.window >= args.threshold:
            reached = i
            break
    total = sum(seconds)
    return {
        "system": name,
        "steps": len(steps),
        "s_per_step": total / len(steps),
        "samples_per_s": samples_per_step * len(steps) / total,
        "first_success": success[0],
        "last_success": sum(success[-args.window :]) / args.window,
        "threshold_step": None if reached is None else reached + 1,
        "threshold_s": None if reached is None else sum(seconds[: reached + 1]),
    }


def table(rows: list[dict], args) -> str:
    head = (
        "| system | GRPO steps | s/step | samples/s | success step 1 | success last "
        f"{args.window} | time to {args.threshold:.0%} (rolling {args.window}) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        when = (
            f"{r['threshold_s']:.0f} s (step {r['threshold_step']})"
            if r["threshold_s"] is not None
            else f"not reached in {r['steps']} steps"
        )
        lines.append(
            f"| {r['system']} | {r['steps']} | {r['s_per_step']:.2f} | {r['samples_per_s']:.1f} | "
            f"{r['first_success']:.2f} | {r['last_success']:.2f} | {when} |"
        )
    ratio = rows[1]["s_per_step"] / rows[0]["s_per_step"]
    return head + "\n".join(lines) + f"\n\nagentrl samples/s = {ratio:.2f}x TRL's\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--threshold", type=float, default=0.85)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-e2e")
    parser.add_argument("--only", choices=["ours", "trl"], default=None)
    parser.add_argument("--set", nargs="*", default=[], help="more run-file overrides (k=v)")
    args = parser.parse_args()
    from policy.hf import load_model, load_tokenizer
    from rl.config import load_config

    cfg = load_config(ROOT / "configs/quickstart.yaml", overrides(args))
    args.out.mkdir(parents=True, exist_ok=True)
    init = build_policy(cfg, args.out)
    rows, batch = [], cfg.trainer.batch_size
    if args.only != "trl":
        rows.append(summarise("agentrl", run_ours(args, init, args.out), batch, args))
        print(rows[-1], flush=True)
    if args.only != "ours":
        model, tokenizer = load_model(init), load_tokenizer(init)
        sft_s = trl_sft(cfg, model, tokenizer, args.out)
        print(f"TRL SFT: {sft_s:.0f} s", flush=True)
        rows.append(
            summarise(
                "TRL GRPOTrainer", trl_grpo(args, cfg, model, tokenizer, args.out), batch, args
            )
        )
        print(rows[-1], flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    if len(rows) == 2:
        print(table(rows, args))


if __name__ == "__main__":
    main()
