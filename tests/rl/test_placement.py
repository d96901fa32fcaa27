"""Placement by resources (rl/run/placement.py): what learner ranks and rollout workers ask Ray for,
and a request the cluster cannot meet failing in seconds, before any work, in one line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rl.config.resources import ray_options
from rl.config.runfile import ConfigError, RunConfig, load_config
from rl.run.placement import PlacementError, demands, unmet
from tests.rl.test_e2e import ROOT, tiny_overrides

CONFIG = ROOT / "configs/quickstart.yaml"


def cfg_with(*overrides: str) -> RunConfig:
    return load_config(CONFIG, list(overrides))


def test_requests_default_to_the_cpu_keys_and_add_resources():
    cfg = cfg_with(
        "rollout.resources={rollout: 1, GPU: 0}",
        "trainer.resources={GPU: 1}",
        "trainer.device=cuda",
    )
    assert cfg.rollout.ray_resources == {"CPU": 0.5, "rollout": 1}  # GPU: 0 asks for nothing
    assert cfg.trainer.ray_resources == {"CPU": 1.0, "GPU": 1}
    assert ray_options(cfg.trainer.ray_resources) == {
        "num_cpus": 1.0,
        "num_gpus": 1,
        "resources": {},
    }
    assert ray_options(cfg.rollout.ray_resources)["resources"] == {"rollout": 1}


def test_resources_cpu_replaces_the_older_key_and_a_saved_config_loads_again():
    cfg = cfg_with("rollout.resources={CPU: 2}", "trainer.resources={CPU: 0.25}")
    assert cfg.rollout.cpus_per_worker == 2 and cfg.trainer.cpus == 0.25
    again = RunConfig.model_validate(cfg.model_dump())  # config.yaml holds both spellings
    assert again.rollout.ray_resources == {"CPU": 2} and again.trainer.ray_resources["CPU"] == 0.25
    assert cfg_with("trainer.cpus=2", "trainer.resources={CPU: 2}").trainer.cpus == 2


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("rollout.resources={CPU: 1}", "rollout.resources.CPU", "keep one"),
        ("trainer.resources={GPU: 1.5}", "trainer.resources", "whole number"),
        ("trainer.resources={memory: 100}", "trainer.resources", "not a resource to ask for"),
        ("rollout.resources={rollout: -1}", "rollout.resources.rollout", "must be >= 0"),
        ("rollout.resources=[1]", "rollout.resources", "expected a mapping"),
    ],
)
def test_bad_resources_name_the_key(override, key, fragment):
    overrides = [override, "rollout.cpus_per_worker=0.5"] if "CPU" in override else [override]
    with pytest.raises(ConfigError) as info:
        cfg_with(*overrides)
    assert info.value.key == key and fragment in info.value.message


def test_a_custom_resource_nobody_has_is_named_with_what_to_do():
    needs = demands(cfg_with("rollout.resources={CPU: 0.5, rollout: 1}"))
    assert unmet(needs, [{"CPU": 4.0, "memory": 1e9}]) == (
        "rollout workers need 2 x {CPU: 0.5, rollout: 1} but the cluster has rollout: 0; "
        "add a node with the `rollout` resource or set rollout.resources"
    )


def test_cpus_are_counted_for_learner_ranks_and_workers_together():
    needs = demands(cfg_with("rollout.num_workers=4"))
    assert unmet(needs, [{"CPU": 2.0}], local=True) == (
        "learner ranks and rollout workers need CPU: 3 in all (1 x 1 + 4 x 0.5) but the cluster "
        "has CPU: 2; lower trainer.world_size, trainer.cpus, rollout.num_workers or "
        "rollout.cpus_per_worker, raise ray.num_cpus, or add nodes with more `CPU`"
    )
    assert unmet(needs, [{"CPU": 2.0}, {"CPU": 1.0}]) is None


def test_one_actor_bigger_than_every_node():
    needs = demands(cfg_with("trainer.resources={CPU: 4, GPU: 1}", "trainer.device=cuda"))
    problem = unmet(needs, [{"CPU": 2.0, "GPU": 1.0}] * 2 + [{"CPU": 8.0}])
    assert problem.startswith("each of the learner ranks needs {CPU: 4, GPU: 1} on one node")
    assert "(nodes: {CPU: 2, GPU: 1} x 2, {CPU: 8, GPU: 0})" in problem


def test_totals_that_fit_but_nodes_that_do_not():
    # 2 ranks x 1.5 CPU + 1 worker x 1 CPU = the 4 CPUs of two 2-CPU nodes, but a node that
    # holds a rank has 0.5 CPU left
    needs = demands(
        cfg_with(
            "trainer.world_size=2",
            "trainer.cpus=1.5",
            "rollout.num_workers=1",
            "rollout.cpus_per_worker=1",
        )
    )
    problem = unmet(needs, [{"CPU": 2.0}] * 2)
    assert problem == (
        "learner ranks 2 x {CPU: 1.5} and rollout workers 1 x {CPU: 1} fit the cluster's totals "
        "but not its nodes ({CPU: 2} x 2); ask for less per actor, or add nodes"
    )
    assert unmet(needs, [{"CPU": 2.0}] * 2 + [{"CPU": 0.5}] * 4) is not None  # slivers: no help
    assert unmet(needs, [{"CPU": 1.5}] * 2 + [{"CPU": 1.0}]) is None  # an exact packing


def test_custom_resources_steer_actors_to_their_nodes():
    needs = demands(
        cfg_with(
            "trainer.resources={CPU: 1, learner: 1}", "rollout.resources={CPU: 0.5, rollout: 1}"
        )
    )
    head, worker = {"CPU": 1.0, "learner": 1.0}, {"CPU": 1.0, "rollout": 2.0}
    assert unmet(needs, [head, worker, worker]) is None
    assert unmet(needs, [head, worker]) is None  # both workers fit on one worker node
    assert "the cluster has learner: 0" in unmet(needs, [worker, worker])


def _failed_fast(run_dir, started: float) -> float:
    elapsed = time.monotonic() - started
    assert not (run_dir / "policy-init").exists(), "the policy was built before the check"
    assert not (run_dir / "sft-model").exists() and not (run_dir / "sft").exists()
    return elapsed


@pytest.mark.distributed
def test_a_missing_custom_resource_fails_in_seconds_on_a_real_ray(tmp_path):
    from rl.run.train import make_run_dir, train

    cfg = cfg_with(
        *tiny_overrides(tmp_path),
        "ray.object_store_mb=100",
        "rollout.resources={rollout: 1}",
    )
    run_dir = make_run_dir(cfg)
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        train(cfg, run_dir)
    elapsed = _failed_fast(run_dir, started)
    print(f"failed after {elapsed:.1f} s (Redis + Ray start included): {info.value}")
    assert str(info.value) == (
        "rollout workers need 2 x {CPU: 0.5, rollout: 1} but the cluster has rollout: 0; "
        "add a node with the `rollout` resource or set rollout.resources"
    )
    # "before any work" is checked by what exists (_failed_fast), not by a clock: Ray's own
    # start takes 3-5 s on idle cores and far longer on a loaded box (timing asserts flaked)


@pytest.mark.slow
@pytest.mark.distributed
def test_more_cpus_than_the_local_ray_has_fails_before_sft_in_one_line(tmp_path):
    args = [str(CONFIG), *tiny_overrides(tmp_path), "ray.num_cpus=2", "rollout.num_workers=4"]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (run_dir,) = tmp_path.glob("e2e-*")
    elapsed = _failed_fast(run_dir, started)
    print(f"exit {proc.returncode} after {elapsed:.1f} s (imports included): {proc.stderr}")
    assert proc.returncode == 2
    # one line of ours; Ray's own processes may write to the same stderr before and after it
    # (start-up warnings, log lines its log monitor flushes at shutdown on a loaded box)
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("agentrl")] == [
        "agentrl: cannot place the run on the Ray cluster: learner ranks and rollout workers "
        "need CPU: 3 in all (1 x 1 + 4 x 0.5) but the cluster has CPU: 2; lower "
        "trainer.world_size, trainer.cpus, rollout.num_workers or rollout.cpus_per_worker, "
        "raise ray.num_cpus, or add nodes with more `CPU`"
    ]
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if 'File "' in line]
    assert not [line for line in ours if "/rl/" in line], ours  # no traceback through our code
    assert "SFT" not in proc.stdout  # no work began: nor do the artifacts (_failed_fast)
