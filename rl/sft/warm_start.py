"""SFT warm start on the env expert's demonstrations, with TRL's `SFTTrainer`.

The demonstrations are rendered by the rollout renderer (same token layout as the policy's own
episodes) and handed to TRL pre-tokenized: `input_ids` plus `assistant_masks`, so only the
assistant's tokens are trained.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import gymnasium

from envs import demonstrate, ensure_registered, make_expert
from envs.types import DEMO_SEEDS
from policy.warmup import LEAD, copy_examples, ordinary_token_ids
from rl.config.runfile import RunConfig
from rl.config.sections import SFTVariant
from rollout.demos import render_demonstration
from rollout.render import ChatRenderer

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 15.0
"""Seconds between progress lines while demonstrations are played (slow envs, agent harnesses)."""
DEMO_SEED_OFFSET = DEMO_SEEDS  # demonstrations, training and evaluation draw disjoint seeds


def expert_demonstrations(cfg: RunConfig, count: int, *, error_rate: float, seed: int):
    """`count` expert episodes, split over `sft.kwargs_mix` by share (all from env.kwargs when
    it is empty), each on its own seed."""
    ensure_registered(cfg.env.id, cfg.env.entry_point)  # a run file's env.entry_point
    variants = cfg.sft.kwargs_mix or [SFTVariant()]
    demos, start, shown = [], time.perf_counter(), time.perf_counter()
    for variant, share in zip(variants, _shares(count, variants), strict=True):
        env = gymnasium.make(cfg.env.id, **{**cfg.env.kwargs, **variant.kwargs})
        expert = make_expert(env, error_rate=error_rate, seed=seed)  # kwargs may name it
        for _ in range(share):
            demos.append(
                demonstrate(env, expert, seed=DEMO_SEED_OFFSET + seed * count + len(demos))
            )
            if time.perf_counter() - shown > PROGRESS_EVERY_S and len(demos) < count:
                shown = time.perf_counter()
                logger.info(f"expert demonstrations: {len(demos)}/{count} ({shown - start:.0f} s)")
        env.close()
    return demos


def _shares(count: int, variants: list[SFTVariant]) -> list[int]:
    """`count` split by the variants' shares (largest remainders; the counts add up)."""
    total = sum(v.share for v in variants)
    exact = [count * v.share / total for v in variants]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    return counts


def sft_examples(renderer: ChatRenderer, demos) -> list[dict[str, list[int]]]:
    out = []
    for demo in demos:
        ids, mask = render_demonstration(renderer, demo.messages, demo.tools)
        out.append({"input_ids": ids, "assistant_masks": mask})
    return out


def rehearsal_examples(tokenizer, count: int, *, seed: int) -> list[dict[str, list[int]]]:
    """`count` copy sequences (`policy.warmup.copy_examples` on the tokenizer's ordinary
    tokens, each span after 0 .. `LEAD` random tokens, as in the warm-up's full task) in
    `sft_examples`' layout: only the copied tokens are trained."""
    pairs = copy_examples(ordinary_token_ids(tokenizer), count, seed=seed, lead=LEAD)
    return [{"input_ids": ids, "assistant_masks": mask} for ids, mask in pairs]


def run_sft(
    cfg: RunConfig, model, tokenizer, examples, out_dir: Path, *, device: str = "cpu"
) -> dict[str, float]:
    """Train `model` in place on `device` ("cpu" or "cuda": the model is left there); returns
    the final training loss and wall seconds."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    steps_per_epoch = max(1, len(examples) // cfg.sft.batch_size)
    with warnings.catch_warnings():  # TRL's own default trips transformers' rename warning
        warnings.filterwarnings(
            "ignore", message=".*gradient_checkpointing.*", category=FutureWarning
        )
        args = _sft_args(cfg, out_dir, steps_per_epoch, SFTConfig, device=device)
    if device == "cuda":  # one GPU: with several visible, transformers would use DataParallel
        _ = args.device  # (and multiply the batch); it sets n_gpu here, so override after
        args._n_gpu = 1
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    result = trainer.train()
    return {"sft/loss": float(result.training_loss), "sft/seconds": time.perf_counter() - start}


def release_gpu(model) -> None:
    """Move a model off the GPU and hand the driver's cached GPU memory back."""
    import gc

    import torch

    model.to("cpu")
    gc.collect()  # the trainer's optimizer state and gradients are in reference cycles
    torch.cuda.empty_cache()


def _sft_args(
    cfg: RunConfig, out_dir: Path, steps_per_epoch: int, config_cls, *, device: str = "cpu"
):
    """TRL's SFTConfig for the run: on the CPU (use_cpu) unless `device` is "cuda"; fp32 either
    way (bf16 SFT is not measured yet, so it is not on). With an `sft.kwargs_mix` of several
    variants, batches group demonstrations of similar length (transformers'
    LengthGroupedSampler): a random batch pads every 700-token episode to the 8K of a long one
    (measured: 7 s a step of 8 instead of ~1)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"SFT device must be cpu or cuda, got {device!r}")
    return config_cls(
        output_dir=str(out_dir),
        num_train_epochs=cfg.sft.epochs,
        per_device_train_batch_size=cfg.sft.batch_size,
        learning_rate=cfg.sft.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps_per_epoch // 4),
        logging_steps=max(1, steps_per_epoch // 2),
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=device != "cuda",
        bf16=False,
        gradient_checkpointing=False,
        max_length=None,
        seed=cfg.seed,
        data_seed=cfg.seed,
        train_sampling_strategy="group_by_length" if len(cfg.sft.kwargs_mix) > 1 else "random",
        dataloader_num_workers=0,
    )
