"""The LM head inside each segment's checkpoint (`TokenLogprobs(keep_hidden=False)`,
`policy.logprobs.segmented_logprobs`; issue 19 item 4): the same logprobs, entropy and
gradients as one unsegmented forward (float64), and no position's hidden state or its gradient
kept past its segment."""

from __future__ import annotations

import pytest
import torch

from policy.k3.footprint import PeakBytes
from policy.logprobs import TokenLogprobs
from tests.policy.k3.test_engine import make_model
from tests.policy.k3.test_segments import LAYERS, batch, random_replay, two_mla_model

F64 = torch.float64


def loss_and_grads(
    model, ids_BT, mask_BT, select_BT, segment: int, keep: bool, replay=None, only=False
):
    """(logp [B, T-1], entropy [B, T-1], routed, every parameter's gradient of a fixed
    weighting of both); `only`: TokenLogprobs' selected_only."""
    model.zero_grad(set_to_none=True)
    trunk = TokenLogprobs(model, segment_tokens=segment, selected_only=only)
    logp_BT, entropy_BT, hidden, routed = trunk(
        ids_BT, mask_BT, 0.7, select_BT, replay_experts=replay, return_routing=True,
        keep_hidden=keep,
    )  # fmt: skip
    assert (hidden is None) == (not keep and segment > 0)
    gen = torch.Generator().manual_seed(3)
    w1_BT, w2_BT = torch.randn(2, *logp_BT.shape, generator=gen, dtype=F64)
    (logp_BT * w1_BT + entropy_BT * w2_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp_BT.detach(), entropy_BT.detach(), routed, grads


@pytest.mark.parametrize("segment", [32, 64, 100, 299])
@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("where", ["scattered", "tail"])
def test_head_inside_segments_equals_one_forward(segment, replay, where):
    """300 tokens (row 1 left-padded by 37: segments of 32 end inside the padding), the loss
    on a scattered selection or on the last 16 positions (segments with nothing selected):
    segments of 32, 64, 100 and 299 (its last segment is the one position that predicts
    nothing) against one forward. A float64 model: routes equal, gradients to 1e-10, and the
    logprobs and entropy (float32, as the LM head returns them) equal to 1e-10."""
    model = two_mla_model()
    ids_BT, mask_BT = batch()
    if where == "scattered":
        select_BT = (torch.arange(299) % 7 == 3).expand(2, -1) & mask_BT[:, 1:].bool()
    else:
        select_BT = torch.zeros(2, 299, dtype=torch.bool)
        select_BT[:, -16:] = True
    experts = random_replay(model, ids_BT) if replay else None
    want = loss_and_grads(model, ids_BT, mask_BT, select_BT, 0, True, experts)
    got = loss_and_grads(model, ids_BT, mask_BT, select_BT, segment, False, experts)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-10)
    valid_X = mask_BT.bool().reshape(-1)
    assert torch.equal(got[2][:, valid_X], want[2][:, valid_X])
    assert got[3].keys() == want[3].keys() and len(want[3]) > 50
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-10, atol=1e-10, msg=name)


def test_the_head_recomputed_in_chunks_inside_a_segment(monkeypatch):
    """A large selection (rows x vocabulary past HEAD_RECOMPUTE_ELEMENTS) recomputes the LM head
    chunk by chunk: that checkpoint nested in each segment's gives the same gradients."""
    import policy.logprobs

    model = two_mla_model()
    ids_BT, mask_BT = batch()
    select_BT = mask_BT[:, 1:].bool()
    want = loss_and_grads(model, ids_BT, mask_BT, select_BT, 0, True)
    monkeypatch.setattr(policy.logprobs, "HEAD_RECOMPUTE_ELEMENTS", 1)
    got = loss_and_grads(model, ids_BT, mask_BT, select_BT, 64, False)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-10, atol=1e-10, msg=name)


def peak_bytes(model, ids_BT, select_BT, keep: bool) -> int:
    trunk = TokenLogprobs(model, segment_tokens=256)
    with PeakBytes() as meter:
        logp_BT, _, hidden, _ = trunk(ids_BT, torch.ones_like(ids_BT), 1.0, select_BT,
                                      keep_hidden=keep)  # fmt: skip
        logp_BT.sum().backward()
        del hidden
    model.zero_grad(set_to_none=True)
    return meter.peak


