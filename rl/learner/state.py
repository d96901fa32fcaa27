"""Save and restore the learner exactly, at any world size: weights, value head, optimizer,
RNG states, counters and the stream position.

Weights and optimizer tensors go through torch.distributed.checkpoint (DCP): `get_state_dict`
gives every rank its shards (DTensors under FSDP2, also the expert-parallel experts, whose keys
and global shapes are those of the unsharded model), and `dcp.save` writes them under global
keys into `learner/` inside the checkpoint directory, one safetensors file per rank that holds
data, each file's header recording where its pieces sit in the full tensors. `dcp.load` reads
whatever pieces the loading ranks' own shards cover, so a checkpoint written by W ranks with
expert-parallel size P loads into any W' and P' (1 -> 2, 2 -> 1, P 2 -> 1, ...); the single
process learner uses the same format (plain tensors: one file, one piece per tensor).

No pickle anywhere: the DCP storage is torch's HuggingFaceStorageWriter/Reader (safetensors
files; the layout is rebuilt from their headers, so there is no pickled `.metadata`, and the
default FileSystemWriter's torch.save'd tensors are avoided). Everything that is not a tensor
(counters, trained group ids, optimizer hyperparameters, Python's RNG) is JSON:

    learner/                    DCP: "model.<fqn>" weights, "optim.<fqn>.<key>" AdamW state
    learner.json                rank 0: version, counters, trained ids (watermarks plus
                                sparse ids, rl/learner/group_ids.py), last acked entry,
                                optimizer param_groups and non-tensor state, writer's W and P
    rng-rank<r>.safetensors     rank r: torch RNG, micro-batch order generator
    rng-rank<r>.json            rank r: Python's random state

A rank without its own RNG files (the run grew) takes rank 0's: the order generator advances
identically on every rank (every rank draws the same permutations), so that is exact. Each file
is covered by the manifest's SHA-256 (rl/learner/checkpoint.py): a corrupt or missing shard is
refused before DCP reads anything. What cannot load is an error naming it (CheckpointError): another
model (a key or shape the checkpoint lacks), or PPO's value head missing from a GRPO run.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from policy.logprobs import TokenLogprobs
from rl.learner.checkpoint import (
    CheckpointError,
    read_json,
    read_tensors,
    write_json,
    write_tensors,
)
from rl.learner.distributed import local
from rl.learner.group_ids import GroupIds

DCP_DIR = "learner"
# A one-rank learner saves and loads with `no_dist=True`. Through its one-rank gloo group,
# DCP's collectives copy the checkpoint's tensors on gloo's own threads, whose parallel copies
# start a second OpenMP team; from then on libgomp counts more threads than CPUs and stops
# spinning between parallel regions (GOMP's throttled spin count), and every later learner step
# took ~1.6x as long (1.2 -> 2.2 s on 2 cores, benchmarks/learner_speed.py's k3 batch;
# tests/rl/test_checkpoint.py). Same files either way.
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=True)


def save_learner(learner, directory: Path) -> None:
    """Every rank calls it (collective in a group): its shards, its RNG; rank 0 the rest."""
    directory = Path(directory)
    model_sd, optim_sd = _state_dicts(learner, with_optimizer=bool(learner.optimizer.state))
    tensors, scalars = _flatten(model_sd, optim_sd)
    writer = dcp.HuggingFaceStorageWriter(str(directory / DCP_DIR), save_distributed=True)
    with _single_process_ok():
        dcp.save(tensors, storage_writer=writer, no_dist=learner.shard.world == 1)
    _save_rng(learner, directory)
    if learner.shard.leader:
        write_json(
            directory / "learner.json",
            {
                "format": "dcp",
                "version": learner.version,
                "skipped_steps": learner.skipped_steps,
                "dropped_groups": learner.dropped_groups,
                "last_acked": learner.last_acked,
                "trained": learner.trained.to_json(),
                "world": learner.shard.world,
                "ep_size": learner.shard.ep_size,
                "value_head": learner.value_head is not None,
                "optimizer": None if optim_sd is None else {
                    "param_groups": optim_sd["param_groups"], "state": scalars
                },
            },
        )  # fmt: skip


def load_learner(learner, directory: Path, *, rng: bool = True) -> None:
    """Every rank calls it (collective in a group), whatever the writer's world size."""
    directory = Path(directory)
    meta = _read_meta(learner, directory)
    module = _modules(learner)
    model_sd, optim_sd = _state_dicts(learner, with_optimizer=meta["optimizer"] is not None)
    tensors = _read_tensors(directory, model_sd, optim_sd, alone=learner.shard.world == 1)
    set_model_state_dict(module, model_sd, options=_OPTIONS)
    if optim_sd is None:  # the checkpoint was taken before any optimizer step
        learner.optimizer.state.clear()
    else:  # a parameter the writer never stepped (no gradient) gets no state here either
        _unflatten_optimizer(optim_sd, tensors, meta["optimizer"])
        lenient = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=False)
        set_optimizer_state_dict(module, learner.optimizer, optim_sd, options=lenient)
    if rng:  # the negative control of the resume test turns this off
        _load_rng(learner, directory)
    learner.version, learner.last_acked = meta["version"], meta["last_acked"]
    learner.trained = GroupIds.from_json(meta.get("trained", []))  # older: a plain list
    learner.skipped_steps, learner.dropped_groups = meta["skipped_steps"], meta["dropped_groups"]


