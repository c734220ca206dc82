"""What a candidate costs under the planner's closed-form model of the step (NOTE [ Planner ] in
_planner.py): its predicted step time and device peak, and cheaper bounds on them.
"""

from __future__ import annotations

import math

import numpy as np

from offload.lifecycle._plan import Prediction
from offload.lifecycle._plan_model import _Candidate, _Column, _diff, _Model


def evaluate(
    model: _Model, column: tuple[_Column, float], k: int, *, memory: bool = True
) -> _Candidate:
    """Predicted step time (and, with ``memory``, peak) offloading the first ``k``
    families of ``column``'s offload order. See NOTE [ Planner ] in _planner.py."""
    model.scored += 1
    col, lead = column
    v = model.v
    step_s = v.step_s + col.recompute_s
    none = np.zeros(0, np.int64)
    if k == 0:
        return _Candidate(
            col.m, lead, 0, col.peak0, step_s, none, none.astype(bool), none, col.rebuilt
        )
    sel = np.flatnonzero(col.rank < k)  # moved families (positions in col), pack order
    fam = col.fams[sel]
    nvme, _ = model.tiers_for(col, sel)
    floats, ints, use_order, _ = model.views[col.rebuild]
    tp, b, d2h, h2d, read, write, slack, u_all = np.take(floats, fam, axis=1)
    fu_all, trig_after_pack, frame_after_pack = np.take(ints, fam, axis=1)
    if model.overlap:
        cum = np.cumsum(d2h)
        c = np.maximum.accumulate(tp - (cum - d2h)) + cum  # copy-out completions, FIFO
        step_s += max(0.0, float(np.max(c - tp - slack)))
    else:
        c = tp
    # For memory only (an upper bound on when a copy out completes): once reloads may run,
    # D2H may get only its share of the duplex rate. Reloads are placed by the full rate:
    # one asked for before its copy completes simply waits for it (NOTE [ Reload policy ]
    # in _simulate.py).
    c_memory = c
    if model.overlap and model.duplex < 1.0:
        late = c > model.t0
        c_memory = c.copy()
        c_memory[late] = model.t0 + (c[late] - model.t0) / model.duplex
    # c does not decrease along pack order: only the copies completing in backward need a
    # search for the first backward event after them.
    trig, n_trig = v.trig, len(v.trig)
    nxt = np.zeros(len(sel), np.int64)
    late_from = int(np.searchsorted(c, model.t0, side="right"))
    nxt[late_from:] = np.searchsorted(v.trig_t, c[late_from:], side="left")
    nxt = np.maximum(nxt, trig_after_pack)  # and not before the pack
    avail = c
    rd = h2d
    if nvme.any():
        avail = c.copy()
        w_cum = np.cumsum(write[nvme])
        avail[nvme] = np.maximum.accumulate(c[nvme] - (w_cum - write[nvme])) + w_cum
        rd = h2d + np.where(nvme, read, 0.0)
    # Reloads: every unpacked moved family, in the order backward needs them.
    member = np.zeros(len(v.fid), bool)
    member[fam] = True
    index = model._index
    index[fam] = np.arange(len(fam))
    at = index[use_order[member[use_order]]]  # into sel, use order
    u = u_all[at]
    do = rd[at]
    if model.overlap:
        if len(at):
            after = np.where(nxt < n_trig, v.trig_t[np.minimum(nxt, n_trig - 1)], math.inf)
            # When each reload can start at the earliest (lead 0.0: at its first unpack).
            ready = u if lead == 0.0 else np.minimum(np.maximum(avail, after)[at], u)
            cum = np.cumsum(do)
            fin = np.maximum.accumulate(ready - (cum - do)) + cum
            late = max(0.0, float(np.max(fin - u)))
            step_s += max(late, float(do[ready >= u].sum()))
    else:
        step_s += float(d2h.sum()) + float(do.sum())
        if v.n_passes > 1:  # each later backward pass reloads again
            again = (v.pass_first[1:, fam] >= 0).sum(axis=0)
            step_s += float((rd * again).sum())
    if not memory:
        return _Candidate(
            col.m, lead, k, math.nan, step_s, none, none.astype(bool), none, col.rebuilt
        )
    # Memory: each moved family is absent from its copy's completion to its reload's start.
    trigger = np.full(len(sel), -1, np.int64)
    away = (fu_all < 0) | (c < u_all)
    if len(at):
        if model.overlap and lead != 0.0:
            # As late as the link allows, counting only the reloads that happen (a family
            # unpacked before its copy out completes uses its source). The step time above
            # counts them all, which keeps it monotone in k; the start times only place
            # reloads, and so only change memory.
            busy = np.where(away[at], do, 0.0)
            rc = np.cumsum(busy[::-1])[::-1]  # durations from each reload to the last
            following = np.append(rc[1:], 0.0)
            start = np.minimum.accumulate((u + following)[::-1])[::-1] - rc
        else:
            start = u
        fu = fu_all[at]
        pos = np.searchsorted(v.trig_t, start, side="right") - 1
        ev = np.minimum(trig[np.maximum(pos, 0)], fu)
        first_after = np.where(nxt < n_trig, trig[np.minimum(nxt, n_trig - 1)], v.n_events)
        ev = np.maximum(ev, first_after[at])
        back = away[at] & (ev <= fu)
        trigger[at[back]] = ev[back]
        away[at[~back]] = False
    # In frames: absent from the first frame after the copy out through the frame before the
    # reload (see _Step.freed).
    first_frame = np.searchsorted(v.frame_first_t, c_memory, side="left")
    lo = np.maximum(first_frame, frame_after_pack)[away]
    hi = v.inner_hi[np.where(trigger >= 0, trigger, v.n_events)][away]
    freed = _diff(v.n_frames, lo, np.maximum(hi, lo), b[away])
    if v.retained:
        # A reloaded family is freed after its last use, not kept to the step's end.
        back = trigger >= 0
        freed += v.freed(v.end[fam[back]] + 1, v.keep_end[fam[back]] + 1, b[back])
        # And after its last use in each backward pass (NOTE [ Backward passes ] in _trace.py).
        freed += v.between_passes(fam[back], trigger[back], b[back])
    peak = float(np.max(col.base - freed))
    return _Candidate(col.m, lead, k, peak, step_s, fam, nvme, trigger, col.rebuilt)


