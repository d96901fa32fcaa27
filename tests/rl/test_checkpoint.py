"""Atomic checkpoints and exact learner resume (unit level; the SIGKILL test: test_resume.py)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy.hf import build_model, checksum, export_weights
from rl.config.runfile import TrainerConfig
from rl.learner import checkpoint as ckpt
from rl.learner.learner import Learner
from rl.learner.state import DCP_DIR
from tests.conftest import TINY_MODEL
from tests.rl.test_learner import ListSource, make_group


def batches(model, n):
    return [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=100 + i) for i in range(n)]


def learner(model, groups, algorithm="grpo"):
    cfg = TrainerConfig(
        algorithm=algorithm, group_size=4, batch_size=8, micro_batch_size=3, lr=1e-2
    )
    return Learner(
        cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0, seed=5
    )


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_reproduces_the_uninterrupted_weights(tiny_model, tmp_path, algorithm):
    groups = batches(tiny_model, 8)
    straight = learner(copy.deepcopy(tiny_model), groups, algorithm)
    for _ in range(4):
        straight.step()
    expected = checksum(export_weights(straight.model))

    first = learner(copy.deepcopy(tiny_model), groups[:4], algorithm)
    first.step(), first.step()
    tmp = ckpt.staging_dir(tmp_path, 2)
    first.save(tmp)
    path = ckpt.commit(tmp_path, tmp, 2)
    assert ckpt.latest(tmp_path) == path

    def resumed(rng: bool) -> int:
        again = learner(copy.deepcopy(tiny_model), groups[4:], algorithm)
        again.load(ckpt.latest(tmp_path), rng=rng)
        assert again.version == 2
        again.step(), again.step()
        return checksum(export_weights(again.model))

    assert resumed(rng=True) == expected
    assert resumed(rng=False) != expected  # the test can fail: the RNG state matters


def test_trained_ids_load_from_the_compact_form_and_from_an_old_plain_list(tiny_model, tmp_path):
    one = learner(copy.deepcopy(tiny_model), batches(tiny_model, 4))
    one.step(), one.step()
    tmp = ckpt.staging_dir(tmp_path, 2)
    one.save(tmp)
    meta = ckpt.read_json(tmp / "learner.json")
    assert isinstance(meta["trained"], dict) and len(one.trained) == 4
    again = learner(copy.deepcopy(tiny_model), [])
    again.load(tmp)
    assert again.trained == one.trained
    meta["trained"] = sorted(f"{100 + i}#{i}" for i in range(4))  # learner.json before
    ckpt.write_json(tmp / "learner.json", meta)
    old = learner(copy.deepcopy(tiny_model), [])
    old.load(tmp)
    assert old.trained == one.trained and "101#1" in old.trained and "101#2" not in old.trained


def test_a_resume_keeps_the_loading_learners_optimizer_kernel(tiny_model, tmp_path):
    """A checkpoint of a looped AdamW (an older agentrl; sharded ranks) loads into a one-rank
    learner without switching its fused kernel off, and the weights still resume exactly."""
    groups = batches(tiny_model, 6)
    one = learner(copy.deepcopy(tiny_model), groups[:4])
    assert one.optimizer.param_groups[0]["fused"] is True
    one.step(), one.step()
    tmp = ckpt.staging_dir(tmp_path, 2)
    one.save(tmp)
    meta = ckpt.read_json(tmp / "learner.json")
    for group in meta["optimizer"]["param_groups"]:
        group["fused"], group["foreach"] = None, None  # what the looped default saves
    ckpt.write_json(tmp / "learner.json", meta)
    again = learner(copy.deepcopy(tiny_model), groups[4:])
    again.load(tmp)
    assert again.optimizer.param_groups[0]["fused"] is True
    one.source, resumed = ListSource(groups[4:]), again
    one.step(), resumed.step()
    assert checksum(export_weights(resumed.model)) == checksum(export_weights(one.model))


ONE_RANK_ROUND_TRIP = """
import json, os, tempfile
from pathlib import Path
from policy.hf import build_model, checksum, export_weights
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from tests.rl.test_learner import ListSource, make_group

