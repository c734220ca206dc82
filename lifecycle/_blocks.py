"""What "a block" of a step is: the one rule behind the planner's recompute search and the
"checkpoint every block" anchor.

NOTE [ Blocks ]
    A block is a forward module call at the first nesting level that holds two or more calls
    which call modules themselves: a transformer's layers. A lone wrapper (a ``Sequential``
    holding the layers, the only child of the root) is looked through; a ``ModuleList`` makes no
    call of its own. A step that never calls the root's forward (it calls the layers itself)
    has them at the top level, which then counts as the root's children would. A model none of whose calls call modules has no blocks. The planner
    recomputes blocks (less those holding a stateful or kept module), and the
    ``checkpoint_blocks`` anchor predicts checkpointing every one of them, so both must read
    the same blocks: checkpointing the wrapper around a stack of 4 blocks left 2,113,536 of
    its 2,146,304 saved bytes, checkpointing the 4 blocks 626,688 (measured on CPU).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from offload.lifecycle._trace import Event, EventKind

_get = operator.attrgetter
_CODE = {k: i for i, k in enumerate(EventKind)}  # the planner's event codes
_FWD_START, _FWD_END = _CODE[EventKind.FORWARD_START], _CODE[EventKind.FORWARD_END]


@dataclass(frozen=True)
class Blocks:
    """The step's blocks (see :func:`find_blocks`), in forward order, as columns."""

    module: list[str]
    call_index: list[int]
    start: np.ndarray  # local event indices
    end: np.ndarray
    duration_s: list[float]

    def __len__(self) -> int:
        return len(self.module)

    def without(self, modules: Iterable[str], *, exactly: bool = False) -> Blocks:
        """These blocks less those that are, hold, or lie inside one of ``modules`` (with
        ``exactly``: less those that are one)."""
        modules = list(modules)
        if not modules:
            return self
        if exactly:
            named = set(modules)
            keep = [p not in named for p in self.module]
        else:
            keep = [
                not any(p == "" or within(m, (p,)) or within(p, (m,)) for m in modules)
                for p in self.module
            ]
        mask = np.asarray(keep, bool)
        return Blocks(
            list(itertools.compress(self.module, keep)),
            list(itertools.compress(self.call_index, keep)),
            self.start[mask],
            self.end[mask],
            list(itertools.compress(self.duration_s, keep)),
        )

    @classmethod
    def of(cls, spans: Sequence[tuple[str, int, int, int, float]]) -> Blocks:
        """From ``(module, call index, start, end, duration)`` per block."""
        return cls(
            [b[0] for b in spans],
            [b[1] for b in spans],
            np.asarray([b[2] for b in spans], np.int64),
            np.asarray([b[3] for b in spans], np.int64),
            [b[4] for b in spans],
        )


def within(path: str, modules: Sequence[str]) -> bool:
    """Whether module ``path`` is one of ``modules`` or inside one ("" is the root)."""
    return any(m == "" or path == m or path.startswith(m + ".") for m in modules)


def find_blocks(
    events: Sequence[Event], codes: np.ndarray | None = None, t: np.ndarray | None = None
) -> Blocks:
    """The step's blocks (NOTE [ Blocks ]), in forward order.

    Args:
        events: the step's events, in timeline order.
        codes: each event's kind as its index in ``EventKind`` (computed when not given).
        t: each event's time (computed when not given).

    Returns:
        :class:`Blocks` whose ``start`` / ``end`` are positions in ``events``.
    """
    if codes is None:
        codes = np.fromiter((_CODE[e.kind] for e in events), np.int8, len(events))
    if t is None:
        t = np.fromiter((e.time_s for e in events), np.float64, len(events))
    idx = np.flatnonzero((codes == _FWD_START) | (codes == _FWD_END))
    is_start = codes[idx] == _FWD_START
    after = np.cumsum(np.where(is_start, 1, -1))
    if len(after) and after.min() < 0:
        return Blocks.of(_blocks_slow(events))  # an end without a start: as the recorder did
    depth = np.where(is_start, after - 1, after)
    # Within one depth, starts and ends alternate; each end closes the start just before it.
    order = np.lexsort((idx, depth))
    ends = np.flatnonzero(~is_start[order])
    if not len(ends):
        return Blocks.of([])
    end_at = order[ends]
    start_at = order[ends - 1]
    # A span has children when the next forward event after its start is another start.
    nxt = np.minimum(start_at + 1, len(idx) - 1)
    children = is_start[nxt] & (nxt != start_at)
    d = depth[start_at]
    # Depth 0 is the root's call, or, in a step that never calls the root's forward, the
    # modules it calls at the top level: those are a level like the root's children.
    top = d == 0
    if top.any():
        names = [events[i].module for i in idx[start_at[top]].tolist()]
        top[top] = np.fromiter((n != "" for n in names), bool, len(names))
    keep = children & ((d >= 1) | top)
    if not keep.any():
        return Blocks.of([])
    depths, counts = np.unique(d[keep], return_counts=True)
    many = depths[counts >= 2]
    level = many[0] if len(many) else 1
    chosen = keep & (d == level)
    starts, stops = idx[start_at[chosen]], idx[end_at[chosen]]
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    calls = list(map(_get("module", "call_index"), map(events.__getitem__, starts.tolist())))
    return Blocks(
        [c[0] for c in calls],
        [c[1] for c in calls],
        starts,
        stops,
        (t[stops] - t[starts]).tolist(),
    )


def _blocks_slow(events: Sequence[Event]) -> list[tuple[str, int, int, int, float]]:
    """:func:`find_blocks` for a timeline whose forward starts and ends do not nest."""
    open_: list[list] = []  # [module, call, start, depth, has_children]
    spans: list[tuple[int, tuple[str, int, int, int, float], bool]] = []
    t0 = events[0].time_s
    for i, e in enumerate(events):
        if e.kind is EventKind.FORWARD_START:
            if open_:
                open_[-1][4] = True
            open_.append([e.module, e.call_index, i, len(open_), False])
        elif e.kind is EventKind.FORWARD_END and open_:
            module, call, start, depth, children = open_.pop()
            dur = (e.time_s - t0) - (events[start].time_s - t0)
            spans.append((depth, (module, call, start, i, dur), children))
    by_depth: dict[int, list[tuple[str, int, int, int, float]]] = {}
    for depth, b, children in spans:
        if children and (depth >= 1 or b[0] != ""):  # see find_blocks
            by_depth.setdefault(depth, []).append(b)
    for depth in sorted(by_depth):
        if len(by_depth[depth]) >= 2:
            return sorted(by_depth[depth], key=lambda b: b[2])
    return sorted(by_depth.get(1, []), key=lambda b: b[2])