def copies_out_bound(model: _Model, col: _Column, k: int) -> float:
    """A lower bound on the step time of ``col``'s first ``k`` families offloaded: the trace,
    the recompute time, and the copies out (their back-pressure, or their time where copies
    do not overlap compute)."""
    step_s = model.v.step_s + col.recompute_s
    if k == 0:
        return step_s
    fam = col.fams[col.rank < k]
    d2h = model.d2h_s[fam]
    if not model.overlap:
        return step_s + float(d2h.sum())
    tp = model.floats[0][fam]
    cum = np.cumsum(d2h)
    c = np.maximum.accumulate(tp - (cum - d2h)) + cum
    return step_s + max(0.0, float(np.max(c - tp - model.slack_s[fam])))


def model_anchors(model: _Model, keep_all: _Candidate) -> dict[str, Prediction]:
    """The anchors this model predicts as :func:`lifecycle.predict_anchors` defines them
    (NOTE [ Anchors ] in _anchors.py): keeping everything, and checkpointing every block when
    the planner may recompute every one. Offloading everything is min-memory mode, whose
    reloads follow the executor's look-ahead window, which this model does not have: left
    out."""
    out = {"keep_all": Prediction(peak_bytes=math.ceil(keep_all.peak), step_s=keep_all.step_s)}
    if len(model.blocks) == model.v.all_blocks:
        c = evaluate(model, model.column(len(model.blocks), 1.0), 0)
        out["checkpoint_blocks"] = Prediction(peak_bytes=math.ceil(c.peak), step_s=c.step_s)
    return out
