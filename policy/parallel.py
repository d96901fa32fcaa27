"""Sharded training of the MoE policy, applied from outside the (single-device) model: expert
parallelism (EP) for every StableLatentMoE plus FSDP2 for everything else, full-weight export
for weight pushes, and global-batch Quantile Balancing statistics.

Layout on W ranks with expert-parallel size P (P divides W and every layer's E):

    meshes.dp       1D ("dp",) over all W ranks. FSDP2 shards every dense parameter on dim 0:
                    embeddings, mixers, norms, routers, latent projections, shared experts,
                    head. One FSDP group per decoder layer, one for the root.
    meshes.experts  2D ("edp", "ep") of shape (W // P, P); rank r sits at (r // P, r % P).
                    "ep":  P consecutive ranks split the routed experts: the rank at ep index j
                           owns experts [j*E/P, (j+1)*E/P) (dim 0 of gate_up_proj [E, 2F, L] and
                           down_proj [E, L, F]); tokens travel to their expert's owner and back
                           by all-to-all inside this group.
                    "edp": the W // P ranks that own the same experts; FSDP2 shards those E/P
                           experts over them (dim 0 again), so each rank stores E/W of them.
    P = 1:          no EP; plain FSDP2 over W ranks (experts are gathered like any weight).
    meshes.cp       context parallelism C > 1 (`build_meshes(context=C)`): the C consecutive
                    ranks that split one sequence (policy/k3/context.py). "dp" and the expert
                    meshes above then hold the W // C ranks of one context index, and the
                    weights are replicated over "cp" (its gradients summed by the caller).

Gradients are SUMMED over ranks (every FSDP group reduces with divide factor 1). Each rank's loss
must therefore be its share of the global loss, e.g. `local_token_sum / global_token_count`
(`global_sum` gives the count): the summed gradient is then exactly the gradient of the global
loss, also when ranks hold different numbers of tokens.

The model must be identical on every rank when `parallelize` is called (same seed or the same
checkpoint): FSDP keeps each rank's own slice without broadcasting. With EP every rank must run
the same sequence of forward passes (each MoE layer exchanges tokens with the other ranks).

On every learner rank (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set by the launcher):

    dist.init_process_group("gloo")          # GPUs: "cpu:gloo,cuda:nccl", model on the GPU
    meshes = build_meshes(ep_size=2)         # GPUs: device_type="cuda"
    model = parallelize(build_policy(seed=0), meshes)      # in place; returns the model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)   # after parallelize: DTensor params
    stats = RouterStats(model)
    for step in ...:
        count = global_sum(loss_mask.sum())                # loss tokens over all ranks
        with stats.record(token_mask=attention_mask):
            logits = model(input_ids).logits
        (token_losses(logits) * loss_mask).sum().div(count).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        metrics = stats.load_metrics(); stats.update_biases(); stats.reset()
        weights = full_state_dict(model, rank0_only=True)  # weight push: every rank calls

Letters: T tokens, D hidden size, L expert width (latent size), F expert intermediate size,
E experts of a layer, X = E / P experts per EP rank, P expert-parallel size, W world size,
S = T*K token-expert assignments, R assignments received by this rank, K experts per token;
in the bare all-to-all: N rows sent, M rows received, I the trailing (row) dims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from policy.k3.balance import (
    expert_load,
    load_summary,
    next_bias,
    quantile_balancing_candidate,
)
from policy.k3.moe import (
    DISPATCHES,
    GroupedExperts,
    StableLatentMoE,
    dense_experts,
    naive_experts,
)
from policy.k3.moe import sorted_experts as _sorted_experts

# --------------------------------------------------------------------------- meshes


@dataclasses.dataclass(frozen=True, slots=True)
class TrainMeshes:
    """The two device meshes of a learner group (see the module docstring)."""

    dp: DeviceMesh  # ("dp",) the W // C ranks at this rank's context index: dense FSDP
    experts: DeviceMesh  # ("edp", "ep") = (W // C // P, P): expert FSDP x expert parallel
    cp: DeviceMesh | None = None  # ("cp",) the C ranks sharing one sequence; None: C = 1

    @property
    def ep_size(self) -> int:
        return self.experts["ep"].size()


def build_meshes(*, ep_size: int, context: int = 1, device_type: str = "cpu") -> TrainMeshes:
    """Meshes over the default process group (call `dist.init_process_group` first, on every
    rank). device_type "cpu" (gloo) or "cuda" (NCCL; a group with a gloo backend for CPU
    tensors too, "cpu:gloo,cuda:nccl", keeps CPU-side collectives working).

    context C > 1 (context parallelism, policy/k3/context.py): rank r sits at data index r // C
    and context index r % C; FSDP2 and EP act over the W // C ranks of one context index (the
    weights are replicated over the C context ranks, whose gradients the caller sums over
    `cp`), so no FSDP or EP collective ever waits for a rank of another context index."""
    world = dist.get_world_size()
    if context < 1 or world % context:
        raise ValueError(f"context must divide the world size {world}, got {context}")
    data = world // context
    if ep_size < 1 or data % ep_size:
        raise ValueError(f"ep_size must divide the data-parallel size {data}, got {ep_size}")
    if context == 1:
        dp = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        experts = init_device_mesh(
            device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep")
        )
        return TrainMeshes(dp=dp, experts=experts)
    grid = init_device_mesh(device_type, (data, context), mesh_dim_names=("dp", "cp"))
    expert_grid = init_device_mesh(
        device_type, (data // ep_size, ep_size, context), mesh_dim_names=("edp", "ep", "cp")
    )
    return TrainMeshes(dp=grid["dp"], experts=expert_grid["edp", "ep"], cp=grid["cp"])


def global_sum(value: torch.Tensor | float, group: dist.ProcessGroup | None = None) -> float:
    """Sum of a number over ranks (no gradient), e.g. the global count of loss tokens. Under
    NCCL pass a tensor on the GPU (a Python number is summed on the CPU, fine for gloo)."""
    total = torch.as_tensor(value).detach().to(torch.float64).clone().reshape(1)
    dist.all_reduce(total, group=group)
    return float(total)


# --------------------------------------------------------------------------- all-to-all


class _AllToAll(torch.autograd.Function):
    """Rows of x split by `input_splits` go to the group's ranks; backward is the reverse."""

    @staticmethod
    def forward(ctx, x_NI, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out_MI = x_NI.new_empty((sum(output_splits), *x_NI.shape[1:]))
        dist.all_to_all_single(out_MI, x_NI.contiguous(), output_splits, input_splits, group)
        return out_MI

    @staticmethod
    def backward(ctx, grad_MI):
        output_splits, input_splits = ctx.splits
        grad_NI = grad_MI.new_empty((sum(input_splits), *grad_MI.shape[1:]))
        dist.all_to_all_single(
            grad_NI, grad_MI.contiguous(), input_splits, output_splits, ctx.group
        )
        return grad_NI, None, None, None


def all_to_all(
    x_NI: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Differentiable `all_to_all_single`: rows x_NI[sum(input_splits[:r]) ...] go to rank r of
    `group`; returns the rows received, output_splits[r] from rank r, in rank order. The gradient
    travels back by the reverse all-to-all."""
    return _AllToAll.apply(x_NI, list(output_splits), list(input_splits), group)


def exchange_counts(send_counts_PX: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send_counts_PX[p, x]: rows this rank sends to local expert x of EP rank p. Returns
    recv_counts_PX[p, x]: rows EP rank p sends to this rank's local expert x."""
    recv_counts_PX = torch.empty_like(send_counts_PX)
    dist.all_to_all_single(recv_counts_PX, send_counts_PX.contiguous(), group=group)
    return recv_counts_PX


# --------------------------------------------------------------------------- expert parallel


def _local_experts(dispatch: str):
    """The single-device expert function that runs this rank's experts on received rows."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if dispatch == "naive":
        return naive_experts
    if dispatch == "dense":
        return dense_experts
    use_grouped_mm = dispatch == "grouped"

    def sorted_experts(*args):
        return _sorted_experts(*args, use_grouped_mm=use_grouped_mm)

    return sorted_experts


def _to_local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ExpertParallelExperts(nn.Module):
    """Drop-in replacement for GroupedExperts holding this rank's X = E/P experts as DTensors
    (Shard(0) on the "ep" mesh) under the same parameter names, so state-dict keys do not change.

        sort the T*K assignments by expert -> exchange counts -> all-to-all rows to the owners
        -> owners run their experts (same single-device code) -> all-to-all back -> unsort
        -> weight by the routing weights on the source rank (router gradients stay local).
    """

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.betas = experts.betas
        self.ep_mesh = ep_mesh
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name).detach()
            setattr(self, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))

    def forward(self, z_TL, indices_TK, weights_TK, dispatch: str = "grouped") -> torch.Tensor:
        """Weighted sum over each token's K experts, [T, L] (same contract as GroupedExperts)."""
        gate_up_XFL, down_XLF = _to_local(self.gate_up_proj), _to_local(self.down_proj)
        group, num_ranks, num_local = self.ep_mesh.get_group(), self.ep_mesh.size(), len(down_XLF)
        num_tokens, top_k = indices_TK.shape
        flat_S = indices_TK.reshape(-1)
        order_S = torch.argsort(flat_S, stable=True)
        send_counts_PX = torch.bincount(flat_S, minlength=num_ranks * num_local)
        send_counts_PX = send_counts_PX.view(num_ranks, num_local)
        recv_counts_PX = exchange_counts(send_counts_PX, group)
        send_splits, recv_splits = send_counts_PX.sum(1).tolist(), recv_counts_PX.sum(1).tolist()
        recv_RL = all_to_all(z_TL[order_S // top_k], recv_splits, send_splits, group)
        expert_R = torch.repeat_interleave(
            torch.arange(num_local, device=flat_S.device).repeat(num_ranks),
            recv_counts_PX.reshape(-1),
        )
        out_RL = _local_experts(dispatch)(
            recv_RL, expert_R[:, None], recv_RL.new_ones(len(recv_RL), 1),
            gate_up_XFL, down_XLF, self.betas,
        )  # fmt: skip
        out_SL = all_to_all(out_RL, send_splits, recv_splits, group)
        out_TKL = out_SL[torch.argsort(order_S)].view(num_tokens, top_k, -1)
        return (out_TKL * weights_TK.to(out_TKL.dtype).unsqueeze(-1)).sum(dim=1)

    def extra_repr(self) -> str:
        return f"ep_size={self.ep_mesh.size()}, local_experts={len(_to_local(self.down_proj))}"


# --------------------------------------------------------------------------- parallelize


def moe_blocks(model: nn.Module) -> list[tuple[str, StableLatentMoE]]:
    """Every StableLatentMoE of the model with its qualified name, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, StableLatentMoE)]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Default FSDP units: the children of every nn.ModuleList named `layers`."""
    found = [
        layer
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
        for layer in module
    ]
    if not found:
        raise ValueError("no nn.ModuleList named 'layers' in the model; pass layers=...")
    return found


def _apply_expert_parallel(model: nn.Module, meshes: TrainMeshes, **fsdp_kwargs) -> None:
    ep_size = meshes.ep_size
    for name, moe in moe_blocks(model):
        num_experts = moe.experts.down_proj.shape[0]
        if num_experts % ep_size:
            raise ValueError(f"{name}: {num_experts} experts do not split over ep_size {ep_size}")
        moe.experts = ExpertParallelExperts(moe.experts, meshes.experts["ep"])
        fully_shard(moe.experts, mesh=meshes.experts["edp"], **fsdp_kwargs)


def parallelize(
    model: nn.Module,
    meshes: TrainMeshes,
    *,
    layers: Iterable[nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place for training (and return it): EP for every StableLatentMoE when
    meshes.ep_size > 1, then FSDP2 per decoder layer (`layers`, default `decoder_layers(model)`)
    and on the root, every group reducing gradients by plain sum (see the module docstring).

    Afterwards parameters are DTensors: build the optimizer on `model.parameters()` after this
    call; read weights with `full_state_dict`. Forward/backward are called as usual, on every
    rank, with this rank's share of the batch. Clip gradients with `clip_grad_norm_` below."""
    kwargs = dict(mp_policy=mp_policy or MixedPrecisionPolicy())
    if meshes.ep_size > 1:
        _apply_expert_parallel(model, meshes, reshard_after_forward=reshard_after_forward, **kwargs)
    for layer in decoder_layers(model) if layers is None else layers:
        fully_shard(layer, mesh=meshes.dp, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=meshes.dp, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
    agree: dist.ProcessGroup | None = None,
) -> torch.Tensor:  # fmt: skip
    """torch.nn.utils.clip_grad_norm_ for a parallelized model, whose gradients live on two
    meshes (the plain one fails there): each mesh's gradient norm is reduced over its mesh, the
    norms are combined, every gradient is scaled by min(1, max_norm / total). Returns the total
    norm (the same on every rank). Collective. `agree`: ranks holding copies of the same
    gradients (context ranks) take the largest of their totals, so that their copies of the
    weights stay equal even where their reductions ran in another order."""
    params_by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            params_by_mesh.setdefault(mesh, []).append(param)
    norms = []
    for params in params_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    if agree is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=agree)
    for params in params_by_mesh.values():  # one foreach per mesh: meshes cannot mix
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# --------------------------------------------------------------------------- export


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every state-dict entry, one tensor at a time (bounded memory for
    bucketed weight pushes). Names equal the unsharded model's state_dict keys. Collective:
    every rank must run the whole iteration; every rank receives the full tensors."""
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            yield name, value.full_tensor().detach()
        else:
            yield name, value.detach().clone()


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict (same keys, shapes and values as the single-device model).
    Collective; with rank0_only the other ranks take part but return {}."""
    keep = not rank0_only or dist.get_rank() == 0
    out = {}
    for name, tensor in iter_full_tensors(model):
        if keep:
            out[name] = tensor
    return out


# --------------------------------------------------------------------------- QB and load metrics


TokenMask = torch.Tensor | list[tuple[torch.Tensor, torch.Tensor | None]]
"""RouterStats.record's token mask: one mask, or one (mask, rows) per router call."""


class RouterStats:
    """Per-layer routing statistics of one training step over all data-parallel ranks: Quantile
    Balancing candidates (averaged over every micro-batch of every rank, Megatron's
    global-batch convention) and expert loads.

        stats = RouterStats(model)                          # after parallelize
        for micro_batch in this_rank_share:
            with stats.record(token_mask=mask):             # hooks on every router
                loss_fn(model(micro_batch)).backward()
        metrics = stats.load_metrics()     # {"layers.1.mlp/max_over_mean": ..., ...}
        stats.update_biases()              # new e_score_correction_bias, same on every rank
        stats.reset()

    `load_metrics` and `update_biases` are collectives (every rank, same order). A rank without
    recorded micro-batches still takes part. Recording under activation recomputation would count
    a micro-batch twice; record only the forward that should count.
    """

    def __init__(
        self, model: nn.Module, *, group: dist.ProcessGroup | None = None, ema: float = 0.0
    ) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.group, self.ema = group, ema
        self.routers = {name: moe.gate for name, moe in moe_blocks(model)}
        self.reset()

    def reset(self) -> None:
        self._candidate_sums: dict[str, torch.Tensor] = {}
        self._num_batches: dict[str, int] = {}
        self._loads: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def record(self, token_mask: TokenMask | None = None) -> Iterator[None]:
        """Record every router call inside the block; `token_mask` [B, T] (or any shape that
        flattens to the routers' tokens; True = counts) drops padding. A forward that routes
        the T positions in several calls along T (segments of S positions, B*S tokens each:
        policy/k3/segments.py) takes the mask's columns in order, one call after another; a
        call with fewer real tokens than experts / top_k (say a segment of padding) counts for
        the loads but gives no QB candidate. A list: one (mask, rows) per router call of one
        micro-batch, in order (policy/shared_prefix.py: a shared prompt's [U, P] with the row
        index [B] that copies it to every row, then the rows' own [B, S] with None); the calls'
        tokens are gathered and counted once, after the last, as one forward over [B, T] would."""
        mask_BT = None
        if isinstance(token_mask, list):
            mask_BT = [(mask.bool(), rows) for mask, rows in token_mask]
        elif token_mask is not None:
            rows = token_mask.shape[0] if token_mask.dim() > 1 else 1
            mask_BT = token_mask.bool().reshape(rows, -1)
        cursors = {name: 0 for name in self.routers}  # mask columns (or calls) consumed
        parts: dict[str, list] = {name: [] for name in self.routers}  # a list's earlier calls
        handles = [
            router.register_forward_hook(
                functools.partial(self._observe, name, mask_BT, cursors, parts)
            )
            for name, router in self.routers.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def _observe(self, name, mask_BT, cursors, parts, router, args, routing) -> None:
        if getattr(router, "routes_subset", False):  # some positions of each sequence only (the
            return  # last layer at the loss positions): not a sample of them, nor their columns
        scores_TE, indices_TK = routing.scores_TE, routing.indices_TK
        if isinstance(mask_BT, list):  # one (mask, rows) per call, counted after the last
            mask, rows = mask_BT[cursors[name]]
            cursors[name] += 1
            if rows is not None:  # a shared prefix: every row's copy of it
                scores_TE = scores_TE.unflatten(0, (mask.shape[0], -1))[rows].flatten(0, 1)
                indices_TK = indices_TK.unflatten(0, (mask.shape[0], -1))[rows].flatten(0, 1)
                mask = mask[rows]
            keep_T = mask.reshape(-1).to(scores_TE.device)
            parts[name].append((scores_TE[keep_T], indices_TK[keep_T]))
            if cursors[name] % len(mask_BT):
                return  # the micro-batch's tokens are counted together after its last call
            scores_TE = torch.cat([scores for scores, _ in parts[name]])
            indices_TK = torch.cat([indices for _, indices in parts[name]])
            parts[name].clear()
        elif mask_BT is not None:
            start, width = cursors[name], scores_TE.shape[0] // mask_BT.shape[0]
            cursors[name] = start + width
            mask_T = mask_BT[:, start : start + width].reshape(-1).to(scores_TE.device)
            scores_TE, indices_TK = scores_TE[mask_T], indices_TK[mask_T]
        load_N = expert_load(indices_TK, router.num_experts)
        self._loads[name] = load_N + self._loads[name] if name in self._loads else load_N
        if scores_TE.shape[0] * router.top_k < router.num_experts:
            return  # too few tokens to admit one per expert (a segment of padding): no candidate
        bias_N = router.e_score_correction_bias
        candidate_N = quantile_balancing_candidate(scores_TE, bias_N, router.top_k).double()
        if name in self._num_batches:
            candidate_N = candidate_N + self._candidate_sums[name]
        self._candidate_sums[name] = candidate_N
        self._num_batches[name] = self._num_batches.get(name, 0) + 1

    @torch.no_grad()
    def update_biases(self) -> dict[str, torch.Tensor]:
        """Write the next QB bias into every router (skipping layers no rank recorded); returns
        the new biases by layer name."""
        updated = {}
        for name, router in self.routers.items():
            bias_N = router.e_score_correction_bias
            total_N1 = torch.zeros(router.num_experts + 1, dtype=torch.float64)
            if name in self._num_batches:
                total_N1[:-1] = self._candidate_sums[name].cpu()
                total_N1[-1] = self._num_batches[name]
            total_N1 = total_N1.to(bias_N.device)
            dist.all_reduce(total_N1, group=self.group)
            if total_N1[-1] > 0:
                bias_N.copy_(next_bias(total_N1[:-1] / total_N1[-1], bias_N, self.ema))
                updated[name] = bias_N.detach().clone()
        return updated

    def load_metrics(self) -> dict[str, float]:
        """Global expert load per layer: max/mean, min/mean, CV and dead experts."""
        metrics = {}
        for name, router in self.routers.items():
            device = router.e_score_correction_bias.device
            load_N = self._loads.get(name, torch.zeros(router.num_experts, dtype=torch.long))
            load_N = load_N.to(device).clone()
            dist.all_reduce(load_N, group=self.group)
            if load_N.sum() > 0:  # a layer no rank recorded (routes_subset) has no figures
                metrics |= {f"{name}/{key}": v for key, v in load_summary(load_N).items()}
        return metrics
