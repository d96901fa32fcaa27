"""`policy.copy_warmup_steps`: a fresh policy is warmed up to copy before it is saved."""

from __future__ import annotations

import logging

from policy.hf import build_model, load_model, load_tokenizer
from policy.warmup import CopyWarmup, copy_warmup
from rl.config.runfile import load_config
from rl.run.build import prepare_policy
from tests.policy.test_warmup import TINY_DENSE


def test_a_fresh_policy_is_warmed_up_before_it_is_saved(tmp_path, caplog):
    overrides = [
        "policy.model_type=qwen3", f"policy.config={TINY_DENSE}", "policy.vocab_size=300",
        "policy.tokenizer_demonstrations=20", "policy.copy_warmup_steps=150",
    ]  # fmt: skip
    cfg = load_config("configs/quickstart.yaml", overrides)
    with caplog.at_level(logging.INFO, logger="rl.run.build"):
        model_dir = prepare_policy(cfg, tmp_path)
    assert "copy warm-up done" in caplog.text
    tokenizer, saved = load_tokenizer(model_dir), load_model(model_dir)
    fresh = build_model("qwen3", TINY_DENSE, vocab_size=len(tokenizer), seed=cfg.seed)
    ordinary = sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids))
    first_rung = ordinary[:16]  # 150 steps stay on the ladder's first rung: 8 of 16 tokens
    probe = CopyWarmup(0, length=8, seed=1, ladder=())  # the saved weights are the warmed-up ones
    trained, untrained = (
        copy_warmup(model, first_rung, probe)["copy_warmup/loss"] for model in (saved, fresh)
    )
    assert trained < untrained - 1.0  # it predicts those 16 tokens (fresh: all ~300 alike)