def load_policy_weights(model: torch.nn.Module, directory: Path) -> None:
    """Only the policy's weights of the checkpoint in `directory` (written at any world size and
    expert-parallel size) into `model`: an unsharded model of the run's architecture, e.g. the
    one the run started from (`agentrl export`, `agentrl eval`). No learner, optimizer or process
    group; CheckpointError when the checkpoint does not fit the model."""
    directory = Path(directory)
    if not (directory / DCP_DIR).is_dir():
        raise CheckpointError(f"{directory} holds no policy weights ({DCP_DIR}/ is missing)")
    module = torch.nn.ModuleDict({"trunk": TokenLogprobs(model)})  # the keys _modules gives
    model_sd = get_model_state_dict(module, options=_OPTIONS)
    _read_tensors(directory, model_sd, None)
    set_model_state_dict(module, model_sd, options=_OPTIONS)


def _read_tensors(
    directory: Path, model_sd: dict, optim_sd: dict | None, *, alone: bool = True
) -> dict:
    """DCP-load, in place, this rank's pieces of every weight and of the optimizer state the
    checkpoint has; returns them by global key. `alone` (one rank): without DCP's collectives
    (`no_dist`, see the note at DCP_DIR)."""
    path = str(directory / DCP_DIR)
    saved = set(dcp.HuggingFaceStorageReader(path).read_metadata().state_dict_metadata)
    for fqn, entry in list((optim_sd or {}).get("state", {}).items()):
        if any(torch.is_tensor(v) and f"optim.{fqn}.{k}" not in saved for k, v in entry.items()):
            del optim_sd["state"][fqn]
    tensors, _ = _flatten(model_sd, optim_sd)
    try:
        with _single_process_ok():
            dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(path), no_dist=alone)
    except dcp.CheckpointException as exc:  # (a BaseException) a missing key, another shape
        reason = str(exc).strip().splitlines()[-1]  # DCP's text ends with the first cause
        raise CheckpointError(f"{directory} does not fit this learner: {reason}") from exc
    return tensors


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every save and load without a process group (a dense single-rank learner
    has none); that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _modules(learner) -> torch.nn.Module:
    """One module over everything the optimizer steps, so its state gets global FQN keys."""
    modules = {"trunk": learner.trunk}
    if learner.value_head is not None:
        modules["value_head"] = learner.value_head
    return torch.nn.ModuleDict(modules)


