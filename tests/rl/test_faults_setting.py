"""Fault injection is a run-file setting for agentrl's own tests (`testing.faults`), refused
outside pytest and announced at the start of a run; no product module reads a fault variable
from the environment (one leaking into a real run would kill processes or cut a checkpoint)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rl import faults
from rl.config.runfile import ConfigError, FaultsConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/quickstart.yaml"
PRODUCT = ("rl", "rollout", "policy", "envs", "reward")


def load_outside_pytest(*overrides: str) -> subprocess.CompletedProcess:
    """load_config in a fresh interpreter without pytest's marker in its environment."""
    code = (
        "import sys\n"
        "from rl.config.runfile import ConfigError, load_config\n"
        "try:\n"
        "    load_config(sys.argv[1], sys.argv[2:])\n"
        "except ConfigError as exc:\n"
        "    sys.exit(f'ConfigError: {exc}')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return subprocess.run(
        [sys.executable, "-c", code, str(CONFIG), *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_faults_are_refused_outside_pytest():
    refused = load_outside_pytest("testing.faults.nan_loss=[2]")
    assert refused.returncode != 0
    assert "testing.faults" in refused.stderr and "pytest" in refused.stderr, refused.stderr
    assert "nan_loss" in refused.stderr  # it names what is set
    plain = load_outside_pytest()  # no fault: loads anywhere
    assert plain.returncode == 0, plain.stderr


def test_a_run_file_with_faults_is_refused_outside_pytest_too(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump({"testing": {"faults": {"kill_learner_at": 3}}}))
    code = "import sys; from rl.config.runfile import load_config; load_config(sys.argv[1])"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run_file)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0 and "testing.faults" in proc.stderr, proc.stderr


def test_faults_load_under_pytest():
    assert "PYTEST_CURRENT_TEST" in os.environ
    cfg = load_config(
        CONFIG,
        [
            "testing.faults.nan_loss=[2,5,6,7]",
            "testing.faults.reward_raises=3",
            "testing.faults.kill_worker=any:0",
            "testing.faults.kill_worker_on_push='1:2'",
            "testing.faults.poison_saved=true",
            "testing.faults.kill_learner_at=5",
            "testing.faults.disk_full_at=6",
            "testing.faults.slow_learner='4:0.5'",
        ],
    )
    f = cfg.testing.faults
    assert f.slow_learner == "4:0.5"
    assert f.nan_loss == [2, 5, 6, 7] and f.reward_raises == 3 and f.kill_worker == "any:0"
    assert (f.kill_worker_on_push, f.kill_learner_at, f.disk_full_at) == ("1:2", 5, 6)
    assert f.poison_saved is True and f.active()["poison_saved"] is True
    assert load_config(CONFIG).testing.faults.active() == {}  # the default: no fault


@pytest.mark.parametrize(
    "override, words",
    [
        ("testing.faults.kill_worker=first", "any:<groups>"),
        ("testing.faults.kill_worker=1:2", "quoted"),  # YAML 1.1 reads 1:2 as 62
        ("testing.faults.kill_worker='0:x'", "got '0:x'"),
        ("testing.faults.kill_worker='7:1'", "rollout.num_workers"),
        ("testing.faults.kill_worker_on_push=any:2", "<version>"),
        ("testing.faults.kill_worker_on_push=1:2", "quoted"),
        ("testing.faults.kill_worker_on_push='5:2'", "rollout.num_workers"),
        ("testing.faults.poison_saved=true", "kill_worker"),  # it acts only on the kill
        ("testing.faults.poison_saved=1", "true or false"),
        ("testing.faults.reward_raises=0", "> 0"),
        ("testing.faults.nan_loss=2", "list"),
        ("testing.faults.slow_learner=4", "<learner step>:<seconds>"),
        ("testing.faults.slow_learner='4:x'", "got '4:x'"),
        ("testing.faults.kill_everything=1", "unknown key"),
    ],
)
def test_bad_fault_settings_name_the_key(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [override])
    key = override.partition("=")[0]
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_the_banner_lists_the_faults():
    assert faults.banner(FaultsConfig()) is None
    text = faults.banner(FaultsConfig(nan_loss=[2, 5], kill_learner_at=4))
    assert "FAULT INJECTION IS ON" in text and "testing.faults" in text
    assert "nan_loss=[2, 5]" in text and "kill_learner_at=4" in text
    assert "disk_full_at" not in text and "poison_saved" not in text  # off: not listed


def test_the_run_directory_config_leaves_the_faults_out(tmp_path):
    """config.yaml is what `--resume` loads: the resumed run must not repeat the fault."""
    from rl.run.train import make_run_dir

    cfg = load_config(CONFIG, [f"output_dir={tmp_path}", "testing.faults.kill_learner_at=4"])
    saved = yaml.safe_load((make_run_dir(cfg) / "config.yaml").read_text())
    assert "testing" not in saved


def test_each_fault_fires_only_where_it_is_set(tmp_path):
    f = FaultsConfig(nan_loss=[2], kill_worker="1:3", reward_raises=3, disk_full_at=6)
    assert faults.nan_loss(f, 2) and not faults.nan_loss(f, 3) and not faults.nan_loss(None, 2)
    assert faults.kill_worker(f, 1, starts=1) == (3, False)
    assert faults.kill_worker(f, 1, starts=2) is None and faults.kill_worker(f, 0, 1) is None
    assert faults.kill_worker(FaultsConfig(kill_worker="any:0"), 5, 1) == (0, True)
    assert faults.kill_worker(FaultsConfig(kill_worker="0"), 0, 1) == (1, False)
    assert faults.kill_worker(None, 0, 1) is None

    def scorer(traj):
        return 1.0

    assert faults.reward(scorer, FaultsConfig()) is scorer and faults.reward(scorer, None) is scorer
    raising = faults.reward(scorer, f)
    assert raising(SimpleNamespace(task_id="t#4", traj_id="g/1")) == 1.0
    for traj in (
        SimpleNamespace(task_id="t#6", traj_id="g/1"),
        SimpleNamespace(task_id="t#4", traj_id="g/0"),
    ):
        with pytest.raises(RuntimeError, match="reward_raises"):
            raising(traj)

    # the kills never fire here (they would SIGKILL pytest): other worker, other version, restart
    faults.kill_on_push(FaultsConfig(kill_worker_on_push="1:2"), 0, 1, 2)
    faults.kill_on_push(FaultsConfig(kill_worker_on_push="1:2"), 1, 1, 3)
    faults.kill_on_push(FaultsConfig(kill_worker_on_push="1:2"), 1, 2, 2)
    faults.kill_on_push(None, 1, 1, 2)
    faults.kill_learner(FaultsConfig(kill_learner_at=4), 3)
    faults.kill_learner(None, 4)
    slow = FaultsConfig(slow_learner="4:0.3")
    begun = time.monotonic()
    faults.slow_learner(slow, 3)  # another step: no sleep
    faults.slow_learner(None, 4)  # no fault: no sleep
    assert time.monotonic() - begun < 0.2
    faults.slow_learner(slow, 4)
    assert time.monotonic() - begun >= 0.3

    shard = tmp_path / "learner" / "shard-00001-of-00001.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 100)
    faults.disk_full(f, tmp_path, step=5, rank=0)
    faults.disk_full(None, tmp_path, step=6, rank=0)
    assert shard.stat().st_size == 100
    with pytest.raises(OSError) as info:
        faults.disk_full(f, tmp_path, step=6, rank=0)
    assert info.value.errno == errno.ENOSPC and shard.stat().st_size == 50


def test_poison_saved_overwrites_the_saved_episodes_it_is_given(redis_server):
    """testing.faults.poison_saved: every saved episode in the hashes it is given (the groups of
    the worker about to be killed: live snapshots and finished episodes alike) becomes bytes the
    decoder refuses, which a worker restoring them ends as an env error (rollout/serve.py).
    Other groups keep theirs, nothing is created for a group with nothing saved, and without the
    fault nothing changes."""
    from rollout.codec import CodecError, decode_episode, encode_episode
    from rollout.keys import RunKeys
    from rollout.tasks import TaskQueue
    from rollout.types import Trajectory

    client = redis_server.client()
    keys = RunKeys("e2e-poison")
    queue = TaskQueue(client, keys)
    live = encode_episode(Trajectory(task_id="calc#1", traj_id="t1/0"), {"turn_ids": [1, 2]})
    final = encode_episode(Trajectory(task_id="calc#1", traj_id="t1/1"), {"final": 1})
    queue.save_episodes("t1", {0: live, 1: final})
    queue.save_episodes("t2", {0: live})
    held = [keys.episodes("t1"), keys.episodes("t3")]  # t3: claimed, nothing saved yet

    assert faults.poison_saved(None, client, held) == 0
    assert faults.poison_saved(FaultsConfig(kill_worker="any:0"), client, held) == 0
    assert queue.saved_episodes("t1") == {0: live, 1: final}

    poison = FaultsConfig(kill_worker="any:0", poison_saved=True)
    assert faults.poison_saved(poison, client, held) == 2
    poisoned = queue.saved_episodes("t1")
    assert sorted(poisoned) == [0, 1]
    for data in poisoned.values():
        with pytest.raises(CodecError):
            decode_episode(data)
    assert queue.saved_episodes("t2") == {0: live}  # not a held group
    assert not client.exists(keys.episodes("t3"))


def test_no_product_module_reads_a_fault_variable():
    offenders = [
        str(path.relative_to(ROOT))
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if "AGENTRL_FAULT" in path.read_text(encoding="utf-8")
    ]
    assert not offenders, f"fault switches in the environment: {offenders}"
