"""A paged MLA latent cache (K3Session's paged mode): `PagePool` holds the latents of every live
episode in fixed-size pages, `PagedBatch` is the cache a fused forward (engine/decode.py) runs
on for any subset of those episodes, and `ragged_decode` is the decode attention over pages.

Letters: G tokens per page, A pages per arena, Y MLA layers, L latent width (kv_lora_rank R +
rope dim), b rows of one forward, T new tokens per row, H heads, N pages one decode reads,
S the longest earlier context of a prefill forward, Q token slots one prefill reads.

Layout. Every MLA layer shares one page numbering: an episode's block table lists its pages in
order, and its token j sits in page table[j // G], slot j % G, in every MLA layer. Pages live in
arenas of A pages (one tensor [Y, A, G, L] each); an arena is allocated when one of its pages is
first handed out and released when its last page is freed, so memory follows the pages in use.
The free page with the lowest id is handed out first: live pages pack into the low arenas.
Nothing is ever copied to grow, and no page is ever moved.

Why it beats one slot axis for all rows (policy/k3/cache.py, the reference): there every row
has as many slots as the longest, holes accumulate where rows sit out a forward, and a forward
over a non-contiguous subset of rows gathers those rows' whole slot buffers and writes them back.
Here a forward reads only the pages its rows use (per arena, one index_select each), writes
only its new tokens' slots, and a decode step's attention costs each row its own length
(`ragged_decode`: scores per page, softmax merged per row), not the longest row's. On CUDA
the per-row sums are `index_add_`s (atomics): logprobs may differ from run to run in the last
bits; the slot pool's do not.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from policy.k3.cache import K3Cache
from policy.k3.flash import flash_attention

PAGE_SIZE = 64  # tokens per page
ARENA_PAGES = 256  # pages per arena


@dataclass(frozen=True, slots=True)
class _Groups:
    """Token slots or pages of one forward, grouped by arena: (arena, local index, position in
    the forward's order) per arena touched."""

    parts: tuple[tuple[int, Tensor, Tensor], ...]


class PagePool:
    """Pages of MLA latents for every MLA layer of one model; see the module docstring."""

    def __init__(self, config, *, dtype: torch.dtype, device=None,
                 page_size: int = PAGE_SIZE, arena_pages: int = ARENA_PAGES) -> None:  # fmt: skip
        if page_size < 1 or arena_pages < 1:
            raise ValueError("page_size and arena_pages must be >= 1")
        self.page, self.arena_pages = page_size, arena_pages
        self.width = config.kv_lora_rank + config.qk_rope_head_dim
        mla = [i for i, kind in enumerate(config.layer_types) if kind != "linear_attention"]
        self.slot_of = {layer: j for j, layer in enumerate(mla)}  # model layer -> MLA index
        self.dtype, self.device = dtype, device
        self.arenas: dict[int, Tensor] = {}  # arena -> [Y, A, G, L]
        self.in_use: Counter[int] = Counter()  # arena -> pages handed out
        self.free: list[int] = []  # heap of the free pages of allocated arenas
        self.taken: set[int] = set()  # pages handed out

    # -- pages --------------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages, lowest ids first (new arenas as needed)."""
        out = []
        for _ in range(count):
            if not self.free:
                self._open_arena()
            page = heapq.heappop(self.free)
            self.in_use[page // self.arena_pages] += 1
            self.taken.add(page)
            out.append(page)
        return out

    def release(self, pages: list[int]) -> None:
        """Free these pages. Arenas left without a page in use give their memory back, but for
        one spare (the lowest), so that episodes ending and starting together do not free and
        reallocate an arena every time."""
        emptied = set()
        for page in pages:
            if page not in self.taken:
                raise ValueError(f"page {page} is not in use (released twice?)")
            self.taken.remove(page)
            arena = page // self.arena_pages
            self.in_use[arena] -= 1
            heapq.heappush(self.free, page)
            if not self.in_use[arena]:
                emptied.add(arena)
        spare = [a for a in self.arenas if not self.in_use[a] and a not in emptied]
        gone = sorted(emptied)[0 if spare else 1 :]
        if gone:
            for arena in gone:
                del self.arenas[arena], self.in_use[arena]
            self.free = [p for p in self.free if p // self.arena_pages not in gone]
            heapq.heapify(self.free)

    def _open_arena(self) -> None:
        arena = next(a for a in range(len(self.arenas) + 1) if a not in self.arenas)
        shape = (len(self.slot_of), self.arena_pages, self.page, self.width)
        # zeros, not empty: a page's unused tail is read (masked: weight 0, but 0 x NaN = NaN);
        # a reused page's tail holds an earlier episode's finite latents
        self.arenas[arena] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        first = arena * self.arena_pages
        for page in range(first, first + self.arena_pages):
            heapq.heappush(self.free, page)

    # -- accounting -----------------------------------------------------------------------------
    def token_bytes(self) -> int:
        """Bytes of one token slot over every MLA layer."""
        return len(self.slot_of) * self.width * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> dict[str, int]:
        """Bytes of the pages handed out and of the arenas allocated."""
        used = len(self.taken) * self.page * self.token_bytes()
        allocated = sum(x.numel() * x.element_size() for x in self.arenas.values())
        return {"pages": used, "allocated": allocated}

    # -- index plans (one per forward, shared by every MLA layer) --------------------------------
    def slots(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> Tensor:
        """Global token slots (page * G + offset) of tokens start .. start + count - 1 of each
        row, rows one after another -> [sum(counts)]."""
        pieces = []
        for table, start, count in zip(tables, starts, counts, strict=True):
            if not count:
                continue
            first, last = start // self.page, (start + count - 1) // self.page
            pages_P = torch.tensor(table[first : last + 1], dtype=torch.long)
            offsets_G = torch.arange(self.page)
            slots = (pages_P[:, None] * self.page + offsets_G).flatten()
            skip = start - first * self.page
            pieces.append(slots[skip : skip + count])
        if not pieces:
            return torch.empty(0, dtype=torch.long)
        return torch.cat(pieces)

    def group(self, ids: Tensor, per_arena: int) -> _Groups:
        """Split global ids (slots or pages; `per_arena` of them per arena) by arena."""
        device = self.device
        arena_I = ids // per_arena
        order_I = torch.argsort(arena_I, stable=True)
        arenas, counts = torch.unique_consecutive(arena_I[order_I], return_counts=True)
        parts, start = [], 0
        for arena, count in zip(arenas.tolist(), counts.tolist(), strict=True):
            where = order_I[start : start + count]
            parts.append((arena, (ids[where] % per_arena).to(device), where.to(device)))
            start += count
        return _Groups(tuple(parts))

    # -- reads and writes -------------------------------------------------------------------------
    def write(self, layer: int, groups: _Groups, rows_QL: Tensor) -> None:
        """Store rows_QL[position] at each grouped token slot of this MLA layer."""
        j = self.slot_of[layer]
        for arena, local, where in groups.parts:
            flat = self.arenas[arena][j].view(-1, self.width)
            flat.index_copy_(0, local, rows_QL.index_select(0, where).to(self.dtype))

    def read_slots(self, layer: int, groups: _Groups, out_QL: Tensor) -> Tensor:
        """out_QL[position] = the latent at each grouped token slot."""
        j = self.slot_of[layer]
        for arena, local, where in groups.parts:
            flat = self.arenas[arena][j].view(-1, self.width)
            out_QL.index_copy_(0, where, flat.index_select(0, local))
        return out_QL

    def read_pages(self, layer: int, arena: int, local: Tensor) -> Tensor:
        """Pages `local` of one arena in this MLA layer -> [n, G, L] (selected as rows of
        [A, G*L]: twice as fast as [A, G, L])."""
        flat = self.arenas[arena][self.slot_of[layer]].view(self.arena_pages, -1)
        return flat.index_select(0, local).view(-1, self.page, self.width)


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    """The pages a one-token forward reads, per arena: (arena, local pages, row of each page,
    tokens in use in each page)."""

    parts: tuple[tuple[int, Tensor, Tensor, Tensor], ...]


@dataclass(frozen=True, slots=True)
class _ContextPlan:
    """Where a prefill forward's keys go in [b, S + T]: each row's earlier tokens right-aligned
    in the first S (left pads masked), the new ones after them."""

    groups: _Groups  # positions: flat indices into [b * (S + T)]
    longest: int  # S
    mask_bX: Tensor  # [b, S + T]


class PagedBatch:
    """What forward_tokens needs of a cache, for b episodes whose latents live in a PagePool:
    their KDA conv windows and states (as in K3Cache), block tables and lengths. The pages for
    the new tokens must be in the tables already (K3Session allocates them). No padding: every
    row feeds the same T real tokens; `attend` writes their latents and attends."""

    kda = K3Cache.kda
    set_kda = K3Cache.set_kda

    def __init__(self, conv, state, splits, pool: PagePool, tables: list[list[int]],
                 lengths: list[int]) -> None:  # fmt: skip
        self.conv, self.state, self.splits = conv, state, splits
        self.pool, self.tables, self.lengths = pool, tables, lengths
        self.length = 0  # forward_tokens' shared start slot: unused (each row has its own)
        self._new: _Groups | None = None
        self._read: _DecodePlan | _ContextPlan | None = None

    def begin(self, mask_BT: Tensor | None, length: int) -> None:
        """Plan the forward once for every MLA layer: the new slots and what is read."""
        if mask_BT is not None:
            raise ValueError("a paged forward takes no padding (every row feeds T real tokens)")
        pool, rows = self.pool, len(self.tables)
        slots = pool.slots(self.tables, self.lengths, [length] * rows)
        self._new = pool.group(slots, pool.arena_pages * pool.page)
        if length == 1:
            self._read = _decode_plan(pool, self.tables, [n + 1 for n in self.lengths])
        else:
            self._read = _context_plan(pool, self.tables, self.lengths, length)

    def commit(self, length: int) -> None:
        del length  # the session advances its rows' lengths

    def attend(self, layer: int, q_bTHL: Tensor, new_bTL: Tensor, rank: int) -> Tensor:
        """Store the new latents, attend over each row's tokens -> [b, T, H, R]."""
        rows, length = new_bTL.shape[:2]
        self.pool.write(layer, self._new, new_bTL.reshape(rows * length, -1))
        plan = self._read
        if isinstance(plan, _DecodePlan):
            blocks = ((self.pool.read_pages(layer, arena, local), owner, valid)
                      for arena, local, owner, valid in plan.parts)  # fmt: skip
            return ragged_decode(q_bTHL[:, 0], blocks, rank)[:, None]
        width = plan.longest + length
        keys_QL = new_bTL.new_zeros(rows * width, new_bTL.shape[-1])
        keys_bXL = self.pool.read_slots(layer, plan.groups, keys_QL).view(rows, width, -1)
        keys_bXL[:, plan.longest :] = new_bTL
        return flash_attention(q_bTHL, keys_bXL, keys_bXL[..., :rank], scale=1.0,
                               offset=plan.longest, key_mask_BS=plan.mask_bX)  # fmt: skip


def ragged_decode(q_bHL: Tensor, blocks, rank: int) -> Tensor:
    """One query per row over that row's pages only: softmax(q . k) v with v = k[..., :rank]
    -> [b, H, R]. `blocks` yields (pages [N, G, L], owner_N: the row of each page, valid_N:
    the tokens in use in each page); a row's pages may spread over blocks, every row has at
    least one token. Per block: scores per page, the row maxima by scatter, then the running
    (max, sum, output) of each row rescaled as in flash decoding; nothing larger than one
    block's pages is ever gathered."""
    rows, heads = q_bHL.shape[:2]
    floor = torch.finfo(q_bHL.dtype).min
    m_bH = q_bHL.new_full((rows, heads), floor)
    l_bH = q_bHL.new_zeros(rows, heads)
    o_bHR = q_bHL.new_zeros(rows, heads, rank)
    for pages_NGL, owner_N, valid_N in blocks:
        scores_NHG = q_bHL.index_select(0, owner_N) @ pages_NGL.transpose(1, 2)
        tail_NG = torch.arange(pages_NGL.shape[1], device=valid_N.device) >= valid_N[:, None]
        scores_NHG.masked_fill_(tail_NG[:, None], floor)
        block_bH = q_bHL.new_full((rows, heads), floor).scatter_reduce_(
            0, owner_N[:, None].expand(-1, heads), scores_NHG.amax(-1), "amax"
        )
        new_bH = torch.maximum(m_bH, block_bH)
        alpha_bH = torch.exp(m_bH - new_bH)
        e_NHG = torch.exp(scores_NHG.sub_(new_bH.index_select(0, owner_N)[..., None]))
        l_bH = (l_bH * alpha_bH).index_add_(0, owner_N, e_NHG.sum(-1))
        o_bHR = (o_bHR * alpha_bH[..., None]).index_add_(0, owner_N, e_NHG @ pages_NGL[..., :rank])
        m_bH = new_bH
    return o_bHR / l_bH[..., None]


def _decode_plan(pool: PagePool, tables: list[list[int]], counts: list[int]) -> _DecodePlan:
    pages, owner, valid = [], [], []
    for row, (table, count) in enumerate(zip(tables, counts, strict=True)):
        n = pool.pages_for(count)
        pages.extend(table[:n])
        owner.extend([row] * n)
        valid.extend([pool.page] * (n - 1) + [count - (n - 1) * pool.page])
    groups = pool.group(torch.tensor(pages, dtype=torch.long), pool.arena_pages)
    owner_N = torch.tensor(owner, dtype=torch.long, device=pool.device)
    valid_N = torch.tensor(valid, dtype=torch.long, device=pool.device)
    parts = tuple((arena, local, owner_N[where], valid_N[where])
                  for arena, local, where in groups.parts)  # fmt: skip
    return _DecodePlan(parts)


def _context_plan(pool: PagePool, tables: list[list[int]], lengths: list[int],
                  new: int) -> _ContextPlan:  # fmt: skip
    rows, longest = len(tables), max(lengths)
    width, lengths_b = longest + new, torch.tensor(lengths, dtype=torch.long)
    mask_bX = (torch.arange(width) >= (longest - lengths_b)[:, None]).to(pool.device)
    if not longest:
        return _ContextPlan(_Groups(()), 0, mask_bX)
    slots_Q = pool.slots(tables, [0] * rows, lengths)
    first_b = torch.arange(rows) * width + longest - lengths_b  # flat index of each row's 1st
    before_b = torch.cumsum(lengths_b, 0) - lengths_b
    dest_Q = torch.arange(len(slots_Q)) + torch.repeat_interleave(first_b - before_b, lengths_b)
    groups = pool.group(slots_Q, pool.arena_pages * pool.page)
    dest_Q = dest_Q.to(pool.device)
    parts = tuple((arena, local, dest_Q[where]) for arena, local, where in groups.parts)
    return _ContextPlan(_Groups(parts), longest, mask_bX)
