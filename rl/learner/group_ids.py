"""The learner's set of finished trajectory group ids, kept small whatever the run's length.

Group ids are issued in order within a family: async tasks are `t<i>` (family "t", index i,
rl/run/async_loop.py), sync steps `<step>-<i>` (family "<step>-", index i, rl/run/sync_loop.py).
So per family the set keeps a low watermark (every index below it is in the set) plus the sparse
indices above it; membership = below the watermark or in the sparse set. Groups finish nearly in
order, so the sparse part stays about as large as what is in flight.

Sync mode opens one family per step. A family with nothing above its watermark whose head is
itself numbered (`<step>-`) is folded into a run of consecutive steps with the same watermark:
`[first step, last step, watermark]` stands for every `<step>-<i>` with first <= step <= last and
i < watermark, so a whole sync run of B groups per step is one run. A later id of a folded step
splits the run again. Ids that fit no family (no trailing number, or one with a leading zero) are
kept as they are.

The JSON form (`to_json`, saved in every checkpoint's learner.json) is canonical: two sets with
the same members have the same JSON. `from_json` also takes the plain sorted list of ids that
checkpoints held before.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable

_ID = re.compile(r"(.*?)(\d+)")
_NUMBERED_HEAD = re.compile(r"(.*?)(\d+)(\D+)")
FOLD_AFTER = 8
"""Families kept unfolded before the foldable ones are folded into runs."""


def _number(digits: str) -> int | None:
    """The canonical decimal `digits` spell (None for a leading zero: "07" is not "7")."""
    return int(digits) if digits == "0" or not digits.startswith("0") else None


def _parse(group_id: str) -> tuple[str, int] | None:
    """(family head, index): "t12" -> ("t", 12), "3-7" -> ("3-", 7); None when no family."""
    m = _ID.fullmatch(group_id)
    if m is None:
        return None
    n = _number(m.group(2))
    return None if n is None else (m.group(1), n)


def _fold_key(head: str) -> tuple[tuple[str, str], int] | None:
    """A numbered head "<a><m><c>" ("3-": a "", m 3, c "-") -> ((a, c), m); None otherwise."""
    m = _NUMBERED_HEAD.fullmatch(head)
    if m is None:
        return None
    n = _number(m.group(2))
    return None if n is None else ((m.group(1), m.group(3)), n)


class GroupIds:
    """A set of group ids (add, `in`, len) stored as watermarks, sparse sets and runs."""

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._mark: dict[str, int] = {}  # family head -> watermark
        self._above: dict[str, set[int]] = {}  # family head -> indices above it (never empty)
        self._runs: dict[tuple[str, str], list[list[int]]] = {}  # [first, last, mark], sorted
        self._other: set[str] = set()
        self.update(ids)

    # -- the set -------------------------------------------------------------------------------
    def add(self, group_id: str) -> None:
        parsed = _parse(group_id)
        if parsed is None:
            self._other.add(group_id)
            return
        head, n = parsed
        if head not in self._mark:
            if len(self._mark) >= FOLD_AFTER:
                self.compact()
            self._mark[head] = self._unfold(head)
        mark = self._mark[head]
        if n < mark:
            return
        above = self._above.get(head)
        if n > mark:
            self._above.setdefault(head, set()).add(n)
            return
        mark += 1
        while above and mark in above:
            above.discard(mark)
            mark += 1
        self._mark[head] = mark
        if above is not None and not above:
            del self._above[head]

    def update(self, ids: Iterable[str]) -> None:
        for group_id in ids:
            self.add(group_id)

    def __contains__(self, group_id: object) -> bool:
        if not isinstance(group_id, str):
            return False
        parsed = _parse(group_id)
        if parsed is None:
            return group_id in self._other
        head, n = parsed
        if head in self._mark:
            return n < self._mark[head] or n in self._above.get(head, ())
        return n < self._folded_mark(head)

    def __len__(self) -> int:
        families = sum(self._mark.values()) + sum(len(a) for a in self._above.values())
        runs = sum(
            (last - first + 1) * mark for rs in self._runs.values() for first, last, mark in rs
        )
        return families + runs + len(self._other)

    def watermark(self, head: str) -> int:
        """Every id `<head><i>` with i below this is in the set."""
        return self._mark[head] if head in self._mark else self._folded_mark(head)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupIds):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"GroupIds({len(self)} ids, {self.size()} stored)"

    def size(self) -> int:
        """Numbers and ids stored: what the checkpoint holds, whatever len() is."""
        sparse = sum(len(a) for a in self._above.values())
        runs = sum(len(rs) for rs in self._runs.values())
        return len(self._mark) + sparse + 3 * runs + len(self._other)

    # -- folding -------------------------------------------------------------------------------
    def _find(self, head: str) -> tuple[list[list[int]], int] | None:
        """(the runs of head's fold key, the index of the run holding head) or None."""
        key = _fold_key(head)
        if key is None or key[0] not in self._runs:
            return None
        runs, m = self._runs[key[0]], key[1]
        i = bisect.bisect_right(runs, [m, math.inf, math.inf]) - 1
        return (runs, i) if i >= 0 and runs[i][1] >= m else None

    def _folded_mark(self, head: str) -> int:
        found = self._find(head)
        return 0 if found is None else found[0][found[1]][2]

    def _unfold(self, head: str) -> int:
        """Take `head`'s family out of its run (split in two); returns its watermark (0: none)."""
        found = self._find(head)
        if found is None:
            return 0
        runs, i = found
        first, last, mark = runs[i]
        m = _fold_key(head)[1]
        runs[i : i + 1] = [r for r in ([first, m - 1, mark], [m + 1, last, mark]) if r[0] <= r[1]]
        if not runs:
            del self._runs[_fold_key(head)[0]]
        return mark

    def compact(self) -> None:
        """Fold every numbered family with nothing above its watermark into the runs."""
        new: dict[tuple[str, str], list[list[int]]] = {}
        for head, mark in list(self._mark.items()):
            key = _fold_key(head)
            if key is None or head in self._above:
                continue
            del self._mark[head]
            if mark:
                new.setdefault(key[0], []).append([key[1], key[1], mark])
        for key, singles in new.items():
            merged: list[list[int]] = []
            for run in sorted(self._runs.get(key, []) + singles):
                if merged and merged[-1][1] + 1 == run[0] and merged[-1][2] == run[2]:
                    merged[-1][1] = run[1]
                else:
                    merged.append(list(run))
            self._runs[key] = merged

    # -- checkpoints ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        self.compact()
        return {
            "families": {
                head: [self._mark[head], sorted(self._above.get(head, ()))]
                for head in sorted(self._mark)
            },
            "runs": [[a, c, *run] for (a, c) in sorted(self._runs) for run in self._runs[(a, c)]],
            "other": sorted(self._other),
        }

    @staticmethod
    def from_json(data: dict | list) -> GroupIds:
        """A `to_json` dict, or a plain list of ids (checkpoints before this format)."""
        if isinstance(data, list):
            ids = GroupIds(data)
            ids.compact()
            return ids
        ids = GroupIds(data.get("other", []))
        for head, (mark, above) in data.get("families", {}).items():
            ids._mark[head] = int(mark)
            if above:
                ids._above[head] = {int(n) for n in above}
        for a, c, first, last, mark in data.get("runs", []):
            ids._runs.setdefault((a, c), []).append([int(first), int(last), int(mark)])
        for runs in ids._runs.values():
            runs.sort()
        return ids
