"""The paged MLA latent cache (policy/k3/paged.py): ragged decode attention against a dense
softmax, page allocation and arena release, and K3Session's paged mode against its slot pool
(float64, tiny pages spread over many arenas): the same tokens, logprobs and routes through
adds, subset decodes and drops; cache bytes and the admission reserve to the byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policy.k3 import k3_preset
from policy.k3.engine import K3Policy, K3Session
from policy.k3.paged import PagePool, ragged_decode
from policy.sampling import SamplingParams
from tests.policy.k3.test_engine import make_model

F64 = torch.float64


def dense_decode(q_HL: torch.Tensor, keys_SL: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.softmax(q_HL @ keys_SL.T, -1) @ keys_SL[:, :rank]


def test_ragged_decode_equals_dense_softmax_per_row():
    """Rows of 1 to 40 tokens in 5-token pages, the pages shuffled over three blocks (a row's
    pages in several blocks: the running max/sum merge) -> each row's dense softmax."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, width, rank, page = 6, 3, 12, 8, 5
    lengths = [1, 5, 6, 17, 40, 23]
    q_bHL = torch.randn(rows, heads, width, generator=gen, dtype=F64)
    keys = [3 * torch.randn(n, width, generator=gen, dtype=F64) for n in lengths]
    pages, owner, valid = [], [], []
    for row, keys_SL in enumerate(keys):
        for start in range(0, len(keys_SL), page):
            chunk = keys_SL[start : start + page]
            pages.append(torch.cat([chunk, torch.randn(page - len(chunk), width, dtype=F64)]))
            owner.append(row)
            valid.append(len(chunk))
    order = torch.randperm(len(pages), generator=gen)
    stacked, owner_N, valid_N = (
        torch.stack(pages)[order],
        torch.tensor(owner)[order],
        torch.tensor(valid)[order],
    )
    blocks = [
        (stacked[i], owner_N[i], valid_N[i]) for i in np.array_split(np.arange(len(pages)), 3)
    ]
    got_bHR = ragged_decode(q_bHL, blocks, rank)
    for row, keys_SL in enumerate(keys):
        want = dense_decode(q_bHL[row], keys_SL, rank)
        torch.testing.assert_close(got_bHR[row], want, atol=1e-12, rtol=1e-12)


def test_pages_lowest_first_and_empty_arenas_released():
    pool = PagePool(k3_preset("k3-debug"), dtype=torch.float32, page_size=4, arena_pages=2)
    assert pool.allocate(3) == [0, 1, 2] and sorted(pool.arenas) == [0, 1]
    per_arena = 1 * 2 * 4 * (16 + 8) * 4  # MLA layers x pages x tokens x latent x float32
    assert pool.nbytes() == {"pages": 3 * 4 * 24 * 4, "allocated": 2 * per_arena}
    pool.release([0, 1])  # arena 0 empties: kept as the one spare
    assert sorted(pool.arenas) == [0, 1] and pool.allocate(2) == [0, 1]
    pool.release([2])  # arena 1 empties: the spare now
    pool.release([0, 1])  # arena 0 empties too: its memory goes, one spare is enough
    assert sorted(pool.arenas) == [1] and sorted(pool.free) == [2, 3] and not pool.taken
    with pytest.raises(ValueError, match="page 2 is not in use"):
        pool.release([2])
    assert pool.allocate(3) == [2, 3, 0]  # the free pages first, then the lowest arena reopens
    assert pool.nbytes() == {"pages": 3 * 4 * 24 * 4, "allocated": 2 * per_arena}


def as_lists(routes: list) -> list:
    """Routes (int16 [n, M, Kx] arrays or None) as nested lists, comparable with ==."""
    return [None if r is None else r.tolist() for r in routes]


def paged_pair(record: bool = True, page: int = 3, arena: int = 2):
    """(slot-pool session, paged session) over one float64 k3-debug model; tiny pages in
    two-page arenas so that every episode spreads over many arenas."""
    model = make_model(F64)
    sessions = []
    for paged in (False, True):
        policy = K3Policy(model, seed=0, record_routing=record, paged=paged)
        session = K3Session(policy)
        if paged:
            session.pages = PagePool(model.config, dtype=F64, page_size=page, arena_pages=arena)
        sessions.append(session)
    return sessions


def test_paged_session_equals_slot_session_float64():
    """Random adds (fresh and continuing keys of different lengths), decodes of random subsets,
    drops and new keys: the paged session gives the slot pool's greedy tokens, logprobs (1e-10)
    and routes at every call, and its cache bytes are the tokens it holds."""
    slot, paged = paged_pair()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    live, fresh = [], 0
    for tick in range(40):
        if len(live) < 5 and rng.random() < 0.5:
            live.append(f"k{fresh}")
            fresh += 1
        adding = [k for k in live if rng.random() < 0.3 or k not in paged.contexts]
        if adding:
            tokens = [rng.integers(1, 512, int(rng.integers(1, 12))).tolist() for _ in adding]
            assert as_lists(slot.add(adding, tokens)) == as_lists(paged.add(adding, tokens))
        stepping = [k for k in live if rng.random() < 0.7]
        if stepping:
            want, got = slot.step(stepping, greedy), paged.step(stepping, greedy)
            assert [o.token for o in got] == [o.token for o in want], tick
            assert as_lists([o.routes for o in got]) == as_lists([o.routes for o in want]), tick
            np.testing.assert_allclose([o.logprob for o in got], [o.logprob for o in want],
                                       atol=1e-10, rtol=0)  # fmt: skip
        for key in live:
            assert paged.context_length(key) == slot.context_length(key)
            assert paged.cache_bytes(key) == slot.cache_bytes(key)
        if live and rng.random() < 0.2:
            gone = live.pop(int(rng.integers(len(live))))
            slot.drop([gone])
            paged.drop([gone])
    assert len(paged.pages.arenas) > 3 and paged.stats["gather"]
    paged.drop(list(live))
    assert not paged.pages.taken and len(paged.pages.arenas) == 1 and paged.pool is None


def test_paged_bytes_and_reserve():
    slot, paged = paged_pair(record=False, page=4, arena=8)
    paged.add(["a"], [[5] * 10])
    fixed = slot.bytes_for(0)  # KDA states and conv windows of one row, no tokens
    token = paged.pages.token_bytes()
    assert paged.cache_bytes("a") == fixed + 10 * token
    assert paged.bytes_for(10) == fixed + 12 * token  # three 4-token pages
    assert paged.reserve_for(10) == paged.bytes_for(10) + fixed  # KDA rows copy on join/leave
    assert slot.reserve_for(10) == 2 * slot.bytes_for(10) == 2 * (fixed + 10 * (token + 1))
    assert paged.pages.nbytes() == {"pages": 12 * token, "allocated": 8 * 4 * token}


@pytest.mark.parametrize("paged", [False, True])
def test_rollout_policy_picks_the_cache(paged):
    from policy.engines import open_session, rollout_policy

    session = open_session(rollout_policy(make_model(torch.float32), pad_token_id=0, paged=paged))
    assert (session.pages is not None) == paged
