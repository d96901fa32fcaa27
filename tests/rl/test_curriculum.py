"""A context curriculum: stages validated before anything starts, each stage's limits reach the
workers, a checkpoint at every stage's end, and a run SIGKILLed in its second stage resumes in
that stage to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rl.config.runfile import ConfigError, load_config
from rl.run.curriculum import gate_due, stage_end, stage_ends, stage_index, staged
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


GATED = [  # stage 1 holds (an untrained policy solves nothing), stage 2 passes at once
    {**STAGES[0], "gate": {"success": 1.0, "every": 1, "tasks": 2}},
    {**STAGES[1], "steps": 3, "gate": {"success": 0.0, "every": 1, "tasks": 2}},
    {"name": "last", "steps": 1, "max_seq_len": 768, "max_turns": 2},
]


def test_gates_are_due_every_few_steps_of_their_stage_and_validated(tmp_path):
    cfg = load_config(run_file(tmp_path, GATED), ["trainer.steps=6"])
    assert [gate_due(cfg, s) for s in range(1, 7)] == [True, False, True, True, False, False]
    assert [stage_end(cfg, i) for i in range(3)] == [2, 5, 6]
    every_2 = [{**GATED[1], "steps": 5, "gate": {"success": 0.5, "every": 2}}]
    cfg = load_config(run_file(tmp_path, every_2), ["trainer.steps=5"])
    assert [gate_due(cfg, s) for s in range(1, 6)] == [False, True, False, True, False]
    assert cfg.curriculum[0].gate.tasks == 8
    for gate, fragment in [({"success": -0.1}, ">= 0"), ({"success": 1.5}, "<= 1"),
                           ({"success": 0.5, "every": 0}, "> 0"),
                           ({"success": 0.5, "task": 2}, "task")]:  # fmt: skip
        stages = [{**STAGES[0], "gate": gate}]
        with pytest.raises(ConfigError, match=fragment) as info:
            load_config(run_file(tmp_path, stages), ["trainer.steps=2"])
        assert info.value.key.startswith("curriculum[0].gate")
    never = [{**STAGES[0], "gate": {"success": 0.5, "every": 2}}]  # steps 2: no gate step left
    with pytest.raises(ConfigError, match="below the stage's steps") as info:
        load_config(run_file(tmp_path, never), ["trainer.steps=2"])
    assert info.value.key == "curriculum[0].gate.every"


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


@pytest.mark.slow
@pytest.mark.distributed
def test_a_gate_holds_a_stage_below_its_success_and_ends_it_above(tmp_path):
    """Stage 1's gate (100% needed) holds it to its last step; stage 2's (0%) passes after its
    first step: the run jumps to stage 2's last step number (a checkpoint there) and goes on
    in stage 3. An untrained policy solves none of stage 1's two gate tasks."""
    path = run_file(tmp_path, GATED)
    run = cli(path, *overrides(tmp_path / "g"), "trainer.steps=6")
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = (tmp_path / "g").glob("e2e-*")
    records = train_records(run_dir)
    assert [(r["step"], r["curriculum/stage"]) for r in records] == [(1, 1), (2, 1), (3, 2), (6, 3)]
    gates = {r["step"]: r.get("curriculum/gate_passed") for r in records}
    assert gates == {1: 0.0, 2: None, 3: 1.0, 6: None}
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-000002", "step-000005", "step-000006"]  # fmt: skip
    assert "holds the stage" in run.stdout and "passes: the stage ends here" in run.stdout