def test_the_hidden_states_do_not_outlive_their_segment():
    """2,048 tokens in segments of 256, the loss on the last 16 positions (an agent's own
    tokens): the head inside the segments peaks lower than the head after them by most of
    the hidden states [1, T, D] and their gradient (float32), which only the latter keeps
    (1.5 of the 2 copies: what the last segment's head holds meanwhile is not counted)."""
    model = make_model(torch.float32)
    length, hidden = 2048, model.config.hidden_size
    ids_BT = torch.randint(1, 512, (1, length), generator=torch.Generator().manual_seed(0))
    select_BT = torch.zeros(1, length - 1, dtype=torch.bool)
    select_BT[:, -16:] = True
    after = peak_bytes(model, ids_BT, select_BT, True)
    inside = peak_bytes(model, ids_BT, select_BT, False)
    assert after - inside >= 1.5 * length * hidden * 4, (after, inside)


def selected_runs(length: int) -> torch.Tensor:
    """[2, T-1]: three assistant-like runs in row 0, one in row 1 (a union of four runs)."""
    select_BT = torch.zeros(2, length - 1, dtype=torch.bool)
    for a, b in ((5, 9), (120, 131), (250, 262)):
        select_BT[0, a:b] = True
    select_BT[1, 60:70] = True
    return select_BT


def selected_only(model, ids_BT, select_BT, segment: int, only: bool, replay=None):
    mask_BT = torch.ones_like(ids_BT)
    return loss_and_grads(model, ids_BT, mask_BT, select_BT, segment, False, replay, only)


@pytest.mark.parametrize("segment", [64, 100])
@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("case", ["runs", "tail", "attn-res-closes"])
def test_the_last_layer_at_the_selected_positions_only_changes_nothing(segment, replay, case):
    """The last (MLA) layer at the selected positions alone: logprobs, entropy and every
    gradient equal the whole forward's (float64, 1e-10); its routes equal at those positions
    and are -1 elsewhere, the other layers' everywhere. Cases: four runs of positions; the
    last 16 only (segments with no position); AttnRes blocks of 3, so that the last layer
    (index 3) closes a block."""
    model = two_mla_model()
    if case == "attn-res-closes":
        la = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, **LAYERS}
        model = make_model(F64, linear_attn_config=la, attn_res_block_size=3)
    ids_BT, _ = batch(pad=0)
    select_BT = selected_runs(ids_BT.shape[1])
    if case == "tail":
        select_BT = torch.zeros_like(select_BT)
        select_BT[:, -16:] = True
    experts = random_replay(model, ids_BT) if replay else None
    want = selected_only(model, ids_BT, select_BT, segment, False, experts)
    got = selected_only(model, ids_BT, select_BT, segment, True, experts)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-10)
    assert got[3].keys() == want[3].keys() and len(want[3]) > 50
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-10, atol=1e-10, msg=name)
    routed_MBTK, whole_MBTK = (r.unflatten(1, ids_BT.shape) for r in (got[2], want[2]))
    assert torch.equal(routed_MBTK[:-1], whole_MBTK[:-1])
    wanted_T = torch.nn.functional.pad(select_BT.any(0), (0, 1))
    assert torch.equal(routed_MBTK[-1][:, wanted_T], whole_MBTK[-1][:, wanted_T])
    assert bool((routed_MBTK[-1][:, ~wanted_T] == -1).all())


def test_the_last_layer_attends_from_the_selected_positions_only():
    """The work moves: the last layer's attention takes the union of the selected positions
    (37 of 300) as queries instead of all 300."""
    model = two_mla_model()
    ids_BT, _ = batch(pad=0)
    select_BT = selected_runs(ids_BT.shape[1])
    mla = model.model.layers[-1].self_attn
    counted = []
    attend = mla.attend

    def counting(q_BTHQ, *args, **kwargs):
        counted.append(q_BTHQ.shape[1])
        return attend(q_BTHQ, *args, **kwargs)

    mla.attend = counting
    for only in (False, True):
        counted.clear()
        with torch.no_grad():
            TokenLogprobs(model, segment_tokens=64, selected_only=only)(
                ids_BT, torch.ones_like(ids_BT), 1.0, select_BT, keep_hidden=False
            )
        assert sum(counted) == (int(select_BT.any(0).sum()) if only else 300), (only, counted)


def test_positions_need_an_mla_last_layer():
    la = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
          "kda_layers": [2, 4], "full_attn_layers": [1, 3]}  # fmt: skip
    model = make_model(F64, linear_attn_config=la)
    ids_BT = torch.randint(1, 50, (1, 20))
    with pytest.raises(ValueError, match="MLA last layer"):
        model.get_decoder()(ids_BT, positions=[3, 4])
