"""Where a run computes: `trainer.device` (learner ranks, SFT) and `rollout.device` (rollout
workers and the evaluations they run), each auto | cpu | cuda.

`auto` is resolved once, on the driver, from the GPUs the run can have: on a local Ray this
machine's (torch.cuda.device_count()), on a cluster the GPUs Ray reports after joining it. The
learner takes one GPU per rank first, then the rollout workers one each (or the share their
`resources.GPU` names); a part whose actors do not all get a GPU runs on the CPU and reserves
none. (Ray leaves CUDA_VISIBLE_DEVICES alone for an actor that
reserved no GPU, so an actor resolving `auto` itself would see GPUs it has not reserved: the
actors get the resolved config.) An explicit `cuda` that the GPUs cannot cover is a ConfigError
naming the key: at check time on a local Ray (`agentrl check` / `train`, before anything starts),
after joining on a cluster. Each cuda actor reserves one GPU, or the share `resources.GPU` names
(rl/config/resources.py, `ask`): `rollout.resources.GPU: 0.25` packs four workers onto one GPU,
and each sizes its decode cache from that share of the GPU's free memory (rl/run/build.py).
"""

from __future__ import annotations

from rl.config.resources import gpu_share, gpus_needed
from rl.config.runfile import ConfigError, RunConfig

DEVICES = ("auto", "cpu", "cuda")


def local_gpus() -> int:
    """CUDA devices this process can use (0 without a GPU or with a CPU build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(cfg: RunConfig, gpus: int, where: str = "this machine") -> tuple[str, str]:
    """(learner device, rollout device), each "cpu" or "cuda", for a run that can use `gpus`
    GPUs in all; ConfigError naming the key when an explicit cuda needs more than there are.
    Each cuda actor holds `resources.GPU` of a GPU (default one; 0.25: four share one), and
    shares pack together: a learner at 0.5 and two workers at 0.25 fit on one GPU."""
    t, r = cfg.trainer, cfg.rollout
    if t.exact_logprobs:  # a CPU mode (its config check refuses an explicit cuda): auto is cpu
        gpus = 0
    ranks = (t.world_size, gpu_share(t.resources))
    need_t = gpus_needed(ranks)
    if t.device == "cuda" and gpus < need_t:
        raise ConfigError(
            "trainer.device",
            f"cuda needs {_count(need_t, ranks, 'learner rank(s)', 'trainer')}"
            f" (trainer.world_size), but {_have(gpus, where)}; set trainer.device: cpu, or auto "
            "(cuda when there are enough GPUs)",
        )
    learner = t.device if t.device != "auto" else _auto(ranks, (), gpus)
    beside = (ranks,) if learner == "cuda" else ()
    workers = (r.num_workers, gpu_share(r.resources))
    need_all = gpus_needed(*beside, workers)
    if r.device == "cuda" and need_all > gpus:
        need_r = gpus_needed(workers)
        total = f", {need_all} with the learner's ranks," if beside else ""
        raise ConfigError(
            "rollout.device",
            f"cuda needs {_count(need_r, workers, 'rollout workers', 'rollout')}"
            f" (rollout.num_workers){total} but {_have(gpus, where)}; set rollout.device: cpu or "
            "auto, lower rollout.num_workers, or let workers share a GPU "
            "(rollout.resources.GPU: 0.25 puts four on one)",
        )
    rollout = r.device if r.device != "auto" else _auto(workers, beside, gpus)
    return learner, rollout


def _auto(actors: tuple[int, float], beside: tuple, gpus: int) -> str:
    """cuda when `actors` ((count, share)) get their shares of the GPUs beside the groups
    already there; a share of 0 reserves none: cpu."""
    count, share = actors
    fits = gpus_needed(*beside, actors) <= gpus
    return "cuda" if count > 0 and share > 0 and fits else "cpu"


def _count(need: int, group: tuple[int, float], what: str, part: str) -> str:
    actors, share = group
    if share == 1:
        return f"a GPU for each of the {actors} {what}"
    return f"{need} GPU(s) for the {actors} {what} at {share:g} GPU each ({part}.resources.GPU)"


def _have(gpus: int, where: str) -> str:
    if gpus:
        return f"{where} has {gpus} GPU(s)"
    return f"{where} has no CUDA GPU (torch.cuda.is_available() is False)"


def check_devices(cfg: RunConfig) -> None:
    """The check-time half: an explicit cuda the local machine cannot serve (local Ray only; a
    cluster's GPUs are counted once the run has joined it). Imports torch only for cuda."""
    if cfg.ray.address != "local" or "cuda" not in (cfg.trainer.device, cfg.rollout.device):
        return
    resolve_devices(cfg, local_gpus())


def with_devices(cfg: RunConfig, gpus: int, where: str = "this machine") -> RunConfig:
    """A copy of `cfg` with both devices resolved to cpu or cuda (what the actors get)."""
    learner, rollout = resolve_devices(cfg, gpus, where)
    out = cfg.model_copy(deep=True)
    out.trainer.device, out.rollout.device = learner, rollout
    return out


def sft_device(cfg: RunConfig) -> str:
    """Where the SFT warm start runs: it runs in the driver process, so on cuda only when the
    learner does and the driver itself has a GPU (on a cluster it may not)."""
    return "cuda" if cfg.trainer.device != "cpu" and local_gpus() > 0 else "cpu"


def torch_device(name: str):
    """A torch.device for "cpu", "cuda" (this process's current GPU; Ray gives a cuda actor
    one, as cuda:0) or "auto" (cuda if torch sees one)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"device must be one of {DEVICES}, got {name!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device cuda, but torch sees no CUDA GPU in this process")
    return torch.device("cuda", torch.cuda.current_device())
