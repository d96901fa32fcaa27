"""Context parallelism (policy/k3/context.py): one sequence split over 2 and 3 spawned gloo ranks
equals one process over the whole sequence, in float64 k3-debug (KDA + MLA, AttnRes, MoE): every
rank's hidden states, and the parameter gradients summed over the ranks (a loss on every
position, left padding in one row, checkpointed segments inside each shard so that the relayed
carry holds several latent chunks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from policy.k3.context import context_hidden
from tests.policy.k3.test_engine import make_model
from tests.policy.test_parallel import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

F64 = torch.float64
BATCH, LENGTH, PAD, SEGMENT = 2, 36, 5, 8


def inputs():
    gen = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(1, 512, (BATCH, LENGTH), generator=gen)
    mask_BT = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask_BT[1, :PAD] = 0  # left padding
    weight_BTD = torch.randn(BATCH, LENGTH, 64, generator=gen, dtype=F64)
    return ids_BT, mask_BT, weight_BTD


def loss_of(hidden_BSD, weight_BSD, mask_BS):
    """A loss that reaches every real position's hidden state nonlinearly."""
    return (torch.tanh(hidden_BSD) * weight_BSD * mask_BS[..., None]).sum()


def _rank(rank, world, bounds, out_dir, grad=True) -> None:
    model = make_model(F64)
    ids_BT, mask_BT, weight_BTD = inputs()
    lo, hi = bounds[rank], bounds[rank + 1]
    with torch.set_grad_enabled(grad):
        hidden_BSD, anchor = context_hidden(
            model.get_decoder(), ids_BT[:, lo:hi], mask_BT[:, lo:hi], group=dist.group.WORLD,
            segment=SEGMENT,
        )  # fmt: skip
    if not grad:  # a forward only (the learner's proximal logprobs): no gradient is awaited
        torch.save({"hidden": hidden_BSD}, f"{out_dir}/rank{rank}.pt")
        return
    (loss_of(hidden_BSD, weight_BTD[:, lo:hi], mask_BT[:, lo:hi]) + anchor).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    torch.save({"hidden": hidden_BSD.detach(), "grads": grads}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("bounds", [(0, 20, LENGTH), (0, 3, 19, LENGTH)])
def test_context_ranks_equal_one_process(bounds, tmp_path):
    run_ranks(_rank, bounds, str(tmp_path), world=len(bounds) - 1)
    model = make_model(F64)
    ids_BT, mask_BT, weight_BTD = inputs()
    hidden_BTD = model.get_decoder()(ids_BT, attention_mask=mask_BT).last_hidden_state
    loss_of(hidden_BTD, weight_BTD, mask_BT).backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(bounds) - 1)]
    for out, lo, hi in zip(outs, bounds[:-1], bounds[1:], strict=True):
        real_BS = mask_BT[:, lo:hi].bool()
        torch.testing.assert_close(out["hidden"][real_BS], hidden_BTD[:, lo:hi][real_BS].detach(),
                                   atol=1e-10, rtol=1e-10)  # fmt: skip
    for got in (out["grads"] for out in outs):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-10, rtol=1e-8, msg=name)


def test_context_ranks_forward_only(tmp_path):
    bounds = (0, 20, LENGTH)
    run_ranks(_rank, bounds, str(tmp_path), False, world=2)
    model = make_model(F64)
    ids_BT, mask_BT, _ = inputs()
    with torch.no_grad():
        hidden_BTD = model.get_decoder()(ids_BT, attention_mask=mask_BT).last_hidden_state
    got_BTD = torch.cat([torch.load(tmp_path / f"rank{r}.pt")["hidden"] for r in range(2)], 1)
    real_BT = mask_BT.bool()
    torch.testing.assert_close(got_BTD[real_BT], hidden_BTD[real_BT], atol=1e-10, rtol=1e-10)
