"""Sharded MoE training (policy/parallel.py) against the unsharded model, on 2 gloo ranks (CPU).

One spawned 2-rank run (a module-scoped fixture: starting ranks costs seconds) asserted by
several tests, plus one run of K3ForCausalLM:
- training: 3 AdamW steps with gradient clipping, FSDP2 + 2-way expert parallel (and FSDP2
  alone, ep_size=1), each rank on half of the global batch (unequal loss-token counts), against
  one process on the whole batch: losses, gradient norms, updated weights; full_state_dict
  against the unsharded state dict; global QB biases and load metrics after training;
- primitives: the all-to-all's forward placement and adjoint (its backward), the
  expert-parallel experts against GroupedExperts in float64 (outputs and every gradient), and
  the global QB update against the average of the per-rank candidates;
- K3ForCausalLM "k3-debug" (KDA/MLA, AttnRes, dense layer 0, 3 MoE layers): 2 steps with 2-way
  EP against one process.
The tiny model is built here from our layers so these tests do not depend on modeling.py.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from policy.k3.balance import QuantileAccumulator, load_metrics
from policy.k3.moe import GroupedExperts, StableLatentMoE
from policy.k3.situ import SituGLU
from policy.parallel import (
    ExpertParallelExperts,
    RouterStats,
    all_to_all,
    build_meshes,
    clip_grad_norm_,
    full_state_dict,
    global_sum,
    moe_blocks,
    parallelize,
)
from rl.run.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD, TIMEOUT_S = 2, 90.0
VOCAB, D, L, FF, E, K, LAYERS = 32, 16, 8, 8, 4, 2, 2
BATCH, SEQ, STEPS, LR, MAX_NORM = 8, 7, 3, 1e-2, 0.5


# --------------------------------------------------------------------------- tiny model


class Block(nn.Module):
    """RMSNorm -> StableLatentMoE residual, RMSNorm -> SituGLU residual."""

    def __init__(self) -> None:
        super().__init__()
        self.moe_norm, self.mlp_norm = nn.RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)
        config = StableLatentMoE.Config(
            hidden_size=D, moe_intermediate_size=FF, num_experts=E, top_k=K, latent_size=L,
            num_shared_experts=1, routed_scaling_factor=2.5, init_std=0.3,
        )  # fmt: skip
        self.moe = StableLatentMoE(config)
        self.mlp = SituGLU(D, 2 * FF)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.moe(self.moe_norm(x_BSD))
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class TinyMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(D, eps=1e-5)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = self.embed(ids_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD)
        return self.head(self.norm(x_BSD))


def build_model() -> TinyMoELM:
    torch.manual_seed(0)
    model = TinyMoELM()
    for layer in model.layers:  # a non-zero routing bias, so selection depends on it
        layer.moe.gate.e_score_correction_bias.normal_(std=0.05)
    return model


def make_batch(step: int):
    """Token ids [B, S], next-token targets and a loss mask with unequal counts per half."""
    gen = torch.Generator().manual_seed(100 + step)
    ids_BS = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask_BS = torch.rand(BATCH, SEQ, generator=gen) < torch.linspace(0.3, 1.0, BATCH)[:, None]
    return ids_BS[:, :-1], ids_BS[:, 1:], mask_BS


def rank_rows(rank: int, world: int) -> slice:
    share = BATCH // world
    return slice(rank * share, (rank + 1) * share)


def token_loss_sum(model, ids_BS, targets_BS, mask_BS) -> torch.Tensor:
    logits_BSV = model(ids_BS)
    ce_BS = F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten(), reduction="none")
    return (ce_BS * mask_BS.flatten()).sum()


def train(model, rank: int, world: int, count_fn, clip_fn) -> tuple[list[float], list[float]]:
    """STEPS AdamW steps with gradient clipping; each rank's loss is its token sum / the global
    token count. Returns the global losses and gradient norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    losses, norms = [], []
    for step in range(STEPS):
        ids_BS, targets_BS, mask_BS = (t[rank_rows(rank, world)] for t in make_batch(step))
        loss = token_loss_sum(model, ids_BS, targets_BS, mask_BS) / count_fn(mask_BS.sum())
        loss.backward()
        norms.append(float(clip_fn(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(count_fn(loss.detach()))
    return losses, norms


# --------------------------------------------------------------------------- spawning


def _entry(rank, world, port, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # A clean rank leaves without interpreter teardown: C++ static destructors of gloo and
    # the DTensor machinery occasionally abort ("terminate called without an active
    # exception") after all work is done and saved, failing a passing run (seen in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, *args, world: int = WORLD, timeout: float = TIMEOUT_S) -> None:
    """fn(rank, world, *args) on `world` spawned gloo ranks; a hang fails after `timeout`."""
    ctx = mp.start_processes(
        _entry, args=(world, free_port(), fn, args), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


# --------------------------------------------------------------------------- training run


def _train_run(rank, world, ep_size) -> dict:
    """Training, export and router statistics on this rank, for the parent to compare."""
    model = parallelize(build_model(), build_meshes(ep_size=ep_size))
    exported_before = full_state_dict(model, rank0_only=True)
    local_experts = model.layers[0].moe.experts.gate_up_proj.to_local().shape[0]
    losses, norms = train(model, rank, world, global_sum, clip_grad_norm_)
    stats = RouterStats(model)
    for step in range(2):  # two micro-batches per rank
        ids_BS, _, mask_BS = (t[rank_rows(rank, world)] for t in make_batch(10 + step))
        with torch.no_grad(), stats.record(token_mask=mask_BS):
            model(ids_BS)
    return dict(
        losses=losses,
        grad_norms=norms,
        local_experts=local_experts,
        exported_before=exported_before,
        exported_after=full_state_dict(model),
        load_metrics=stats.load_metrics(),
        biases=stats.update_biases(),
    )


def _reference_router_stats(model) -> tuple[dict, dict]:
    """Single process: the ranks' micro-batches (2 steps x 2 halves) routed one by one."""
    names = [name for name, _ in moe_blocks(model)]
    routings, masks = {name: [] for name in names}, []
    hooks = [
        model.get_submodule(name).gate.register_forward_hook(
            lambda module, args, out, name=name: routings[name].append(out)
        )
        for name in names
    ]
    for step in range(2):
        ids_BS, _, mask_BS = make_batch(10 + step)
        for rank in range(WORLD):
            model(ids_BS[rank_rows(rank, WORLD)])
            masks.append(mask_BS[rank_rows(rank, WORLD)].reshape(-1))
    for hook in hooks:
        hook.remove()
    biases, metrics = {}, {}
    for name in names:
        bias_N, acc = model.get_submodule(name).gate.e_score_correction_bias, QuantileAccumulator(E)
        for routing, keep_T in zip(routings[name], masks, strict=True):
            acc.add(routing.scores_TE[keep_T], bias_N, K)
        biases[name] = acc.update(bias_N)
        kept = [r.indices_TK[keep_T] for r, keep_T in zip(routings[name], masks, strict=True)]
        metrics |= {f"{name}/{k}": v for k, v in load_metrics(torch.cat(kept), E).items()}
    return biases, metrics


@pytest.fixture(scope="module")
def reference():
    model = build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses, norms = train(model, 0, 1, count_fn=float, clip_fn=nn.utils.clip_grad_norm_)
    assert norms[0] > MAX_NORM  # clipping is active
    with torch.no_grad():
        biases, metrics = _reference_router_stats(model)
    return dict(before=before, after=model.state_dict(), losses=losses, norms=norms, biases=biases,
                load_metrics=metrics)  # fmt: skip


def _ranks_worker(rank, world, out_dir) -> None:
    """Everything the 2-rank tests compare, in one spawn (starting ranks costs seconds)."""
    result = dict(
        ep2=_train_run(rank, world, ep_size=2),
        ep1=_train_run(rank, world, ep_size=1),
        a2a=_all_to_all_checks(rank, world),
        experts=_ep_experts_checks(rank, world),
    )
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ranks")
    started = time.monotonic()
    run_ranks(_ranks_worker, str(out_dir))
    print(f"2-rank run: {time.monotonic() - started:.1f} s")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ep2_run(ranks):
    return [res["ep2"] for res in ranks]


@pytest.fixture(scope="module")
def ep1_run(ranks):
    return [res["ep1"] for res in ranks]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _assert_training_parity(results, reference) -> None:
    for res in results:
        assert res["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=1e-6)
        assert res["grad_norms"] == pytest.approx(reference["norms"], rel=1e-5)
        exported = res["exported_after"]
        assert list(exported) == list(reference["after"])
        diff = _max_diff(exported, reference["after"])
        loss_diff = max(abs(a - b) for a, b in zip(res["losses"], reference["losses"], strict=True))
        print(f"max |loss difference| {loss_diff:.2e}, |weight difference| {diff:.2e}")
        assert diff < 2e-5


def test_fsdp_and_expert_parallel_match_one_process(ep2_run, reference):
    assert [r["local_experts"] for r in ep2_run] == [E // 2, E // 2]
    _assert_training_parity(ep2_run, reference)


def test_fsdp_alone_matches_one_process(ep1_run, reference):
    _assert_training_parity(ep1_run, reference)


def test_full_state_dict_equals_unsharded_state_dict(ep2_run, reference):
    exported = ep2_run[0]["exported_before"]
    assert list(exported) == list(reference["before"])
    for name, tensor in reference["before"].items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name
    assert ep2_run[1]["exported_before"] == {}  # rank0_only


def test_global_qb_bias_is_identical_on_ranks_and_matches_megatron_average(ep2_run, reference):
    for name, ref_N in reference["biases"].items():
        for res in ep2_run:
            torch.testing.assert_close(res["biases"][name], ref_N, atol=1e-5, rtol=0)
        assert torch.equal(ep2_run[0]["biases"][name], ep2_run[1]["biases"][name])
        assert abs(float(ep2_run[0]["biases"][name].mean())) < 1e-6


def test_global_load_metrics_match_pooled_routing(ep2_run, reference):
    for res in ep2_run:
        assert res["load_metrics"] == pytest.approx(reference["load_metrics"], abs=1e-9)


# --------------------------------------------------------------------------- primitives


def _all_to_all_checks(rank, world) -> dict:
    """Placement (rows tagged by source) and the adjoint identity <A x, c> == <x, A^T c>."""
    send_splits = [[0, 3], [2, 1]][rank]  # an empty split included
    recv_splits = [[0, 2], [3, 1]][rank]
    x_NI = torch.randn(sum(send_splits), 3, dtype=torch.float64, requires_grad=True)
    y_MI = all_to_all(x_NI, recv_splits, send_splits)
    tags = torch.full((sum(send_splits),), float(rank), dtype=torch.float64)
    tags += torch.arange(sum(send_splits)) / 10
    got_tags = all_to_all(tags[:, None], recv_splits, send_splits)[:, 0].tolist()
    c_MI = torch.randn_like(y_MI)
    (y_MI * c_MI).sum().backward()
    lhs, rhs = global_sum((y_MI * c_MI).sum()), global_sum((x_NI * x_NI.grad).sum())
    return dict(tags=got_tags, lhs=lhs, rhs=rhs, grad_norm=float(x_NI.grad.norm()))


def _ep_experts_checks(rank, world) -> dict:
    """ExpertParallelExperts vs GroupedExperts on the pooled tokens, float64, outputs + grads."""
    torch.manual_seed(0)
    experts = GroupedExperts(E, L, FF, init_std=0.3).double()
    z_GL = torch.randn(world * 5, L, dtype=torch.float64)
    idx_GK = torch.stack([torch.randperm(E)[:K] for _ in range(world * 5)])
    idx_GK[:5] = torch.tensor([0, 1])  # rank 0 sends nothing to experts 2, 3
    w_GK = torch.rand(world * 5, K, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (z_GL, w_GK)]
    out_ref = experts(ref[0], idx_GK, ref[1], dispatch="segment")
    cot_GL = torch.randn_like(out_ref)
    (out_ref * cot_GL).sum().backward()
    mine = slice(rank * 5, rank * 5 + 5)
    mesh = build_meshes(ep_size=world).experts["ep"]
    ep = ExpertParallelExperts(experts, mesh)
    z, w = z_GL[mine].clone().requires_grad_(), w_GK[mine].clone().requires_grad_()
    out = ep(z, idx_GK[mine], w, dispatch="segment")
    (out * cot_GL[mine]).sum().backward()
    owned = slice(rank * E // world, (rank + 1) * E // world)
    out, out_ref = out.detach(), out_ref.detach()
    return dict(
        out=float((out - out_ref[mine]).abs().max()),
        z_grad=float((z.grad - ref[0].grad[mine]).abs().max()),
        w_grad=float((w.grad - ref[1].grad[mine]).abs().max()),
        gate_up_grad=float(
            (ep.gate_up_proj.grad.to_local() - experts.gate_up_proj.grad[owned]).abs().max()
        ),
        down_grad=float((ep.down_proj.grad.to_local() - experts.down_proj.grad[owned]).abs().max()),
    )


def test_all_to_all_places_rows_and_backward_is_its_adjoint(ranks):
    assert ranks[0]["a2a"]["tags"] == pytest.approx([1.0, 1.1])
    assert ranks[1]["a2a"]["tags"] == pytest.approx([0.0, 0.1, 0.2, 1.2])
    for res in ranks:
        assert res["a2a"]["grad_norm"] > 0
        assert res["a2a"]["lhs"] == pytest.approx(res["a2a"]["rhs"], rel=1e-12)


def test_expert_parallel_experts_match_grouped_experts_float64(ranks):
    for res in ranks:
        for key, diff in res["experts"].items():
            assert diff < 1e-12, key


# --------------------------------------------------------------------------- K3ForCausalLM


def _k3_model():
    from policy.k3.configuration import k3_preset
    from policy.k3.modeling import K3ForCausalLM

    torch.manual_seed(0)
    # float64: AdamW's first steps divide each gradient by its own magnitude, so float32
    # reduction-order noise (2 ranks vs 1 process) on near-zero gradients moves weights ~1e-5
    return K3ForCausalLM(k3_preset("k3-debug")).double()


def _k3_train(model, rank: int, world: int, count_fn, stats=None) -> list[float]:
    """2 AdamW steps of next-token loss on 4 x 16 random ids (each rank: its rows)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        ids_BS = torch.randint(512, (4, 16), generator=torch.Generator().manual_seed(step))
        ids_BS = ids_BS[rank * 4 // world : (rank + 1) * 4 // world]
        with stats.record() if stats else torch.enable_grad():
            logits_BSV = model(ids_BS).logits[:, :-1]
        ce = F.cross_entropy(logits_BSV.flatten(0, 1), ids_BS[:, 1:].flatten(), reduction="sum")
        loss = ce / count_fn(ids_BS[:, 1:].numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(count_fn(loss.detach()))
    return losses


def _k3_worker(rank, world, out_dir) -> None:
    model = parallelize(_k3_model(), build_meshes(ep_size=world))
    stats = RouterStats(model)
    losses = _k3_train(model, rank, world, global_sum, stats)
    exported = full_state_dict(model)  # before the QB update changes the router biases
    result = dict(losses=losses, exported=exported, biases=stats.update_biases())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_k3_for_causal_lm_debug_expert_parallel_matches_one_process(tmp_path):
    run_ranks(_k3_worker, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    model = _k3_model()
    losses = _k3_train(model, 0, 1, float)
    reference = model.state_dict()
    for res in results:
        assert res["losses"] == pytest.approx(losses, rel=1e-6)
        assert list(res["exported"]) == list(reference)
        assert _max_diff(res["exported"], reference) < 1e-5
        assert len(res["biases"]) == sum(t == "sparse" for t in model.config.mlp_types)
    for name, bias_N in results[0]["biases"].items():
        assert torch.equal(bias_N, results[1]["biases"][name])
