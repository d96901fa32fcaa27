"""Save and restore a learner rank exactly, without pickle: weights, value head, optimizer, RNG
states, counters and the stream position. Each rank writes its own pieces of sharded tensors
(`learner-rank<r>.safetensors` + `.json`); a checkpoint only loads into a group of the same
world size and expert-parallel size (anything else is an explicit error, never a silent reshard).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rl.checkpoint import CheckpointError, read_json, read_tensors, write_json, write_tensors
from rl.distributed import like, local


def save_learner(learner, directory: Path) -> None:
    rank = learner.shard.rank
    tensors = {f"model.{k}": local(v).clone() for k, v in learner.trunk.state_dict().items()}
    if learner.value_head is not None:
        tensors.update({f"value_head.{k}": v for k, v in learner.value_head.state_dict().items()})
    opt = learner.optimizer.state_dict()
    meta_state: dict[str, dict] = {}
    for index, entry in opt["state"].items():
        meta_state[str(index)] = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{index}.{key}"] = local(value).clone()
            else:
                meta_state[str(index)][key] = value
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.order"] = learner.generator.get_state()
    write_tensors(Path(directory) / f"learner-rank{rank}.safetensors", tensors)
    write_json(
        Path(directory) / f"learner-rank{rank}.json",
        {
            "version": learner.version,
            "skipped_steps": learner.skipped_steps,
            "dropped_groups": learner.dropped_groups,
            "last_acked": learner.last_acked,
            "trained": sorted(learner.trained),
            "world": learner.shard.world,
            "ep_size": learner.shard.ep_size,
            "optimizer": {"param_groups": opt["param_groups"], "state": meta_state},
            "python_random": _jsonable(random.getstate()),
        },
    )


def load_learner(learner, directory: Path, *, rng: bool = True) -> None:
    rank = learner.shard.rank
    path = Path(directory) / f"learner-rank{rank}.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no state for learner rank {rank}")
    tensors, meta = read_tensors(path), read_json(Path(directory) / f"learner-rank{rank}.json")
    group = (meta["world"], meta["ep_size"])
    if group != (learner.shard.world, learner.shard.ep_size):
        raise CheckpointError(
            f"{directory} was written by {group[0]} learner ranks with expert "
            f"parallel {group[1]}; this run has {learner.shard.world} and "
            f"{learner.shard.ep_size}: resume with the same trainer settings"
        )
    with torch.no_grad():
        for name, value in learner.trunk.state_dict().items():
            local(value).copy_(tensors[f"model.{name}"])
    if learner.value_head is not None:
        learner.value_head.load_state_dict(_strip(tensors, "value_head."))
    _load_optimizer(learner.optimizer, tensors, meta["optimizer"])
    if rng:  # the negative control of the resume test turns this off
        torch.set_rng_state(tensors["rng.torch"])
        learner.generator.set_state(tensors["rng.order"])
        random.setstate(_tuples(meta["python_random"]))
    learner.version, learner.last_acked = meta["version"], meta["last_acked"]
    learner.trained = set(meta.get("trained", []))
    learner.skipped_steps, learner.dropped_groups = meta["skipped_steps"], meta["dropped_groups"]


def _load_optimizer(optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {int(i): dict(scalars) for i, scalars in meta["state"].items()}
    for name, tensor in _strip(tensors, "optim.").items():
        index, key = name.split(".", 1)
        template = params[int(index)]
        state.setdefault(int(index), {})[key] = like(template, tensor) if tensor.dim() else tensor
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
