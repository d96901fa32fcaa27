"""A tiny policy trains a few steps through `agentrl train` on each built-in env's run file.

The tiny policy (tokenizer and model) is built here from a few dozen expert demonstrations,
exactly as `rl.run.build.prepare_policy` does from 400, to keep the sandboxed envs' demonstrations
cheap; the run still warm-starts with SFT on the env's expert, collects rollouts on Ray, scores
them with the run file's reward terms and takes GRPO steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

import envs
from rl.config.runfile import load_config
from tests.conftest import TINY_MODEL
from tests.rl.test_e2e import alive, run_cli, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
RUNS = {
    "python_code": ["rollout.max_new_tokens=96"],
    "retrieval": ["rollout.max_new_tokens=32", "rollout.max_turns=3"],
    "file_edit": ["rollout.max_new_tokens=160"],
}


def build_policy(config: Path, out: Path) -> Path:
    from policy.hf import build_model
    from policy.tokenizer import build_tokenizer, render_conversations
    from rl.run.build import ERROR_SAMPLES

    cfg = load_config(config)
    env = gymnasium.make(cfg.env.id, **cfg.env.kwargs)
    expert = envs.make_expert(cfg.env.id, error_rate=0.5, seed=1)
    demos = [envs.demonstrate(env, expert, seed=s) for s in range(24)]
    corpus = render_conversations((d.messages, d.tools) for d in demos) + ERROR_SAMPLES
    tokenizer = build_tokenizer(corpus, vocab_size=512)
    model = build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=0)
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_tiny_policy_trains_on_the_env(tmp_path, name):
    config = ROOT / "configs" / f"{name}.yaml"
    policy = build_policy(config, tmp_path / "policy")
    overrides = [
        *tiny_overrides(tmp_path / "runs"),
        f"policy.path={policy}",
        "sft.demonstrations=16",
        "sft.batch_size=8",
        "trainer.batch_size=8",
        "rollout.num_workers=1",
        "rollout.max_seq_len=1024",
        "eval.tasks=0",
        *RUNS[name],
    ]
    proc, started = run_cli([str(config), *overrides])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").glob("e2e-*"))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    env_id = load_config(config).env.id
    for r in train:
        assert r["learner/grad_norm"] == r["learner/grad_norm"]  # not NaN
        assert f"env/{env_id}/success_rate" in r and "reward/task_completion" in r
        assert r["rollout/env_errors"] == 0 and r["rollout/grader_errors"] == 0
    assert "SFT warm start" in proc.stdout
    assert not alive(started), "processes of the run outlived it"
