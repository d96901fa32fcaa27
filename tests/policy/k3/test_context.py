"""Context parallelism (policy/k3/context.py): one sequence split over 2 and 3 spawned gloo ranks
equals one process over the whole sequence, in float64 k3-debug (KDA + MLA, AttnRes, MoE): every
rank's hidden states, and the parameter gradients summed over the ranks (a loss on every
position, left padding in one row, checkpointed segments inside each shard so that the relayed
carry holds several latent chunks); and the learner's trunk (TokenLogprobs with a context
group) against one process, also where a rank has no loss position or predicts nothing."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from policy.k3.context import context_hidden
from policy.k3.relay import Relay
from policy.logprobs import TokenLogprobs
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
    hidden = hidden_BSD.detach()
    del hidden_BSD, anchor
    gc.collect()  # nothing of the step outlives it (a cycle through autograd nodes would)
    assert not [x for x in gc.get_objects() if isinstance(x, Relay)], "the relay leaked"
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    torch.save({"hidden": hidden, "grads": grads}, f"{out_dir}/rank{rank}.pt")


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


def _attend_together_rank(rank, world, out_dir) -> None:
    """Each rank's MLA attention waits (30 s at most) until the other rank's has begun."""
    model = make_model(F64)
    mla = next(layer.self_attn for layer in model.get_decoder().layers if not layer.is_kda)
    attend = mla.attend

    def attend_when_both(*args, **kwargs):
        Path(out_dir, f"attending{rank}").touch()
        deadline = time.monotonic() + 30
        while not Path(out_dir, f"attending{1 - rank}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} attends alone: the other rank has not begun")
            time.sleep(0.01)
        return attend(*args, **kwargs)

    mla.attend = attend_when_both
    ids_BT, mask_BT, weight_BTD = inputs()
    lo, hi = (0, 20, LENGTH)[rank : rank + 2]
    hidden_BSD, anchor = context_hidden(
        model.get_decoder(), ids_BT[:, lo:hi], mask_BT[:, lo:hi], group=dist.group.WORLD,
        segment=SEGMENT,
    )  # fmt: skip
    (loss_of(hidden_BSD, weight_BTD[:, lo:hi], mask_BT[:, lo:hi]) + anchor).backward()


def test_context_ranks_attend_at_the_same_time(tmp_path):
    """The ranks' MLA attention (the part that grows with position) runs at the same time: each
    rank sends its own latents before it attends, so a rank whose attention waits for the
    other's to begin still finishes. A relay that sends the carry after the whole shard
    (rank 0 attending before rank 1 can start) fails here with the TimeoutError."""
    run_ranks(_attend_together_rank, str(tmp_path), world=2, timeout=120)
    assert {p.name for p in tmp_path.iterdir()} == {"attending0", "attending1"}


def _no_grad_sends_rank(rank, world, out_dir) -> None:
    """Rank 0 sends 5 messages without gradients and counts those still held after each;
    rank 1 receives them in order, pausing before each (so rank 0 runs ahead)."""
    relay = Relay(dist.group.WORLD, torch.device("cpu"))
    with torch.no_grad():
        if rank == 0:
            held = []
            for step in range(5):
                relay.send((torch.full((3, 4), float(step)),))
                held.append(len(relay._messages))
            relay.finish(torch.zeros(1, 1, 1))
            Path(out_dir, "held.txt").write_text(" ".join(map(str, held)))
        else:
            for step in range(5):
                time.sleep(0.2)
                (got,) = relay.receive()
                assert bool((got == step).all())


def test_no_grad_sends_hold_two_messages(tmp_path):
    """A no-grad forward (the learner's proximal logprobs) waits for the messages before the
    previous one at each send, so it holds two messages' tensors at most, not every layer's
    latents until its end (gloo's send work never reports itself completed without a wait)."""
    run_ranks(_no_grad_sends_rank, str(tmp_path), world=2, timeout=120)
    assert (tmp_path / "held.txt").read_text() == "1 2 2 2 2"


# --------------------------------------------------------------------------- the learner's trunk


def trunk_inputs(length: int):
    """ids [2, length], a mask, loss positions only in the sequence's second half (so the first
    context rank often has none), weights for the loss."""
    gen = torch.Generator().manual_seed(2)
    ids_BT = torch.randint(1, 512, (BATCH, length), generator=gen)
    mask_BT = torch.ones(BATCH, length, dtype=torch.long)
    select_BT = torch.zeros(BATCH, length - 1, dtype=torch.bool)
    select_BT[:, (length - 1) // 2 :] = True
    weight_BT = torch.randn(BATCH, length - 1, generator=gen, dtype=F64)
    return ids_BT, mask_BT, select_BT, weight_BT


def trunk_loss(trunk, length: int):
    ids_BT, mask_BT, select_BT, weight_BT = trunk_inputs(length)
    logp_BT, entropy_BT, _, _ = trunk(ids_BT, mask_BT, 1.0, select_BT)
    (logp_BT * weight_BT + 0.1 * entropy_BT).sum().backward()
    return logp_BT.detach(), entropy_BT.detach()


def _trunk_rank(rank, world, length, out_dir) -> None:
    model = make_model(F64)
    trunk = TokenLogprobs(model, segment_tokens=4, context=dist.group.WORLD)
    logp_BT, entropy_BT = trunk_loss(trunk, length)
    grads = {name: p.grad for name, p in model.named_parameters()}
    missing = sorted(name for name, grad in grads.items() if grad is None)
    grads = {name: grad for name, grad in grads.items() if grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    out = {"logp": logp_BT, "entropy": entropy_BT, "grads": grads, "missing": missing}
    torch.save(out, f"{out_dir}/trunk{rank}.pt")


@pytest.mark.parametrize("length", [13, 5, 3], ids=["segments", "last-rank-one-token", "short"])
def test_context_trunk_equals_one_process(length, tmp_path):
    """TokenLogprobs with a context group (the learner's trunk): every rank returns the whole
    sequence's logprobs and entropy, and the summed gradients equal one process's, also when a
    rank has no loss position (the LM head runs on a stand-in there, so every parameter has a
    gradient on every rank, as the learner's gradient sum over the context ranks needs: 13
    tokens in segments of 4 give [0, 8, 13], 5 give [0, 4, 5] (the last rank predicts
    nothing), 3 are split by tokens, [0, 2, 3])."""
    run_ranks(_trunk_rank, length, str(tmp_path), world=2)
    model = make_model(F64)
    want_logp, want_entropy = trunk_loss(TokenLogprobs(model, segment_tokens=4), length)
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    unused = sorted(name for name, p in model.named_parameters() if p.grad is None)
    for rank in range(2):
        out = torch.load(tmp_path / f"trunk{rank}.pt")
        assert out["missing"] == unused, out["missing"]  # (layer 0's AttnRes has one source)
        torch.testing.assert_close(out["logp"], want_logp, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(out["entropy"], want_entropy, atol=1e-10, rtol=1e-10)
        for name, grad in want.items():
            torch.testing.assert_close(out["grads"][name], grad, atol=1e-10, rtol=1e-8, msg=name)