def gloo_threads():
    tasks = Path("/proc/self/task").iterdir()
    return sum("gloo" in (task / "comm").read_text() for task in tasks)

model = build_model("agentrl_k3", {"preset": "k3-debug"}, vocab_size=128, seed=0)
groups = [make_group(model, [1.0, 0.0], seed=s) for s in range(2)]
cfg = TrainerConfig(algorithm="grpo", group_size=2, batch_size=2, micro_batch_size=2, lr=1e-3)
one = Learner(cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0)
one.step()
before, weights = gloo_threads(), checksum(export_weights(one.model))
with tempfile.TemporaryDirectory() as tmp:
    one.save(Path(tmp))
    one.load(Path(tmp))
print(json.dumps({"before": before, "after": gloo_threads(),
                  "same": checksum(export_weights(one.model)) == weights}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc/self/task (Linux)")
def test_a_one_rank_checkpoint_runs_no_collective():
    """A one-rank (MoE) learner has a one-rank gloo group; DCP's save and load through it ran
    collectives on gloo's threads, whose parallel copies started a second OpenMP team, after
    which every learner step took ~1.6x as long (rl/learner/state.py, at DCP_DIR). They run
    with no_dist: no gloo work thread starts, and the weights round-trip. A fresh process, so
    no earlier test's threads count."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK_ROUND_TRIP],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["before"] > 0, "the learner should hold a one-rank gloo group"
    assert found["after"] == found["before"] and found["same"], found


def test_incomplete_and_corrupt_checkpoints_are_refused(tiny_model, tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        ckpt.latest(tmp_path)
    one = learner(copy.deepcopy(tiny_model), batches(tiny_model, 2))
    one.step()
    tmp = ckpt.staging_dir(tmp_path, 1)
    one.save(tmp)
    path = ckpt.commit(tmp_path, tmp, 1)
    tmp2 = ckpt.staging_dir(tmp_path, 2)  # a crash mid-write leaves only a temporary directory
    one.save(tmp2)
    assert ckpt.latest(tmp_path) == path
    (shard,) = (path / DCP_DIR).glob("*.safetensors")  # the DCP shard of the one rank
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=rf"{DCP_DIR}/.*corrupt"):
        ckpt.latest(tmp_path)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"{DCP_DIR}/.* is missing"):
        ckpt.latest(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.latest(tmp_path)


def test_a_checkpoint_that_cannot_load_is_refused_naming_why(tiny_model, tmp_path):
    grpo = learner(copy.deepcopy(tiny_model), batches(tiny_model, 2))
    grpo.save(tmp_path)
    with pytest.raises(
        ckpt.CheckpointError, match=r"has no value head.*trainer\.algorithm needs one"
    ):
        learner(copy.deepcopy(tiny_model), [], "ppo").load(tmp_path)
    other = build_model("qwen3", TINY_MODEL, vocab_size=300)  # another model: another shape
    with pytest.raises(ckpt.CheckpointError, match=r"does not fit this learner.*Size mismatch"):
        learner(other, []).load(tmp_path)
    (tmp_path / "learner.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="no learner state in the DCP format"):
        grpo.load(tmp_path)


def test_keep_last_prunes_old_checkpoints_but_never_latest(tmp_path):
    def save(step: int) -> None:
        tmp = ckpt.staging_dir(tmp_path, step)
        ckpt.write_json(tmp / "driver.json", {"step": step})
        ckpt.commit(tmp_path, tmp, step)

    for step in (2, 4, 6, 8):
        save(step)
    assert ckpt.prune(tmp_path, 0) == []  # 0 keeps everything
    assert ckpt.prune(tmp_path, 2) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000006", "step-000008"]
    (tmp_path / "latest").write_text("step-000006")  # e.g. resumed from an older one
    save(10)
    (tmp_path / "latest").write_text("step-000006")
    assert ckpt.prune(tmp_path, 1) == ["step-000008"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000006", "step-000010"]
    ckpt.verify(tmp_path / "step-000006")