def _state_dicts(learner, *, with_optimizer: bool) -> tuple[dict, dict | None]:
    """This rank's model (and optimizer) state dicts: DTensor shards when sharded. Without
    `with_optimizer` the optimizer is not touched (DCP would initialise an empty one's state
    by a zero step, which a run that has not stepped yet must not see)."""
    module = _modules(learner)
    if not with_optimizer:
        return get_model_state_dict(module, options=_OPTIONS), None
    return get_state_dict(module, learner.optimizer, options=_OPTIONS)


def _flatten(model_sd: dict, optim_sd: dict | None) -> tuple[dict, dict]:
    """(tensors for DCP by global key, the optimizer's non-tensor state by FQN for JSON).
    A tensor stored under several keys (tied embeddings) is saved once, under the first; the
    others load with it, as they share its memory."""
    tensors, seen = {}, set()
    for name, value in model_sd.items():
        piece = local(value)
        where = (piece.untyped_storage().data_ptr(), piece.storage_offset(), tuple(piece.shape))
        if piece.numel() == 0 or where not in seen:
            tensors[f"model.{name}"] = value
        seen.add(where)
    scalars: dict[str, dict] = {}
    for fqn, entry in (optim_sd or {}).get("state", {}).items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim.{fqn}.{key}"] = value
            else:
                scalars.setdefault(fqn, {})[key] = value
    return tensors, scalars


def _unflatten_optimizer(optim_sd: dict, tensors: dict, saved: dict) -> None:
    """The loaded tensors, the saved scalars and hyperparameters back into `optim_sd`."""
    for fqn, entry in optim_sd["state"].items():
        for key in entry:
            if f"optim.{fqn}.{key}" in tensors:
                entry[key] = tensors[f"optim.{fqn}.{key}"]
        entry.update(saved["state"].get(fqn, {}))
    live = optim_sd.get("param_groups", [])
    optim_sd["param_groups"] = [  # JSON made AdamW's betas tuple a list
        {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
        | _implementation(live[i] if i < len(live) else {})
        for i, group in enumerate(saved["param_groups"])
    ]


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""How this learner's optimizer runs (rl/learner/optim.py: fused AdamW for plain tensors, the
default for sharded ones), kept over what a checkpoint saved: a checkpoint written by another
world size or agentrl version must not switch the kernel."""


def _implementation(live_group: dict) -> dict:
    return {k: live_group[k] for k in IMPLEMENTATION_KEYS if k in live_group}


def _read_meta(learner, directory: Path) -> dict:
    path = directory / "learner.json"
    if not path.is_file() or not (directory / DCP_DIR).is_dir():
        raise CheckpointError(
            f"{directory} has no learner state in the DCP format (learner.json + {DCP_DIR}/); "
            "a checkpoint of an older agentrl (learner-rank<r>.safetensors) cannot be resumed "
            "by this version"
        )
    meta = read_json(path)
    if meta["value_head"] != (learner.value_head is not None):
        have, need = ("has", "does not use") if meta["value_head"] else ("has no", "needs")
        raise CheckpointError(
            f"{directory} {have} value head and this run's trainer.algorithm {need} one: "
            "resume with the algorithm that wrote it"
        )
    return meta


def _save_rng(learner, directory: Path) -> None:
    rank = learner.shard.rank
    write_tensors(
        directory / f"rng-rank{rank}.safetensors",
        {"torch": torch.get_rng_state(), "order": learner.generator.get_state()},
    )
    write_json(directory / f"rng-rank{rank}.json", {"python_random": _jsonable(random.getstate())})


def _load_rng(learner, directory: Path) -> None:
    """This rank's RNG states, or rank 0's for a rank the writing run did not have."""
    rank = learner.shard.rank
    if not (directory / f"rng-rank{rank}.safetensors").is_file():
        rank = 0
    tensors = read_tensors(directory / f"rng-rank{rank}.safetensors")
    torch.set_rng_state(tensors["torch"])
    learner.generator.set_state(tensors["order"])
    random.setstate(_tuples(read_json(directory / f"rng-rank{rank}.json")["python_random"]))


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
