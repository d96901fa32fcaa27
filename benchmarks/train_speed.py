"""Training speed of the MoE policy (k3-tiny) against dense Qwen3 policies: the SFT step and the
GRPO learner step, in one process, the models interleaved, best of N.

    .venv/bin/python benchmarks/train_speed.py [--threads 2] [--repeats 3] [--smoke]
        [--demos 256] [--sft-batch 16] [--batch 128] [--prompt 170] [--completion 32]
        [--device cpu | cuda] [--out runs/train-speed/results.json]

Models (all built the way `agentrl train` builds a fresh policy: rl/run/build.py prepare_policy's
tokenizer, vocab = len(tokenizer) (518 for the quickstart's Calculator, not the run file's 768
cap), eos/pad set, seed 0; parameter counts at vocab 518):
  - k3-tiny: configs/quickstart.yaml's policy (agentrl_k3, preset k3-tiny; 2.50M total, 0.59M
    active parameters, untied LM head).
  - dense (active-matched): configs/template.yaml's dense Qwen3 (0.66M parameters, tied).
  - dense (total-matched): the template's Qwen3 widened to hidden 224, intermediate 672, 4 layers
    (k3-tiny's depth), head_dim 56: 2.53M parameters, within 2% of k3-tiny's total.

Measurements:
  1. SFT step: TRL's SFTTrainer with the run's own SFTConfig (rl.sft.warm_start._sft_args; the
     trainer is built as run_sft builds it, plus a timing callback) on the quickstart env's expert
     demonstrations (expert_demonstrations + sft_examples, the quickstart's renderer and
     tokenizer), `--demos` of them, batch `--sft-batch`, 1 epoch. Seconds per optimizer step =
     on_step_begin .. on_step_end (forward, backward, clip, AdamW, scheduler), the first 2 steps of
     each run skipped as warm-up; per model the best (over repeats) run median and the fastest
     single step. Every model sees the same batches in the same order (data_seed = run seed).
  2. Learner step: rl.learner.learner.Learner.step (the quickstart's trainer section: grpo,
     token-mean, lr 5e-4, micro-batch 32) on one GRPO batch of `--batch` trajectories of
     `--prompt` + `--completion` tokens, identical ids and rewards for every model, old logprobs
     from each model itself (ratio 1 on the first step); one warm-up step, then best of
     `--repeats`.

The SFT phase runs first (all repeats), then the learner phase: a Learner opens a one-rank
process group, which a real run's SFT never sees. Within each phase the models take turns.

Prints a markdown table (ratios to the active-matched dense model; the goal of issue 21 item 8 is
k3-tiny <= 1.3x) and writes every figure, the raw step times included, to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learner_speed import Source, trajectory_groups
from policy.hf import build_model, load_tokenizer
from policy.k3.configuration import K3Config, count_parameters
from rl.config.runfile import RunConfig, load_config
from rl.run.build import prepare_policy
from rl.sft.warm_start import _sft_args, expert_demonstrations, sft_examples
from rollout.render import ChatRenderer

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2
"""SFT steps of each run left out of its timings."""
BASELINE = "dense (active-matched)"
TOTAL_MATCHED = (  # overrides of the template's dense Qwen3
    ("hidden_size", 224),
    ("intermediate_size", 672),
    ("num_hidden_layers", 4),
    ("head_dim", 56),
)


class Spec(NamedTuple):
    name: str
    model_type: str
    config: dict


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demos", type=int, default=256, help="SFT demonstrations (1 epoch)")
    p.add_argument("--sft-batch", type=int, default=16)
    p.add_argument("--batch", type=int, default=128, help="learner trajectories")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt", type=int, default=170)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=Path("runs/train-speed/results.json"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.demos, args.sft_batch, args.batch, args.repeats = 32, 8, 16, 1
    return args


def run_config(args) -> RunConfig:
    """The quickstart's run file with the benchmark's SFT and learner sizes."""
    overrides = [
        f"sft.demonstrations={args.demos}",
        f"sft.batch_size={args.sft_batch}",
        "sft.epochs=1",
        f"trainer.batch_size={args.batch}",
        f"trainer.group_size={args.group}",
        f"trainer.threads={args.threads}",
        f"trainer.device={args.device}",
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", overrides)


def model_specs(cfg: RunConfig) -> tuple[Spec, ...]:
    dense = load_config(ROOT / "configs" / "template.yaml").policy
    return (
        Spec("k3-tiny", cfg.policy.model_type, dict(cfg.policy.config)),
        Spec(BASELINE, dense.model_type, dict(dense.config)),
        Spec("dense (total-matched)", dense.model_type, dict(dense.config) | dict(TOTAL_MATCHED)),
    )


def new_model(spec: Spec, tokenizer):
    """A fresh policy as prepare_policy builds it (vocab = the tokenizer's, eos/pad set)."""
    model = build_model(spec.model_type, spec.config, vocab_size=len(tokenizer), seed=0)
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model


def param_counts(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    active = count_parameters(model.config)["active"] if isinstance(model.config, K3Config) else 0
    return {"total": total, "active": active or total}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # kernels are queued, not done


def step_timer(device: str):
    """A TrainerCallback that records seconds from on_step_begin to on_step_end."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.seconds.append(time.perf_counter() - self.start)

    return StepTimer()


def sft_run(cfg: RunConfig, spec: Spec, tokenizer, examples, device: str) -> dict:
    """One SFT epoch of a fresh model, as rl.sft.warm_start.run_sft trains it, with a timer."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import SFTConfig, SFTTrainer

    steps_per_epoch = max(1, len(examples) // cfg.sft.batch_size)
    timer = step_timer(device)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*gradient_checkpointing.*", category=FutureWarning
        )
        args = _sft_args(cfg, Path(out), steps_per_epoch, SFTConfig, device=device)
        if device == "cuda":
            _ = args.device  # one GPU, as run_sft does
            args._n_gpu = 1
        trainer = SFTTrainer(
            model=new_model(spec, tokenizer),
            args=args,
            train_dataset=Dataset.from_list(examples),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.remove_callback(ProgressCallback)  # console only; the args stay run_sft's
        start = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - start
    return {"step_seconds": timer.seconds, "seconds": seconds, "loss": result.training_loss}


def learner_tokens(args, vocab: int):
    """(prompts, completions, rewards): the same for every model; no group has flat rewards
    (GRPO would drop it)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=gen)
    completions = torch.randint(3, vocab, (args.batch, args.completion), generator=gen)
    rewards = (torch.rand(args.batch, generator=gen) > 0.5).float().view(-1, args.group)
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0
    return prompts, completions, rewards.view(-1)


def learner_runner(cfg: RunConfig, model, groups, pad_token_id: int, device: str):
    """A step function: one Learner.step on the batch (a fresh policy version each time), the
    learner built as rl/run/build.py build_learner builds it (one rank, no stream)."""
    from rl.learner.learner import Learner

    learner = Learner(
        cfg.trainer,
        model=model.to(device),
        source=Source(groups),
        pad_token_id=pad_token_id,
        temperature=cfg.rollout.temperature,
        seed=cfg.seed,
    )

    def step() -> float:
        metrics = learner.step()
        if metrics["learner/dropped_groups"] or not metrics.get("learner/optimizer_steps"):
            raise RuntimeError(f"the learner step trained nothing: {metrics}")
        sync(device)
        return metrics["learner/loss"]

    step()  # warm-up, untimed
    return step


def sft_figures(runs: list[dict]) -> dict:
    """Per model: best run median and fastest step (warm-up steps left out), whole-run s/step."""
    timed = [r["step_seconds"][WARMUP_STEPS:] or r["step_seconds"] for r in runs]
    return {
        "s_per_step": min(statistics.median(t) for t in timed),
        "min_step_s": min(min(t) for t in timed),
        "run_s_per_step": min(r["seconds"] / len(r["step_seconds"]) for r in runs),
        "steps_per_run": len(runs[0]["step_seconds"]),
        "loss": [r["loss"] for r in runs],
        "step_seconds": [r["step_seconds"] for r in runs],
    }


def measure_sft(args, cfg: RunConfig, specs, tokenizer, examples) -> dict[str, dict]:
    """Each repeat runs every model's SFT epoch in turn (interleaved)."""
    runs = {spec.name: [] for spec in specs}
    for repeat in range(args.repeats):
        for spec in specs:
            runs[spec.name].append(sft_run(cfg, spec, tokenizer, examples, args.device))
        say(f"SFT repeat {repeat + 1}/{args.repeats} done")
    return {name: sft_figures(r) for name, r in runs.items()}


def measure_learner(args, cfg: RunConfig, specs, tokenizer) -> dict[str, dict]:
    """Each repeat runs every model's learner step in turn (interleaved); after the SFT phase,
    since a Learner opens a one-rank process group (rl/learner/distributed.py init_single)."""
    tokens = learner_tokens(args, len(tokenizer))
    steps, seconds = {}, {spec.name: [] for spec in specs}
    for spec in specs:
        model = new_model(spec, tokenizer).eval()
        groups = trajectory_groups(model, *tokens, args.group)
        pad = tokenizer.pad_token_id
        steps[spec.name] = learner_runner(cfg, model, groups, pad, args.device)
    for repeat in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
        say(f"learner repeat {repeat + 1}/{args.repeats} done")
    return {name: {"s_per_step": min(s), "seconds": s} for name, s in seconds.items()}


def measure(args, cfg: RunConfig, specs, tokenizer, examples) -> dict[str, dict]:
    params = {spec.name: param_counts(new_model(spec, tokenizer)) for spec in specs}
    sft = measure_sft(args, cfg, specs, tokenizer, examples)
    learner = measure_learner(args, cfg, specs, tokenizer)
    return {
        name: {"params": params[name], "sft": sft[name], "learner": learner[name]}
        for name in params
    }


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def add_ratios(results: dict[str, dict]) -> None:
    """Each model's times over the active-matched and the total-matched dense model's."""
    for r in results.values():
        for part in ("sft", "learner"):
            for base in (BASELINE, "dense (total-matched)"):
                key = "vs_active_matched" if base == BASELINE else "vs_total_matched"
                r[part][key] = r[part]["s_per_step"] / results[base][part]["s_per_step"]


def table(args, results: dict[str, dict], sft_tokens: int) -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU"
    lines = [
        f"SFT: {args.demos} demonstrations, batch {args.sft_batch}, 1 epoch, ~{sft_tokens} tokens "
        f"per batch before padding; learner: {args.batch} trajectories x ({args.prompt} + "
        f"{args.completion}) tokens; {args.threads} threads on {where}, best of {args.repeats}\n",
        "| model | params total / active | SFT s/step (min) | SFT vs dense | learner s/step "
        "| learner vs dense |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        p, s, lr = r["params"], r["sft"], r["learner"]
        lines.append(
            f"| {name} | {p['total'] / 1e6:.2f}M / {p['active'] / 1e6:.2f}M "
            f"| {s['s_per_step']:.3f} ({s['min_step_s']:.3f}) | {s['vs_active_matched']:.2f}x "
            f"| {lr['s_per_step']:.3f} | {lr['vs_active_matched']:.2f}x |"
        )
    k3 = results["k3-tiny"]
    lines.append(
        f"\nk3-tiny vs dense (total-matched): SFT {k3['sft']['vs_total_matched']:.2f}x, learner "
        f"{k3['learner']['vs_total_matched']:.2f}x. Goal (issue 21 item 8): k3-tiny <= 1.3x dense."
    )
    return "\n".join(lines)


def quiet() -> None:
    """No progress bars from datasets / transformers (the timings are unaffected)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    quiet()
    say("building the tokenizer and the demonstrations")
    cfg = run_config(args)
    with tempfile.TemporaryDirectory() as tmp:  # the CLI's tokenizer for a fresh policy
        tokenizer = load_tokenizer(prepare_policy(cfg, Path(tmp)))
    demos = expert_demonstrations(
        cfg, cfg.sft.demonstrations, error_rate=cfg.sft.expert_error_rate, seed=cfg.seed
    )
    examples = sft_examples(ChatRenderer(tokenizer), demos)
    say(f"tokenizer ({len(tokenizer)} tokens) and {len(examples)} demonstrations ready")
    specs = model_specs(cfg)
    results = measure(args, cfg, specs, tokenizer, examples)
    add_ratios(results)
    sft_tokens = round(statistics.mean(len(e["input_ids"]) for e in examples) * args.sft_batch)
    print("\n" + table(args, results, sft_tokens))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    setup |= {"vocab_size": len(tokenizer), "models": {s.name: s._asdict() for s in specs}}
    args.out.write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
