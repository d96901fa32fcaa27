"""A learner rank's view of the learner group (torch.distributed, gloo on CPU / NCCL on GPUs).

`Shard` hides the group from the learner: with one rank it is the whole batch and no
communication; with W ranks, rank 0 reads the stream and shares the batch, every rank trains on
its slice of the trajectories (the same number of micro-batches on every rank, as expert
parallelism exchanges tokens in every forward), gradients are summed by FSDP2, metric sums are
all-reduced, and full weights are gathered for a push. Letters: N = trajectories.
With context parallelism (`context` C > 1) the C consecutive ranks of one data index train the
same rows, each its shard of every sequence; their gradients are summed by `sync_context`, and
metric sums and shared rows reduce over the W // C ranks of one context index (`data_group`).

On CUDA the group has two backends (`backend_for`): NCCL for CUDA tensors (FSDP2's gathers and
reductions, expert all-to-alls, the batch-wide logprob rows) and gloo for CPU tensors (the
msgpack batch and the metric sums below, checkpoint coordination), each collective picking by
its tensor's device. With several ranks FSDP2 computes in bf16 and reduces in fp32 on CUDA.
"""

from __future__ import annotations

import datetime
import math

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollout.codec import decode_group, encode_group
from rollout.types import TrajectoryGroup


def backend_for(device: str) -> str:
    """The torch.distributed backend of a learner group on `device` ("cpu" or "cuda"): gloo on
    the CPU; on CUDA, NCCL for CUDA tensors with gloo kept for CPU tensors."""
    if device == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device == "cpu":
        return "gloo"
    raise ValueError(f"device must be cpu or cuda (resolve auto first), got {device!r}")


def init_group(
    address: str, port: int, rank: int, world: int, timeout_s: float, device: str = "cpu"
) -> None:
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_single(device: str = "cpu") -> None:
    """A one-rank group, so collective helpers (e.g. MoE router statistics) work unchanged."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1)


class Shard:
    def __init__(
        self, rank: int = 0, world: int = 1, ep_size: int = 1, device: str = "cpu",
        context: int = 1,
    ):  # fmt: skip
        self.rank, self.world, self.ep_size, self.device = rank, world, ep_size, device
        self.context = context
        """Context-parallel ranks (C): rank r trains the rows of data index r // C, the C ranks
        of a data index split each sequence (policy/k3/context.py)."""
        self._meshes = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        return self.rank // self.context

    @property
    def data_world(self) -> int:
        return self.world // self.context

    def meshes(self):
        """The group's device meshes (policy/parallel.py build_meshes), built on first use."""
        if self._meshes is None:
            from policy.parallel import build_meshes

            self._meshes = build_meshes(
                ep_size=self.ep_size, context=self.context, device_type=self.device
            )
        return self._meshes

    @property
    def context_group(self):
        """The process group of the ranks sharing this rank's sequences; None without CP."""
        return None if self.context == 1 else self.meshes().cp.get_group()

    @property
    def data_group(self):
        """The ranks of this context index (each holds all of a batch's rows between them):
        metric sums and shared rows reduce over it; None: every rank (no CP)."""
        return None if self.context == 1 else self.meshes().dp.get_group()

    def prepare_model(self, model):
        """FSDP2 (+ expert parallel) when there are several ranks; the model itself otherwise."""
        if self.world == 1:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from policy.parallel import parallelize

        meshes = self.meshes()
        mixed = None  # CPU: the model's own dtype throughout
        if self.device == "cuda":
            mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return parallelize(model, meshes, mp_policy=mixed)

    def share_groups(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """Rank 0's groups on every rank (msgpack bytes, never pickle)."""
        if self.world == 1:
            return groups
        payload = msgpack.packb([encode_group(g) for g in groups]) if self.leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, 0)
        buffer = torch.zeros(int(size), dtype=torch.uint8)
        if self.leader:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(buffer, 0)
        return [decode_group(g) for g in msgpack.unpackb(buffer.numpy().tobytes())]

    def micro_batches(self, order_N: torch.Tensor, size: int) -> list[torch.Tensor]:
        """This rank's rows of `order_N`, cut into the same number of pieces on every rank
        (a piece may be empty; the caller runs a zero-weight forward for it)."""
        mine = torch.tensor_split(order_N, self.data_world)[self.data_rank]
        count = max(1, math.ceil(math.ceil(len(order_N) / self.data_world) / size))
        return list(torch.tensor_split(mine, count))

    def max(self, value: int) -> int:
        """The largest `value` over the data ranks of this context index (all ranks without
        context parallelism): for values that context ranks share, such as a micro-batch's
        width."""
        if self.world == 1:
            return value
        out = torch.tensor([value], dtype=torch.int64)  # context ranks: the same value
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.data_group)
        return int(out)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return values
        keys = sorted(values)
        totals = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(totals, group=self.data_group)  # context ranks hold the same values
        return dict(zip(keys, totals.tolist(), strict=True))

    def sync_replicated(self, module: torch.nn.Module | None) -> None:
        """Sum the gradients of a module every rank holds whole (e.g. PPO's value head)."""
        if self.world == 1 or module is None:
            return
        for param in module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)

    def sync_context(self, params) -> None:
        """Sum the gradients over the context ranks (each holds its shard's share; FSDP2 has
        summed them over the data ranks), in buckets of one dtype: afterwards the context
        ranks' gradients are equal, so are their optimizer steps. A parameter without a
        gradient on this rank but with one on another gets zeros first."""
        if self.context == 1:
            return
        params = list(params)
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.context_group)
        for param, flag in zip(params, has.tolist(), strict=True):
            if flag and param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [local(p.grad) for p in params if p.grad is not None]
        for bucket in _buckets(grads, 1 << 26):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.context_group)
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                grad.copy_(part.view_as(grad))

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        if self.world == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        from policy.parallel import clip_grad_norm_

        return float(clip_grad_norm_(params, max_norm, agree=self.context_group))

    def full_weights(self, model) -> dict[str, np.ndarray]:
        """Unsharded weights as numpy (on rank 0; {} elsewhere). Every rank must call it."""
        if self.world == 1:
            from policy.hf import export_weights

            return export_weights(model)
        from policy.parallel import full_state_dict

        full = full_state_dict(model, rank0_only=True)
        return {k: v.detach().cpu().contiguous().numpy().copy() for k, v in full.items()}


def _buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each of at most `cap` elements (or
    one larger tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = out[-1][-1] if out else None
        same = last is not None and (last.dtype, last.device) == (tensor.dtype, tensor.device)
        if same and size + tensor.numel() <= cap:
            out[-1].append(tensor)
            size += tensor.numel()
        else:
            out.append([tensor])
            size = tensor.numel()
    return out


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
