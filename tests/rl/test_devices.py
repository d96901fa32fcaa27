"""The CUDA path's plumbing, on the CPU: device keys and their resolution, the check-time error,
the process-group backend, the SFT arguments, the Ray GPU request, batches on a device. (The
CUDA computations themselves are tested in tests/gpu/, which skip without a GPU.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.cli import main
from rl.config.resources import ask, gpus_needed
from rl.config.runfile import ConfigError, load_config
from rl.learner.batch import pack
from rl.learner.distributed import backend_for
from rl.run.build import cache_budget, gpu_cache_budget
from rl.run.devices import local_gpus, resolve_devices, sft_device, torch_device, with_devices
from rl.sft.warm_start import _sft_args
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def config(*overrides: str):
    return load_config(None, list(overrides))


@no_gpu
def test_auto_resolves_to_cpu_without_a_gpu():
    cfg = config()
    assert (cfg.trainer.device, cfg.rollout.device) == ("auto", "auto")  # the defaults
    assert local_gpus() == 0
    resolved = with_devices(cfg, local_gpus())
    assert (resolved.trainer.device, resolved.rollout.device) == ("cpu", "cpu")
    assert cfg.trainer.device == "auto"  # a copy: the caller's config is left as written
    assert torch_device("auto") == torch.device("cpu")
    assert sft_device(resolved) == sft_device(cfg) == "cpu"


@pytest.mark.parametrize(
    ("overrides", "gpus", "want"),
    [
        ((), 0, ("cpu", "cpu")),
        ((), 1, ("cuda", "cpu")),  # one GPU: the learner's; 2 workers would need 2 more
        ((), 3, ("cuda", "cuda")),
        (("rollout.num_workers=1",), 2, ("cuda", "cuda")),
        (("trainer.device=cpu",), 2, ("cpu", "cuda")),
        (("trainer.world_size=2",), 1, ("cpu", "cpu")),  # auto never half-places the ranks
        (("trainer.device=cuda", "rollout.device=cpu"), 1, ("cuda", "cpu")),
        (("trainer.device=cpu", "rollout.device=cpu"), 8, ("cpu", "cpu")),
    ],
)
def test_auto_takes_a_gpu_per_actor_learner_first(overrides, gpus, want):
    assert resolve_devices(config(*overrides), gpus) == want


@pytest.mark.parametrize(
    ("overrides", "gpus", "key", "fragment"),
    [
        (("trainer.device=cuda",), 0, "trainer.device", "no CUDA GPU"),
        (("trainer.device=cuda", "trainer.world_size=2"), 1, "trainer.device", "2 learner"),
        (("rollout.device=cuda",), 0, "rollout.device", "no CUDA GPU"),
        (("rollout.device=cuda",), 2, "rollout.device", "3 with the learner's ranks"),
        (("rollout.device=cuda", "trainer.device=cpu"), 1, "rollout.device", "2 rollout"),
    ],
)
def test_explicit_cuda_without_enough_gpus_names_the_key(overrides, gpus, key, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_devices(config(*overrides), gpus)
    assert info.value.key == key and fragment in info.value.message


def test_device_values_are_checked_like_any_key():
    with pytest.raises(ConfigError) as info:
        config("trainer.device=gpu")
    assert info.value.key == "trainer.device" and "'auto', 'cpu' or 'cuda'" in info.value.message


@no_gpu
def test_cuda_without_a_gpu_fails_at_check_time(capsys):
    """`agentrl check` (and `train`, which loads the same way) refuses before anything starts;
    a cluster's GPUs are only counted after joining it, so ray.address auto passes the check."""
    run_file = str(ROOT / "configs/quickstart.yaml")
    assert main(["check", run_file, "trainer.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "config error: trainer.device: cuda needs a GPU" in err and "no CUDA GPU" in err
    assert main(["check", run_file, "rollout.device=cuda", "trainer.device=cpu"]) == 2
    assert "rollout.device: cuda needs a GPU" in capsys.readouterr().err
    on_a_cluster = ["ray.address=auto", "output_dir=/mnt/agentrl/runs"]
    assert main(["check", run_file, "trainer.device=cuda", *on_a_cluster]) == 0
    assert main(["check", run_file]) == 0  # auto


def test_process_group_backend_gloo_on_cpu_nccl_on_cuda():
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    assert backend_for("cpu") == "gloo"
    on_cuda = BackendConfig(Backend(backend_for("cuda"))).get_device_backend_map()
    assert on_cuda == {"cuda": "nccl", "cpu": "gloo"}  # CPU tensors (msgpack, sums) keep gloo
    with pytest.raises(ValueError):
        backend_for("auto")


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
def test_sft_use_cpu_follows_the_device(tmp_path):
    from trl import SFTConfig

    cfg = config()
    on_cpu = _sft_args(cfg, tmp_path, 10, SFTConfig, device="cpu")
    on_cuda = _sft_args(cfg, tmp_path, 10, SFTConfig, device="cuda")
    assert on_cpu.use_cpu is True and on_cuda.use_cpu is False
    assert not on_cpu.bf16 and not on_cuda.bf16
    with pytest.raises(ValueError):
        _sft_args(cfg, tmp_path, 10, SFTConfig, device="auto")


def test_ray_gpus_one_per_cuda_actor():
    assert ask(1.0, {}, "cuda") == {"CPU": 1.0, "GPU": 1.0}
    assert ask(0.5, {"rollout": 1}, "cpu") == {"CPU": 0.5, "rollout": 1}
    assert ask(1.0, {"GPU": 2}, "cuda")["GPU"] == 2  # resources say how many
    assert ask(0.5, {"GPU": 0.25}, "cuda")["GPU"] == 0.25
    assert "GPU" not in ask(1.0, {}, "auto")  # auto is resolved on the driver first
    # a part that auto put on the CPU reserves no GPU (it would wait forever where none is)
    assert ask(0.5, {"GPU": 0.25, "rollout": 1}, "cpu") == {"CPU": 0.5, "rollout": 1}


@pytest.mark.parametrize(
    ("groups", "gpus"),
    [
        ([(4, 0.25)], 1),
        ([(5, 0.25)], 2),
        ([(3, 0.5)], 2),
        ([(3, 1.0)], 3),
        ([(2, 2.0)], 4),
        ([(4, 0)], 0),
        ([(1, 0.5), (2, 0.25)], 1),  # a learner at half a GPU beside two workers at a quarter
        ([(1, 0.5), (3, 0.25)], 2),
        ([(1, 1.0), (4, 0.25)], 2),
        ([(2, 0.3333), (3, 0.25)], 2),
    ],
)
def test_fractional_gpu_shares_pack_onto_whole_gpus(groups, gpus):
    assert gpus_needed(*groups) == gpus


@pytest.mark.parametrize(
    ("overrides", "gpus", "want"),
    [
        (("rollout.resources={GPU: 0.25}", "rollout.num_workers=4"), 2, ("cuda", "cuda")),
        (("rollout.resources={GPU: 0.25}", "rollout.num_workers=5"), 2, ("cuda", "cpu")),
        (("rollout.resources={GPU: 0.5}",), 1, ("cuda", "cpu")),  # the learner holds the one
        (("rollout.resources={GPU: 0.5}", "trainer.device=cpu"), 1, ("cpu", "cuda")),
        (("rollout.resources={GPU: 0}",), 8, ("cuda", "cpu")),  # a share of 0 reserves none
        (("trainer.resources={GPU: 0.5}", "rollout.resources={GPU: 0.5}"), 2, ("cuda", "cuda")),
        # everything on one GPU: the learner's half and two workers' quarters
        (("trainer.resources={GPU: 0.5}", "rollout.resources={GPU: 0.25}"), 1, ("cuda", "cuda")),
        (("trainer.resources={GPU: 0.5}", "rollout.resources={GPU: 0.5}"), 1, ("cuda", "cpu")),
    ],
)
def test_auto_counts_each_actors_share_of_a_gpu(overrides, gpus, want):
    assert resolve_devices(config(*overrides), gpus) == want
    resolved = with_devices(config(*overrides), gpus)
    on_cpu = [s for s in (resolved.trainer, resolved.rollout) if s.device == "cpu"]
    assert all("GPU" not in s.ray_resources for s in on_cpu)


def test_workers_sharing_a_gpu_that_do_not_fit_name_the_share():
    overrides = ("rollout.device=cuda", "rollout.resources={GPU: 0.25}", "rollout.num_workers=6")
    with pytest.raises(ConfigError) as info:
        resolve_devices(config(*overrides), 2)
    assert info.value.key == "rollout.device"
    assert "2 GPU(s) for the 6 rollout workers at 0.25 GPU each" in info.value.message
    assert resolve_devices(config(*overrides), 3) == ("cuda", "cuda")


def test_a_gpu_asked_for_actors_on_the_cpu_is_refused_by_key():
    with pytest.raises(ConfigError) as info:
        config("rollout.device=cpu", "rollout.resources={GPU: 0.25}")
    assert info.value.key == "rollout.resources.GPU" and "rollout.device: cpu" in info.value.message
    with pytest.raises(ConfigError) as info:
        config("trainer.device=cpu", "trainer.resources={GPU: 1}")
    assert info.value.key == "trainer.resources.GPU"
    with pytest.raises(ConfigError) as info:  # NCCL: one GPU per rank
        config("trainer.world_size=2", "trainer.resources={GPU: 0.5}")
    assert info.value.key == "trainer.resources.GPU" and "cannot share" in info.value.message
    with pytest.raises(ConfigError) as info:  # Ray would let every such worker onto GPU 0
        config("rollout.device=cuda", "rollout.resources={GPU: 0}")
    assert info.value.key == "rollout.resources.GPU" and "never reserved" in info.value.message
    with pytest.raises(ConfigError) as info:  # packed onto one GPU, 0.3 would waste a tenth
        config("rollout.resources={GPU: 0.3}")
    assert info.value.key == "rollout.resources" and "whole fraction" in info.value.message
    assert config("rollout.resources={GPU: 0.3333}").rollout.resources["GPU"] == 0.3333
    assert gpus_needed((7, 0.3333)) == 3


def test_a_worker_sharing_a_gpu_sizes_its_cache_from_its_share():
    free = 40 * 2**30
    assert gpu_cache_budget(free, 1.0) == free // 2
    assert gpu_cache_budget(free, 0.25) == free // 8  # four workers: half the GPU in all
    assert gpu_cache_budget(free, 0.0) == gpu_cache_budget(free, 2.0) == free // 2


@no_gpu
def test_torch_device_refuses_cuda_without_a_gpu():
    assert torch_device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        torch_device("cuda")
    with pytest.raises(ValueError):
        torch_device("tpu")


def test_batch_moves_to_a_device_whole():
    trajs = []
    for reward in (0.0, 1.0):
        traj = Trajectory(task_id="t", status=RolloutStatus.COMPLETED, reward=reward)
        traj.append([5, 6, 7], sampled=False)
        traj.append([8, 9], sampled=True, logprobs=[-0.5, -0.25], version=0)
        trajs.append(traj)
    group = TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)
    batch = pack([group], pad_token_id=0)
    assert batch.to("cpu") is batch
    meta = batch.to("meta")  # any other device: every tensor moves, None stays None
    assert meta.input_ids_NT.is_meta and meta.turn_mask_NK.is_meta and meta.routes_NTMK is None
    assert meta.input_ids_NT.shape == batch.input_ids_NT.shape


def test_cpu_cache_budget_is_unchanged():
    cfg = config("rollout.cache_budget_mb=64")
    assert cache_budget(cfg, torch.device("cpu")) == cache_budget(cfg) == 64 * 2**20


def test_exact_logprobs_keep_auto_devices_on_the_cpu():
    """trainer.exact_logprobs is a CPU mode: on a machine with GPUs, auto resolves to cpu."""
    exact = ["trainer.exact_logprobs=true", "policy.model_type=agentrl_k3",
             "policy.config={preset: k3-debug}"]  # fmt: skip
    assert resolve_devices(load_config(None, exact), gpus=4) == ("cpu", "cpu")
    assert resolve_devices(load_config(None, exact[1:]), gpus=4) == ("cuda", "cuda")
