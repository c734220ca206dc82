"""How the planner chooses: a best-first search over the columns of candidates, each bisected
for its smallest offloaded prefix that fits the target (NOTE [ Planner ] in _planner.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Generator

from offload.lifecycle._plan_cost import copies_out_bound, evaluate
from offload.lifecycle._plan_model import _Candidate, _Column, _Model, _Step

_LEADS = (1.0, 0.0)
_BISECTION_STEPS = 256  # a column's k is found to within 1/256 of its candidates
_LADDER_STEPS = 12  # values of m searched, geometric above this many blocks
_LEAVES = 9  # heap stage of the boundary columns (see _Search.search)
_BOUNDARY_STEPS = 128  # the boundary m is found to within 1/128 of the blocks


class _Search:
    """The best-first search over the model's columns (NOTE [ Planner ] in _planner.py), keeping
    the columns' tops it scored for reuse."""

    def __init__(self, model: _Model) -> None:
        self.model = model
        self._tops: dict[tuple[int, float, int], _Candidate] = {}
        # Without recompute the search stays on m = 0 (the anchors still use every block).
        self.ladder = _ladder(len(model.blocks)) if model.recompute else [0]

    def search(self, target: float) -> _Candidate | None:
        """The fastest column result that fits ``target`` (see NOTE [ Planner ] in _planner.py)."""
        model = self.model
        best: _Candidate | None = None
        bound = math.inf  # the step time of a feasible candidate seen: the result is no slower
        # Heap entries: (lower bound, stage, tie-break, m, lead, order variant). Columns' bounds
        # are refined in stages, each costlier than the last: 0, the trace plus the recompute
        # time; 1, plus the copies out of the least k that could fit (the same for both leads);
        # 2, lead 1.0's step at that k (lead 0.0's steps are no shorter); 3, the column's own
        # step at that k; then the column is bisected. Stage _LEAVES: the search for the
        # boundary columns above m (see _next_leaf), one probe per pop, its bound raised as
        # the probes rule out small m.
        heap: list[tuple[float, int, int, int, float, int]] = []
        queued: set[tuple[int, float, int]] = set()
        tie = itertools.count()
        variants = range(len(model.variants))
        nb = len(model.blocks)
        leaf_work: dict[int, Generator[int, None, int | None]] = {}  # by tie-break

        def leaves_above(m: int, lead: float, low: float) -> None:
            order = next(tie)
            leaf_work[order] = self._next_leaf(target, m, lead)
            heapq.heappush(heap, (low, _LEAVES, order, m, lead, 0))

        def queue(m: int, lead: float) -> None:
            for variant in variants:
                if (m, lead, variant) not in queued:
                    queued.add((m, lead, variant))
                    low = model.v.step_s + model.recompute_s[m] + model.rebuild_time(m, variant)
                    heapq.heappush(heap, (low, 0, next(tie), m, lead, variant))

        for m in self.ladder:
            for lead in _LEADS:
                queue(m, lead)
        # m = 0 is on the ladder: the boundary columns worth adding start above it.
        if model.recompute:
            leaves_above(0, _LEADS[0], model.v.step_s + model.recompute_s[min(1, nb)])
        copies_out: dict[tuple[int, int], float] = {}  # (m, variant) -> stage 1's bound
        first_lead: dict[tuple[int, int], float] = {}  # (m, variant) -> lead 1.0's stage 3
        while heap:
            low, stage, order, m, lead, variant = heapq.heappop(heap)
            if low > bound:
                break
            if stage == _LEAVES:
                work = leaf_work.pop(order)
                try:
                    least = next(work)  # one probe; the least m the leaf can still be
                except StopIteration as done:
                    leaf = done.value
                    if leaf is not None:
                        queue(leaf, lead)
                        if leaf < nb:
                            leaves_above(leaf, lead, model.v.step_s + model.recompute_s[leaf + 1])
                    continue
                order = next(tie)
                leaf_work[order] = work
                low = max(low, model.v.step_s + model.recompute_s[min(least, nb)])
                heapq.heappush(heap, (low, _LEAVES, order, m, lead, 0))
                continue
            column = model.column(m, lead, variant)
            col = column[0]
            least = col.least_k(target)
            if least > col.top:
                continue  # not even every family the room allows fits
            key = (m, variant)
            if stage == 0:
                if key not in copies_out:
                    copies_out[key] = copies_out_bound(model, col, least)
                stage, low = 1, max(low, copies_out[key])
            elif stage == 1:
                if lead != _LEADS[0] and key in first_lead:
                    stage, low = 2, max(low, first_lead[key])
                else:
                    stage = 3
                    if least > 0:
                        low = max(low, evaluate(model, column, least, memory=False).step_s)
                    if lead == _LEADS[0]:
                        first_lead[key] = low
            elif stage == 2:
                stage = 3
                if least > 0:
                    low = max(low, evaluate(model, column, least, memory=False).step_s)
            else:
                found = self._bisect(column, target, least, low, bound)
                if found is not None:
                    bound = min(bound, found.step_s)
                    if best is None or _better(found, best, model.v):
                        best = found
                continue
            heapq.heappush(heap, (low, stage, next(tie), m, lead, variant))
        return best

    def _next_leaf(
        self, target: float, after: int, lead: float
    ) -> Generator[int, None, int | None]:
        """Returns the smallest ``m`` above ``after`` that a boundary bisection returns for some
        target at most ``target`` (see _boundary); ``None``: there is none. A generator, run one
        probe at a time: before each it yields the least ``m`` the result can still be (above
        ``after``; at least the bisection's lower bracket, as later bisections, for smaller
        targets, return no smaller ``m``), a bound the search weighs this work by."""
        t = target
        while True:
            leaf, flips = yield from self._boundary(t, lead, after + 1)
            if leaf is None:
                return None
            if leaf > after:
                return leaf
            # Below the largest fitting peak on its path, the bisection turns right there.
            t = max(flips) - 0.5

    def _boundary(
        self, target: float, lead: float, least: int
    ) -> Generator[int, None, tuple[int | None, list[float]]]:
        """Returns the smallest ``m`` whose column's top fits ``target``, by bisection over all
        ``m`` with a fixed bracket and probe rule (to within 1/_BOUNDARY_STEPS of the blocks),
        and the peaks that fitted on the way; yields before each probe (see _next_leaf). The
        result never grows with the target; the set of results for all targets up to a budget
        only grows with it, so its columns may join the search."""
        model = self.model
        nb = len(model.blocks)
        yield least
        peak = self._top(nb, lead).peak
        if peak > target:
            return None, []
        fitted = [peak]
        lo, hi = 0, nb  # invariant: hi fits
        tolerance = max(1, nb // _BOUNDARY_STEPS)
        while hi - lo >= tolerance and lo < hi:
            yield max(least, lo)  # the result is at least lo
            mid = (lo + hi) // 2
            col = model.column(mid, lead)[0]
            # Known not to fit without scoring it when even all its room cannot relieve the peak.
            fits = col.least_k(target) <= col.top and self._top(mid, lead).peak <= target
            if fits:
                hi = mid
                fitted.append(self._top(mid, lead).peak)
            else:
                lo = mid + 1
        return hi, fitted

    def _top(self, m: int, lead: float, variant: int = 0) -> _Candidate:
        """Column ``(m, lead)`` with every family the room allows offloaded (kept for reuse)."""
        model = self.model
        got = self._tops.get((m, lead, variant))
        if got is None:
            column = model.column(m, lead, variant)
            got = self._tops[(m, lead, variant)] = evaluate(model, column, column[0].top)
        return got

    def _bisect(
        self,
        column: tuple[_Column, float],
        target: float,
        least: int,
        low: float,
        bound: float,
    ) -> _Candidate | None:
        """The column's smallest k that fits, by bisection over ``[0, top]``; ``None`` when the
        top does not fit, or when the result cannot beat ``bound`` (``low`` bounds it below)."""
        col = column[0]
        top = self._top(col.m, column[1], col.variant)
        if top.peak > target:
            return None
        best = top
        bound = min(bound, top.step_s)
        lo, hi = 0, col.top  # invariant: hi fits
        tolerance = max(1, col.top // _BISECTION_STEPS)
        while hi - lo >= tolerance and lo < hi:
            mid = (lo + hi) // 2
            if mid < least:
                lo = mid + 1  # known not to fit: see _Column.least_k
                continue
            c = evaluate(self.model, column, mid)
            if c.peak <= target:
                hi, best = mid, c
                bound = min(bound, c.step_s)
            else:
                lo = mid + 1
                low = max(low, c.step_s)  # the result has more families: it is no faster
                if low > bound:
                    return None
        return best

    def lowest(self) -> _Candidate:
        """The least-memory candidate: every family the room allows offloaded, reloads at first
        use, on the ``m`` that peaks lowest."""
        model = self.model
        best = None
        for m in self.ladder:
            for variant in range(len(model.variants)):
                c = self._top(m, 0.0, variant)
                if best is None or c.peak < best.peak:
                    best = c
        assert best is not None
        return best


def _better(a: _Candidate, b: _Candidate, v: _Step) -> bool:
    """Faster; then fewer bytes moved; then fewer blocks recomputed."""
    if a.step_s != b.step_s:
        return a.step_s < b.step_s
    moved_a, moved_b = int(v.nbytes[a.moved].sum()), int(v.nbytes[b.moved].sum())
    if moved_a != moved_b:
        return moved_a < moved_b
    return (a.m, -a.lead) < (b.m, -b.lead)


def _ladder(n: int) -> list[int]:
    """The ``m`` values searched: every one up to ``_LADDER_STEPS``, else 0 and about that many
    geometric steps from 1 up to n (n itself included)."""
    if n <= _LADDER_STEPS:
        return list(range(n + 1))
    ratio = n ** (1 / _LADDER_STEPS)
    out, m = [0], 1.0
    while m < n:
        if int(m) != out[-1]:
            out.append(int(m))
        m *= ratio
    out.append(n)
    return out
