"""A context curriculum: stages validated before anything starts, each stage's limits reach the
workers, a checkpoint at every stage's end, and a run SIGKILLed in its second stage resumes in
that stage to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rl.config.runfile import ConfigError, load_config
from rl.run.curriculum import stage_ends, stage_index, staged
from tests.rl.test_e2e import ROOT, tiny_overrides
from tests.rl.test_resume import cli, weights_hash

STAGES = [
    {"name": "short", "steps": 2, "max_seq_len": 320, "max_turns": 1},
    {"name": "long", "steps": 2, "max_seq_len": 768, "max_turns": 2, "env_kwargs": {}},
]


def run_file(tmp_path: Path, stages=STAGES) -> str:
    data = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    data["curriculum"] = stages
    path = tmp_path / "curriculum.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_stages_are_validated_and_mapped_to_steps(tmp_path):
    cfg = load_config(run_file(tmp_path), ["trainer.steps=4"])
    assert [stage_index(cfg, s) for s in range(1, 5)] == [0, 0, 1, 1] and stage_ends(cfg) == {2, 4}
    second = staged(cfg, 1)
    assert (second.rollout.max_seq_len, second.rollout.max_turns) == (768, 2)
    assert staged(cfg, 0).rollout.max_new_tokens == cfg.rollout.max_new_tokens
    assert stage_index(load_config(None, []), 1) is None
    for overrides, stages, key, fragment in [
        (["trainer.steps=5"], STAGES, "trainer.steps", "add up to 4 steps; set trainer.steps: 4"),
        (["trainer.steps=4", "trainer.mode=async"], STAGES, "curriculum", "sync"),
        (["trainer.steps=2"], [{**STAGES[0], "max_seq_len": 10**7}], "curriculum[0].max_seq_len",
         "max_position_embeddings"),
        (["trainer.steps=2"], [{**STAGES[0], "steps": 0}], "curriculum[0].steps", "> 0"),
        (["trainer.steps=2"], [{**STAGES[0], "max_seq_len": 40}], "curriculum[0].max_seq_len",
         "above max_new_tokens"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=fragment) as info:
            load_config(run_file(tmp_path, stages), overrides)
        assert info.value.key == key


def test_the_shipped_long_context_schedule_validates():
    cfg = load_config(ROOT / "configs/long_context.yaml", [])
    assert [s.max_seq_len for s in cfg.curriculum] == [8192, 65536, 262144, 1048576]
    assert sum(s.steps for s in cfg.curriculum) == cfg.trainer.steps
    assert staged(cfg, 3).env.kwargs["doc_tokens"] == 16000


def overrides(out: Path) -> list[str]:
    return [
        *tiny_overrides(out, steps=4),
        "sft.enabled=false",
        "eval.tasks=0",
        "checkpoint_every=0",  # only the stage boundaries checkpoint
        "trainer.micro_batch_size=8",
        "trainer.entropy_coef=0.05",  # every step moves the weights
    ]


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("phase") == "train"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_curriculum_checkpoints_at_stage_ends_and_resumes_in_its_stage(tmp_path):
    path = run_file(tmp_path)
    straight = cli(path, *overrides(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    (run_a,) = (tmp_path / "a").glob("e2e-*")
    records = train_records(run_a)
    assert [r["curriculum/stage"] for r in records] == [1, 1, 2, 2]
    assert [r["rollout/turns"] <= 1 for r in records[:2]] == [True, True]  # stage 1: one turn
    assert sorted(p.name for p in (run_a / "checkpoints").glob("step-*")) == [
        "step-000002",
        "step-000004",
    ]
    assert "curriculum stage 2/2 'long'" in straight.stdout

    crashed = cli(path, *overrides(tmp_path / "b"), "testing.faults.kill_learner_at=3")
    assert crashed.returncode != 0
    (run_b,) = (tmp_path / "b").glob("e2e-*")
    assert (run_b / "checkpoints" / "latest").read_text() == "step-000002"
    resumed = cli("--resume", str(run_b))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "curriculum stage 2/2 'long'" in resumed.stdout
    assert [r["curriculum/stage"] for r in train_records(run_b)] == [1, 1, 2, 2]
    assert weights_hash(run_b) == weights_hash(run_a)
