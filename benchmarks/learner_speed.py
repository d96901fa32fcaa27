"""Learner step throughput: our GRPO learner step against TRL 1.16's GRPOTrainer loss + backward
+ AdamW step, on the same model and the same batch of trajectories.

    .venv/bin/python benchmarks/learner_speed.py [--batch 128] [--prompt 170] [--completion 32]
        [--model qwen3 | k3] [--distinct-prompts]
        [--device cpu | cuda]   (cuda: both on the GPU in fp32; TRL with use_cpu=False)

Both sides see identical token ids, completion masks, advantages and on-policy old logprobs
(ratio 1), and use the same loss (TRL `loss_type="grpo"`: sequence-mean of token-mean). The run
prints the losses of both to show they compute the same thing, then a markdown table: seconds
per step and tokens/s (prompt + completion tokens), best of N interleaved repeats.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.hf import build_model
from policy.logprobs import token_logprobs
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


def make_batch(model, args):
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 700, (args.batch // args.group, args.prompt), generator=gen)
    prompts = prompts.repeat_interleave(args.group, 0)  # a GRPO group's samples share it
    if args.distinct_prompts:
        prompts = torch.randint(3, 700, (args.batch, args.prompt), generator=gen)
    completions = torch.randint(3, 700, (args.batch, args.completion), generator=gen)
    rewards = (torch.rand(args.batch, generator=gen) > 0.5).float()
    groups = trajectory_groups(model, prompts, completions, rewards, args.group)
    return prompts, completions, rewards, groups


def trajectory_groups(model, prompts, completions, rewards, group: int) -> list[TrajectoryGroup]:
    """Groups of `group` one-turn trajectories (prompt, then the sampled completion with the
    model's own logprobs, version 0); also used by benchmarks/train_speed.py."""
    with torch.no_grad():
        ids = torch.cat([prompts, completions], 1)
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    groups, prompt_len = [], prompts.shape[1]
    for g in range(len(prompts) // group):
        trajs = []
        for i in range(g * group, (g + 1) * group):
            t = Trajectory(task_id=str(g), status=RolloutStatus.COMPLETED, reward=float(rewards[i]))
            t.append(prompts[i].tolist(), sampled=False)
            t.append(
                completions[i].tolist(),
                sampled=True,
                logprobs=logp[i, prompt_len - 1 :].tolist(),
                version=0,
            )
            trajs.append(t)
        groups.append(TrajectoryGroup(group_id=f"1-{g}", task_id=str(g), trajectories=trajs))
    return groups


class Source:
    """The same groups on every read, under fresh entry and group ids: the learner skips a
    group id it has trained already (rl/learner/ledger.py), so repeats need new ones."""

    def __init__(self, groups):
        self.groups, self.reads = groups, 0

    def read(self, count, *, block_ms):
        self.reads += 1
        ids = [f"{self.reads}-{i}" for i in range(len(self.groups))]
        return [
            (i, dataclasses.replace(g, group_id=i)) for i, g in zip(ids, self.groups, strict=True)
        ]

    def ack(self, ids):
        return len(ids)

    def stopped(self):
        return False


def ours(model, groups, args, shared_prefix: bool = True):
    cfg = TrainerConfig(
        shared_prefix=shared_prefix,
        algorithm="grpo",
        group_size=args.group,
        batch_size=args.batch,
        micro_batch_size=args.micro,
        lr=1e-6,
        threads=args.threads,
    )
    model = model.to(args.device)
    learner = Learner(cfg, model=model, source=Source(groups), pad_token_id=0, temperature=1.0)

    def step():
        return learner.step()["learner/loss"]

    return step


def trl(model, prompts, completions, rewards, args):
    """A real GRPOTrainer (it patches the model for its fused LM-head logprobs); we call its loss
    on our micro-batches and step AdamW ourselves, skipping only its generation."""
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from policy.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(["hello world"] * 10, vocab_size=300)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=args.device == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.micro,
        num_generations=args.group,
        report_to=[],
        max_completion_length=args.completion,
        loss_type="grpo",
        beta=0.0,
        learning_rate=1e-6,
        logging_steps=10_000,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * args.batch),
        processing_class=tokenizer,
    )
    group_rewards = rewards.view(-1, args.group)
    adv = (group_rewards - group_rewards.mean(1, keepdim=True)) / (
        group_rewards.std(1, keepdim=True) + 1e-4
    )
    inputs = {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": completions,
        "completion_mask": torch.ones_like(completions),
        "advantages": adv.view(-1),
        "num_items_in_batch": torch.tensor(float(completions.numel())),
    }
    inputs = {k: v.to(trainer.model.device) for k, v in inputs.items()}
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-6)

    def step():
        loss = 0.0
        optimizer.zero_grad()
        for i in range(0, args.batch, args.micro):  # gradient accumulation over micro-batches
            part = {k: (v[i : i + args.micro] if v.dim() else v) for k, v in inputs.items()}
            micro = trainer._compute_loss(trainer.model, part) * (
                len(part["advantages"]) / args.batch
            )
            micro.backward()
            loss += micro.item()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        optimizer.step()
        return loss

    return step


def where(device: str) -> str:
    return f"on {torch.cuda.get_device_name()}" if device == "cuda" else "on the CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt", type=int, default=170)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["qwen3", "k3"], default="qwen3",
                   help="qwen3: the dense 0.7M policy; k3: k3-tiny")  # fmt: skip
    p.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="every row its own prompt (a group's samples share theirs by default, as in GRPO)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "k3":
        base = build_model("agentrl_k3", {"preset": "k3-tiny"}, vocab_size=768, seed=0).eval()
    else:
        base = build_model("qwen3", MODEL, vocab_size=768, seed=0).eval()
    prompts, completions, rewards, groups = make_batch(base, args)
    runners = {
        "agentrl Learner.step": ours(copy.deepcopy(base), groups, args),
        "agentrl Learner.step, shared_prefix off": ours(
            copy.deepcopy(base), groups, args, shared_prefix=False
        ),
        "TRL GRPOTrainer loss+backward+AdamW": trl(
            copy.deepcopy(base), prompts, completions, rewards, args
        ),
    }
    best = {name: float("inf") for name in runners}
    losses = {}
    for _ in range(args.repeats):  # interleaved, best of N
        for name, run in runners.items():
            start = time.perf_counter()
            losses[name] = run()
            if args.device == "cuda":
                torch.cuda.synchronize()  # the optimizer step is queued, not done
            best[name] = min(best[name], time.perf_counter() - start)
    tokens = args.batch * (args.prompt + args.completion)
    print(
        f"\n{args.batch} trajectories x ({args.prompt} prompt + {args.completion} completion) "
        f"tokens, "
        f"micro-batch {args.micro}, {args.threads} threads, {where(args.device)}, "
        f"best of {args.repeats}\n"
    )
    print("| learner step | seconds | tokens/s | vs TRL | last loss |\n|---|---|---|---|---|")
    trl_s = best["TRL GRPOTrainer loss+backward+AdamW"]
    for name, seconds in best.items():
        rate, ratio = tokens / seconds, trl_s / seconds
        print(f"| {name} | {seconds:.3f} | {rate:,.0f} | {ratio:.2f}x | {losses[name]:.6f} |")


if __name__ == "__main__":
    main()
