"""The step simulator and the hardware model: hand-computed timelines on synthetic traces, and
properties (bounds, monotonicity, accounting) on real traces of the test models."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Callable
from types import FrameType, ModuleType

import pytest
import torch
from models import ALL_MODELS, gpt_block
from torch import nn

import offload
from offload.lifecycle import (
    Decision,
    Event,
    EventKind,
    HardwareModel,
    Placement,
    Simulation,
    TensorRecord,
    Trace,
    checkpoint_blocks,
    offload_all,
    predict_anchors,
    simulate,
    transformer_trace,
)

CPU, NVME, KEEP, RECOMPUTE = Placement.CPU, Placement.NVME, Placement.KEEP, Placement.RECOMPUTE
REBUILD = Placement.REBUILD

# -- building traces by hand ----------------------------------------------------------------


class _Builder:
    """One step, event by event, with times in seconds; memory is the live saved bytes."""

    def __init__(self) -> None:
        self.events: list[tuple[float, EventKind, str, int]] = [(0.0, EventKind.STEP_START, "", -1)]
        self.packs: list[dict] = []

    def _event(self, t: float, kind: EventKind, module: str = "", record: int = -1) -> None:
        assert t >= self.events[-1][0], "events must come in time order"
        self.events.append((t, kind, module, record))

    def fwd_start(self, t: float, module: str) -> None:
        self._event(t, EventKind.FORWARD_START, module)

    def fwd_end(self, t: float, module: str) -> None:
        self._event(t, EventKind.FORWARD_END, module)

    def bwd_start(self, t: float, module: str) -> None:
        self._event(t, EventKind.BACKWARD_START, module)

    def pack(
        self,
        t: float,
        nbytes: int,
        module: str,
        *,
        family: int | None = None,
        param: bool = False,
        in_backward: bool = False,
        rebuild_from: int = -1,
    ) -> int:
        seq = len(self.packs)
        self.packs.append(
            {
                "family": seq if family is None else family,
                "nbytes": nbytes,
                "module": module,
                "param": param,
                "in_backward": in_backward,
                "rebuild_from": rebuild_from,
            }
        )
        self._event(t, EventKind.PACK, module, seq)
        return seq

    def unpack(self, t: float, seq: int) -> None:
        self._event(t, EventKind.UNPACK, self.packs[seq]["module"], seq)

    def build(self, end_s: float) -> Trace:
        self._event(end_s, EventKind.STEP_END)
        events = tuple(
            Event(
                index=i,
                kind=kind,
                step=0,
                time_s=t,
                memory_bytes=0,
                module=module,
                call_index=-1 if kind in (EventKind.STEP_START, EventKind.STEP_END) else 0,
                record=record,
            )
            for i, (t, kind, module, record) in enumerate(self.events)
        )
        records = []
        for seq, p in enumerate(self.packs):
            pack = next(e for e in events if e.kind is EventKind.PACK and e.record == seq)
            unpacks = [e for e in events if e.kind is EventKind.UNPACK and e.record == seq]
            n = p["nbytes"]
            records.append(
                TensorRecord(
                    seq=seq,
                    step=0,
                    family=p["family"],
                    module=p["module"],
                    call_index=0,
                    ordinal=seq,
                    nbytes=n,
                    storage_nbytes=n,
                    storage_offset=0,
                    shape=(n,),
                    stride=(1,),
                    dtype="torch.uint8",
                    device="cpu",
                    is_parameter=p["param"],
                    grad_fn="",
                    in_backward=p["in_backward"],
                    pack_event=pack.index,
                    pack_time_s=pack.time_s,
                    unpack_events=tuple(e.index for e in unpacks),
                    unpack_times_s=tuple(e.time_s for e in unpacks),
                    rebuild_from=p["rebuild_from"],
                )
            )
        trace = Trace(records=tuple(records), events=events)
        live = dict(trace.live_saved_bytes())  # a CPU trace's memory probe
        return dataclasses.replace(
            trace,
            events=tuple(dataclasses.replace(e, memory_bytes=live[e.index]) for e in events),
        )


def _lifo(nbytes: int = 1000) -> Trace:
    """Two modules, one family each, used in reverse order.

    index  0     1     2     3     4     5     6     7     8     9     10    11
    event  start a+    pack0 a-    b+    pack1 b-    bwd b unp1  bwd a unp0  end
    time   0     0     1     2     2     3     4     5     6     7     8     10
    """
    b = _Builder()
    b.fwd_start(0.0, "a")
    f0 = b.pack(1.0, nbytes, "a")
    b.fwd_end(2.0, "a")
    b.fwd_start(2.0, "b")
    f1 = b.pack(3.0, nbytes, "b")
    b.fwd_end(4.0, "b")
    b.bwd_start(5.0, "b")
    b.unpack(6.0, f1)
    b.bwd_start(7.0, "a")
    b.unpack(8.0, f0)
    return b.build(10.0)


def _hw(
    bytes_per_s: float,
    *,
    duplex: float | None = None,
    disk_write: float = 1e12,
    disk_read: float = 1e12,
    h2d: float | None = None,
) -> HardwareModel:
    h2d = bytes_per_s if h2d is None else h2d
    return HardwareModel(
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=bytes_per_s,
        duplex_bytes_per_s=(h2d + bytes_per_s) if duplex is None else duplex,
        disk_write_bytes_per_s=disk_write,
        disk_read_bytes_per_s=disk_read,
    )


IDEAL = _hw(math.inf)


def _check_accounting(sim: Simulation) -> None:
    """What every simulation must satisfy, whatever the placement."""
    waits = sim.stall_s + sim.backpressure_s + sim.recompute_s + sim.rebuild_s + sim.sync_copy_s
    assert sim.step_s == pytest.approx(sim.trace_step_s + waits, rel=1e-9, abs=1e-12)
    times = [t for t, _ in sim.memory_timeline]
    assert times == sorted(times)
    assert sim.memory_timeline[0] == (0.0, sim.base_bytes)
    assert max(b for _, b in sim.memory_timeline) == sim.peak_bytes
    assert min(b for _, b in sim.memory_timeline) >= sim.base_bytes
    assert sim.bytes_reloaded <= sim.bytes_offloaded_cpu + sim.bytes_offloaded_nvme


# -- hand-computed timelines ----------------------------------------------------------------


def test_keep_all_replays_the_trace() -> None:
    sim = simulate(_lifo(), _hw(1000.0))
    assert sim.step_s == sim.trace_step_s == 10.0
    assert sim.peak_bytes == 2000 and sim.base_bytes == 0
    assert (sim.stall_s, sim.stalls, sim.d2h_busy_s, sim.h2d_busy_s) == (0.0, 0, 0.0, 0.0)
    # Bytes leave at the event after their last use (events 9 and 11).
    assert sim.memory_timeline == ((0.0, 0), (1.0, 1000), (3.0, 2000), (7.0, 1000), (10.0, 0))
    _check_accounting(sim)


def test_slow_link_stalls_by_hand() -> None:
    # 500 B/s: each 1000-byte copy takes 2 s. f0 goes out over [1, 3], f1 over [3, 5]. With no
    # look-ahead, f1's reload starts as b's backward starts (5) and lands at 7, one second after
    # its unpack (6); everything after shifts by 1 s, so f0's reload runs [8, 10] against an
    # unpack at 9: another second.
    sim = simulate(_lifo(), _hw(500.0), offload_all(_lifo()), prefetch_bytes=0)
    assert sim.stall_s == pytest.approx(2.0)
    assert sim.stalls == 0  # both were started ahead of use, just not early enough
    assert sim.step_s == pytest.approx(12.0)
    assert sim.d2h_busy_s == pytest.approx(4.0) and sim.h2d_busy_s == pytest.approx(4.0)
    assert sim.bytes_offloaded_cpu == sim.bytes_reloaded == 2000
    assert sim.peak_bytes == 1000  # f0 left before f1 arrived; f1 left before f0 came back
    _check_accounting(sim)


def test_ideal_link_costs_nothing_and_lowers_the_peak() -> None:
    sim = simulate(_lifo(), IDEAL, offload_all(_lifo()), prefetch_bytes=0)
    assert sim.step_s == sim.trace_step_s == 10.0
    assert sim.stall_s == 0.0 and sim.peak_bytes == 1000


def test_unpack_without_reload_is_a_stall() -> None:
    # Reload only at use: the whole copy back is waited for.
    decisions = {
        fid: Decision(placement=CPU, reload_event=unpack) for fid, unpack in ((0, 10), (1, 8))
    }
    sim = simulate(_lifo(), _hw(1000.0), decisions)
    assert sim.stall_s == pytest.approx(2.0)
    assert sim.step_s == pytest.approx(12.0)


def test_unpack_before_copy_out_uses_the_source() -> None:
    # 100 B/s: f0's copy out ends at 11, after both unpacks; nothing comes back, nothing waits,
    # and the bytes never left.
    sim = simulate(_lifo(), _hw(100.0), offload_all(_lifo()))
    assert sim.bytes_reloaded == 0 and sim.h2d_busy_s == 0.0
    assert sim.step_s == 10.0 and sim.stall_s == 0.0
    assert sim.peak_bytes == 2000
    _check_accounting(sim)


def test_backpressure_waits_for_the_oldest_copy() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    f0 = b.pack(1.0, 1000, "a")
    f1 = b.pack(1.5, 1000, "a")
    b.fwd_end(2.0, "a")
    b.bwd_start(5.0, "a")
    b.unpack(6.0, f1)
    b.unpack(6.0, f0)
    trace = b.build(8.0)
    tight = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes=1000)
    assert tight.backpressure_s == pytest.approx(0.5)  # f0's copy [1, 2] blocks f1's pack at 1.5
    loose = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes="2KB")
    assert loose.backpressure_s == 0.0
    # One copy larger than the bound still goes (it waits only for what is in flight).
    alone = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes=1)
    assert alone.backpressure_s == pytest.approx(0.5)
    for sim in (tight, loose, alone):
        _check_accounting(sim)


def test_duplex_cap_applies_only_when_both_directions_are_busy() -> None:
    trace = _lifo()
    # f0's reload starts at f1's pack (event 5, t=3), while f1 goes out: both busy over [3, ...].
    overlap = {0: Decision(placement=CPU, reload_event=5), 1: Decision(placement=CPU)}
    free = simulate(trace, _hw(1000.0, duplex=2000.0), overlap)
    capped = simulate(trace, _hw(1000.0, duplex=1000.0), overlap)
    # Uncapped both copies take 1 s; capped each gets half of 1000 B/s and takes 2 s.
    assert free.d2h_busy_s == pytest.approx(2.0) and free.h2d_busy_s == pytest.approx(2.0)
    assert capped.d2h_busy_s == pytest.approx(3.0) and capped.h2d_busy_s == pytest.approx(3.0)
    # Without overlap the cap changes nothing at all.
    apart = offload_all(trace)
    assert simulate(trace, _hw(1000.0, duplex=2000.0), apart) == simulate(
        trace, _hw(1000.0, duplex=1000.0), apart
    )


def test_nvme_is_slower_than_cpu_and_frees_the_device_at_pcie_speed() -> None:
    trace = _lifo()
    hw = _hw(1000.0, disk_write=250.0, disk_read=250.0)
    cpu = simulate(trace, hw, offload_all(trace, tier=CPU), prefetch_bytes=0)
    nvme = simulate(trace, hw, offload_all(trace, tier="nvme"), prefetch_bytes=0)
    assert nvme.step_s > cpu.step_s and nvme.stall_s > cpu.stall_s
    assert nvme.disk_write_busy_s == pytest.approx(8.0)
    assert nvme.disk_read_busy_s == pytest.approx(8.0)
    assert nvme.bytes_offloaded_nvme == 2000 and nvme.bytes_offloaded_cpu == 0
    # Device bytes go when D2H completes (pinned staging), not when the disk finishes.
    assert nvme.memory_timeline[:4] == ((0.0, 0), (1.0, 1000), (2.0, 0), (3.0, 1000))
    _check_accounting(nvme)


def test_copies_on_the_compute_thread_add_their_time() -> None:
    hw = HardwareModel.cpu_only(
        copy_bytes_per_s=1000.0, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    sim = simulate(_lifo(), hw, offload_all(_lifo()), prefetch_bytes=0)
    assert sim.sync_copy_s == pytest.approx(4.0)  # two copies out, two back, 1 s each
    assert sim.step_s == pytest.approx(14.0) and sim.stall_s == 0.0
    _check_accounting(sim)


def _with_block() -> Trace:
    """Under the root "": a block "blk" (forward 1..4) holding f0 and, in "blk.inner" (1.8..2.5),
    the big f1; then a head that saves f2; backward in reverse."""
    b = _Builder()
    b.fwd_start(0.5, "")
    b.fwd_start(1.0, "blk")
    f0 = b.pack(1.5, 1000, "blk")
    b.fwd_start(1.8, "blk.inner")
    f1 = b.pack(2.0, 4000, "blk.inner")
    b.fwd_end(2.5, "blk.inner")
    b.fwd_end(4.0, "blk")
    b.fwd_start(4.5, "head")
    f2 = b.pack(5.0, 2000, "head")
    b.fwd_end(5.5, "head")
    b.fwd_end(5.6, "")
    b.bwd_start(5.8, "head")
    b.unpack(6.0, f2)
    b.bwd_start(7.0, "blk")
    b.unpack(8.0, f1)
    b.unpack(9.0, f0)
    return b.build(10.0)


def test_recompute_costs_the_module_forward_and_frees_its_bytes() -> None:
    trace = _with_block()
    keep = simulate(trace, IDEAL)
    assert keep.peak_bytes == 7000
    own = simulate(trace, IDEAL, {1: RECOMPUTE})
    assert own.recompute_s == pytest.approx(0.7)  # blk.inner's forward
    assert own.step_s == pytest.approx(10.7)
    assert own.bytes_recomputed == 4000
    # f1 is gone in forward (peak 1000 + 2000) and back at its unpack, after f2 left.
    assert own.peak_bytes == 5000
    whole = simulate(
        trace,
        IDEAL,
        {i: Decision(placement=RECOMPUTE, recompute_module="blk") for i in (0, 1)},
    )
    assert whole.recompute_s == pytest.approx(3.0)  # blk's forward, once for both families
    assert whole.peak_bytes == 5000
    for sim in (own, whole):
        _check_accounting(sim)


def test_checkpoint_blocks_keeps_each_block_input() -> None:
    decisions = checkpoint_blocks(_with_block())
    assert decisions == {
        0: Decision(placement=KEEP),
        1: Decision(placement=RECOMPUTE, recompute_module="blk"),
    }


# -- rebuilding an activation output from its input -------------------------------------------


def _gelu(**pack_kwargs: int) -> Trace:
    """An activation "act" saves its input h (f0); "fc2" saves act's output g (f1), which the
    trace links to h (``rebuild_from``). Backward reaches g (fc2's backward) before h.

    index  0     1     2     3     4     5     6     7      8     9      10    11
    event  start act+  pack0 act-  fc2+  pack1 fc2-  bwd fc2 unp1 bwd act unp0  end
    time   0     0     1     1.5   1.5   2     3     5      6     7      8     10
    """
    b = _Builder()
    b.fwd_start(0.0, "act")
    h = b.pack(1.0, 1000, "act")
    b.fwd_end(1.5, "act")
    b.fwd_start(1.5, "fc2")
    g = b.pack(2.0, 1000, "fc2", rebuild_from=h, **pack_kwargs)
    b.fwd_end(3.0, "fc2")
    b.bwd_start(5.0, "fc2")
    b.unpack(6.0, g)
    b.bwd_start(7.0, "act")
    b.unpack(8.0, h)
    return b.build(10.0)


def _pointwise(hw: HardwareModel, bytes_per_s: float = 2000.0) -> HardwareModel:
    """``hw`` with an elementwise rate; at 2000 B/s a 1000-byte rebuild from 1000 bytes takes 1 s."""
    return dataclasses.replace(hw, pointwise_bytes_per_s=bytes_per_s)


def _links(trace: Trace) -> dict[int, int]:
    """``{family: parent family}`` for every family whose records the trace links to a parent
    that is not linked itself (a LayerNorm of a GELU output: only the LayerNorm's output, as
    the planner chooses; a rebuild reads a stored parent)."""
    links = {
        r.family: trace.records[r.rebuild_from].family for r in trace.records if r.rebuild_from >= 0
    }
    return {c: p for c, p in links.items() if p not in links}


def test_rebuild_from_a_kept_parent_costs_one_kernel() -> None:
    trace = _gelu()
    hw = _pointwise(IDEAL)
    keep = simulate(trace, hw)
    assert keep.memory_timeline == ((0.0, 0), (1.0, 1000), (2.0, 2000), (7.0, 1000), (10.0, 0))
    sim = simulate(trace, hw, {1: REBUILD})
    assert sim.rebuild_s == pytest.approx(1.0)  # (1000 + 1000) bytes at 2000 B/s
    assert sim.step_s == pytest.approx(11.0)
    assert sim.bytes_rebuilt == 1000 and sim.bytes_recomputed == 0
    assert (sim.stall_s, sim.stalls, sim.bytes_reloaded, sim.h2d_busy_s) == (0.0, 0, 0, 0.0)
    # g is held at its pack (fc2's forward uses it), gone from the next event (t=3), back when
    # its rebuild starts at its unpack (t=6) and freed after its last use (event 9, now at t=8).
    assert sim.memory_timeline == (
        (0.0, 0),
        (1.0, 1000),
        (2.0, 2000),
        (3.0, 1000),
        (6.0, 2000),
        (8.0, 1000),
        (11.0, 0),
    )
    _check_accounting(sim)


@pytest.mark.parametrize("tier", [CPU, NVME])
def test_rebuild_waits_for_its_parents_reload(tier: Placement) -> None:
    trace = _gelu()
    hw = _pointwise(_hw(1000.0))  # 1 s per copy
    # No look-ahead: h's reload starts as the backward of fc2 (which saved its rebuilt child)
    # starts (t=5), not as act's (t=7), and lands at 6, as the rebuild needs it.
    sim = simulate(trace, hw, {0: tier, 1: REBUILD}, prefetch_bytes=0)
    assert sim.stalls == 0 and sim.stall_s == pytest.approx(0.0, abs=1e-6)
    assert sim.rebuild_s == pytest.approx(1.0) and sim.step_s == pytest.approx(11.0)
    assert sim.bytes_reloaded == 1000 and sim.h2d_busy_s == pytest.approx(1.0)
    if tier is CPU:
        # h leaves when its copy out ends (t=2); it is back from its reload's start (t=5) to its
        # own unpack, after g's rebuild (t=6 to event 9, now at t=8).
        assert sim.memory_timeline == (
            (0.0, 0),
            (1.0, 1000),
            (2.0, 0),
            (2.0, 1000),
            (3.0, 0),
            (5.0, 1000),
            (6.0, 2000),
            (8.0, 1000),
            (11.0, 0),
        )
    # A reload planned only for h's own unpack (event 10): the rebuild starts it, a counted stall.
    late = simulate(trace, hw, {0: Decision(placement=tier, reload_event=10), 1: REBUILD})
    assert late.stalls == 1 and late.stall_s == pytest.approx(1.0, abs=1e-6)
    assert late.rebuild_s == pytest.approx(1.0) and late.step_s == pytest.approx(12.0, abs=1e-6)
    assert late.bytes_reloaded == 1000  # h's own unpack finds it there
    # A slow link: h's reload runs [5, 7]; the rebuild waits for it, then runs [7, 8].
    slow = simulate(trace, _pointwise(_hw(500.0)), {0: tier, 1: REBUILD}, prefetch_bytes=0)
    assert slow.stalls == 0 and slow.stall_s == pytest.approx(1.0, abs=1e-6)
    assert slow.step_s == pytest.approx(12.0, abs=1e-6)
    for s in (sim, late, slow):
        _check_accounting(s)


def test_window_walks_last_packed_first_as_the_executor_does() -> None:
    # A dropout between act and fc2 saves a mask m, unpacked between g (rebuilt from h) and h.
    # The executor's window walks its step's families last packed first (it has no trace to
    # know that g's rebuild needs h first), so the simulator does too.
    b = _Builder()
    b.fwd_start(0.0, "act")
    h = b.pack(1.0, 1000, "act")
    b.fwd_end(1.0, "act")
    b.fwd_start(1.0, "drop")
    m = b.pack(1.5, 1000, "drop")
    b.fwd_end(2.0, "drop")
    b.fwd_start(2.0, "fc2")
    g = b.pack(2.5, 1000, "fc2", rebuild_from=h)
    b.fwd_end(3.0, "fc2")
    b.bwd_start(4.0, "")  # backward begins: the window's first walk
    b.bwd_start(6.0, "fc2")
    b.unpack(6.0, g)
    b.bwd_start(7.0, "drop")
    b.unpack(7.0, m)
    b.bwd_start(8.0, "act")
    b.unpack(8.0, h)
    trace = b.build(9.0)
    # A window of one family: at t=4 it takes m (packed last), back over [4, 5], not h. h's
    # reload starts at fc2's backward (the call that saved its rebuilt child), over [6, 7]: the
    # rebuild at t=6 waits 1 s for it (requested, so not a counted stall).
    sim = simulate(
        trace, _pointwise(_hw(1000.0)), {h: CPU, m: CPU, g: REBUILD}, prefetch_bytes=1000
    )
    assert sim.stall_s == pytest.approx(1.0) and sim.stalls == 0
    assert sim.step_s == pytest.approx(11.0)
    _check_accounting(sim)


def test_rebuild_needs_one_kept_or_moved_parent_of_the_step() -> None:
    b = _Builder()
    b.fwd_start(0.0, "m")
    w = b.pack(0.5, 1000, "m", param=True)
    a = b.pack(1.0, 1000, "m")
    child = b.pack(2.0, 1000, "m", rebuild_from=a)
    grandchild = b.pack(3.0, 1000, "m", rebuild_from=child)
    b.pack(4.0, 1000, "m", family=10, rebuild_from=a)
    b.pack(4.5, 1000, "m", family=10, rebuild_from=child)
    of_weight = b.pack(6.0, 1000, "m", rebuild_from=w)
    b.fwd_end(7.0, "m")
    b.bwd_start(8.0, "m")
    for seq in reversed(range(len(b.packs))):
        b.unpack(9.0, seq)
    trace = b.build(10.0)
    bad = {
        "family 1 cannot be rebuilt: its record 1 has no rebuild_from link": {a: REBUILD},
        "family 2 cannot be rebuilt: its parent family 1 is placed 'recompute'": {
            a: RECOMPUTE,
            child: REBUILD,
        },
        "family 3 cannot be rebuilt: its parent family 2 is placed 'rebuild'": {
            child: REBUILD,
            grandchild: REBUILD,
        },
        r"family 10 cannot be rebuilt: its records link to several families \[1, 2\]": {
            10: REBUILD
        },
        "family 6 cannot be rebuilt: its record 6 links to record 0, which is not an activation "
        "record of step 0": {of_weight: REBUILD},
    }
    for message, placements in bad.items():
        with pytest.raises(ValueError, match=message):
            simulate(trace, IDEAL, placements)
    # A rebuilt family's child can be kept, and a rebuild's parent moved.
    ok = simulate(trace, IDEAL, {a: CPU, child: REBUILD, grandchild: KEEP})
    assert ok.bytes_rebuilt == 1000 and ok.bytes_offloaded_cpu == 1000
    _check_accounting(ok)


def test_keep_all_peak_is_the_traced_peak_with_memory_outside_saved_tensors() -> None:
    # A GPU-like probe: base 10_000, plus a transient of 500 while "b" runs, plus saved bytes.
    trace = _lifo()
    live = dict(trace.live_saved_bytes())
    in_b = {4, 5, 6}
    events = tuple(
        dataclasses.replace(
            e, memory_bytes=10_000 + live[e.index] + (500 if e.index in in_b else 0)
        )
        for e in trace.events
    )
    trace = dataclasses.replace(trace, events=events)
    keep = simulate(trace, IDEAL)
    assert keep.base_bytes == 10_000
    assert keep.peak_bytes == trace.peak_memory_bytes == 12_500
    moved = simulate(trace, IDEAL, offload_all(trace), prefetch_bytes=0)
    assert moved.peak_bytes == 11_500  # the transient stays; one family at a time


def test_never_unpacked_family_is_not_reloaded() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    b.pack(1.0, 1000, "a")
    b.fwd_end(2.0, "a")
    trace = b.build(5.0)
    sim = simulate(trace, _hw(1000.0), offload_all(trace))
    assert sim.bytes_reloaded == 0 and sim.h2d_busy_s == 0.0
    assert sim.memory_timeline == ((0.0, 0), (1.0, 1000), (2.0, 0))


def test_alias_family_moves_once_and_is_started_by_any_members_module() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    first = b.pack(1.0, 1000, "a", family=7)
    b.fwd_end(2.0, "a")
    b.fwd_start(2.0, "b")
    second = b.pack(3.0, 1000, "b", family=7)
    b.fwd_end(4.0, "b")
    b.bwd_start(5.0, "b")  # b packed a member: its backward starts the family's reload
    b.unpack(6.0, second)
    b.unpack(8.0, first)
    trace = b.build(10.0)
    sim = simulate(trace, _hw(1000.0), {7: CPU}, prefetch_bytes=0)
    assert sim.bytes_offloaded_cpu == sim.bytes_reloaded == 1000
    assert sim.stalls == 0 and sim.stall_s == 0.0


def test_bandwidth_ladder_on_a_synthetic_trace_is_monotone() -> None:
    trace = _with_block()
    steps = [
        simulate(trace, _hw(bw), offload_all(trace), max_inflight_bytes=0).step_s
        for bw in (1e6, 1e4, 3e3, 1e3, 3e2)
    ]
    assert steps == sorted(steps) and steps[-1] > steps[0]


# -- errors ---------------------------------------------------------------------------------


def test_bad_arguments_name_the_argument() -> None:
    trace = _lifo()
    with pytest.raises(TypeError, match="hardware"):
        simulate(trace, "h200")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trace"):
        simulate(object(), IDEAL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="placements"):
        simulate(trace, IDEAL, [CPU])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="family 99"):
        simulate(trace, IDEAL, {99: CPU})
    with pytest.raises(ValueError, match=r"placements\[0\].*placement must be one of"):
        simulate(trace, IDEAL, {0: "disk"})
    with pytest.raises(ValueError, match="step"):
        simulate(trace, IDEAL, step=1)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        simulate(trace, IDEAL, max_inflight_bytes=-1)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        simulate(trace, IDEAL, prefetch_bytes="lots")
    with pytest.raises(ValueError, match="reload_event=9"):
        simulate(trace, IDEAL, {1: Decision(placement=CPU, reload_event=9)})  # after its unpack
    with pytest.raises(ValueError, match="tier"):
        offload_all(trace, tier="keep")


def test_decisions_reject_fields_that_do_not_apply() -> None:
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=KEEP, reload_event=3)
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=CPU, reload_event=-2)
    with pytest.raises(ValueError, match="recompute_module"):
        Decision(placement=CPU, recompute_module="blk")
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=REBUILD, reload_event=3)  # a rebuild is never copied
    assert Decision(placement="nvme").placement is NVME  # type: ignore[arg-type]


def test_parameters_and_backward_packs_can_only_be_kept() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    w = b.pack(1.0, 1000, "a", param=True)
    b.fwd_end(2.0, "a")
    b.bwd_start(3.0, "a")
    again = b.pack(3.5, 1000, "a", in_backward=True)
    b.unpack(4.0, again)
    b.unpack(4.0, w)
    trace = b.build(5.0)
    with pytest.raises(ValueError, match="not an activation family"):
        simulate(trace, IDEAL, {w: CPU})
    with pytest.raises(ValueError, match="backward"):
        simulate(trace, IDEAL, {again: CPU})
    assert offload_all(trace) == {}
    assert simulate(trace, IDEAL).peak_bytes == 1000  # the backward pack counts; the weight not


def test_recompute_needs_an_enclosing_forward() -> None:
    b = _Builder()
    f = b.pack(1.0, 1000, "<outside>")
    b.unpack(2.0, f)
    trace = b.build(3.0)
    with pytest.raises(ValueError, match="no forward of '<outside>'"):
        simulate(trace, IDEAL, {f: RECOMPUTE})
    with pytest.raises(ValueError, match="'nowhere'"):
        simulate(trace, IDEAL, {f: Decision(placement=RECOMPUTE, recompute_module="nowhere")})


# -- the hardware model ---------------------------------------------------------------------


def test_hardware_presets() -> None:
    h200 = HardwareModel.h200()
    assert (h200.h2d_bytes_per_s, h200.d2h_bytes_per_s, h200.duplex_bytes_per_s) == (
        54.5e9,
        55.2e9,
        84.6e9,
    )
    assert h200.source == "assumed" and h200.copies_overlap_compute
    cpu = HardwareModel.cpu_only(
        copy_bytes_per_s=8e9,
        disk_write_bytes_per_s=1e9,
        disk_read_bytes_per_s=2e9,
        source="measured",
    )
    assert not cpu.copies_overlap_compute and cpu.source == "measured"


@pytest.mark.parametrize(
    "hw",
    [
        HardwareModel.h200(),
        HardwareModel.cpu_only(
            copy_bytes_per_s=8e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9
        ),
        IDEAL,
    ],
    ids=["h200", "cpu_only", "ideal"],
)
def test_hardware_json_round_trip(tmp_path, hw: HardwareModel) -> None:
    path = tmp_path / "hw.json"
    hw.save(path)
    assert HardwareModel.load(path) == hw

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(path.read_text(), parse_constant=no_constants)  # strict JSON (no Infinity)
    assert data["format"] == "offload.hardware" and data["schema_version"] == 1


def test_hardware_load_rejects_other_files(tmp_path) -> None:
    good = HardwareModel.h200().to_dict()
    cases = {
        "trace": _lifo().to_dict(),
        "version": {**good, "schema_version": 99},
        "unknown": {**good, "pcie_lanes": 16},
        "missing": {k: v for k, v in good.items() if k != "h2d_bytes_per_s"},
        "type": {**good, "d2h_bytes_per_s": "fast"},
        "text_type": {**good, "link": 5},
    }
    messages = {
        "trace": "not an offload hardware model",
        "version": "schema_version 99",
        "unknown": "pcie_lanes",
        "missing": "h2d_bytes_per_s",
        "type": "d2h_bytes_per_s",
        "text_type": "link",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=messages[name]):
            HardwareModel.load(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        HardwareModel.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        HardwareModel.load(tmp_path / "absent.json")


def test_hardware_validation_names_the_field() -> None:
    base = HardwareModel.h200().to_dict()
    del base["format"], base["schema_version"]
    bad = {
        "h2d_bytes_per_s": 0,
        "d2h_bytes_per_s": -1.0,
        "duplex_bytes_per_s": math.nan,
        "disk_write_bytes_per_s": True,
        "disk_read_bytes_per_s": "6.8e9",
        "pinned_alloc_s_per_byte": -1e-9,
        "pointwise_bytes_per_s": 0.0,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            HardwareModel(**{**base, name: value})
    with pytest.raises(ValueError, match=r"duplex_bytes_per_s must be math\.inf"):
        HardwareModel(**{**base, "h2d_bytes_per_s": math.inf})
    with pytest.raises(TypeError, match="device_name"):
        HardwareModel(**{**base, "device_name": 3})
    with pytest.raises(TypeError, match="copies_overlap_compute"):
        HardwareModel(**{**base, "copies_overlap_compute": "yes"})
    with pytest.raises(TypeError):
        HardwareModel(1e9, 1e9, 1e9, 1e9, 1e9)  # type: ignore[misc]  # keyword-only


# -- real traces ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    out = {}
    for name, factory in ALL_MODELS.items():
        case = factory(seed=0)
        out[name] = offload.profile(case.step, case.model)
    return out


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_keep_all_predicts_the_traced_peak(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    sim = simulate(trace, HardwareModel.h200())
    assert sim.peak_bytes == sim.base_bytes + trace.peak_saved_bytes
    assert sim.stall_s == 0.0 and sim.stalls == 0
    assert sim.step_s == sim.trace_step_s
    _check_accounting(sim)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_ideal_link_offload_all_costs_nothing(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    keep = simulate(trace, IDEAL)
    for window in (0, None):
        sim = simulate(trace, IDEAL, offload_all(trace, rebuild=False), prefetch_bytes=window)
        assert sim.step_s == pytest.approx(keep.step_s, rel=1e-12)
        assert sim.stall_s == 0.0
        assert sim.peak_bytes <= keep.peak_bytes
        _check_accounting(sim)
    jit = simulate(trace, IDEAL, offload_all(trace, rebuild=False), prefetch_bytes=0)
    if len(offload_all(trace, rebuild=False)) > 1:
        assert jit.peak_bytes < keep.peak_bytes


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_no_placement_predicts_more_than_keeping_everything(
    traces: dict[str, Trace], name: str
) -> None:
    # A moved, recomputed or rebuilt family holds device bytes over a part of its kept life, never
    # more; a rebuild's parent, kept or moved, is needed no longer than it is used itself.
    trace = traces[name]
    keep = simulate(trace, IDEAL).peak_bytes
    for hw in (HardwareModel.h200(), _hw(1e8), _hw(1e6, duplex=1e6)):
        for placements in (
            offload_all(trace),
            offload_all(trace, tier=NVME),
            checkpoint_blocks(trace),
            {**offload_all(trace), **dict.fromkeys(_links(trace), REBUILD)},
        ):
            for inflight in (0, None):
                sim = simulate(trace, hw, placements, max_inflight_bytes=inflight)
                assert sim.peak_bytes <= keep
                _check_accounting(sim)


LADDER = (1e11, 1e10, 1e9, 1e8, 1e7, 1e6)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_step_time_grows_as_the_reload_link_slows(traces: dict[str, Trace], name: str) -> None:
    # Copies out are instant here, so every family is reloaded, and only the reload link varies.
    trace = traces[name]
    sims = [
        simulate(trace, _hw(math.inf, h2d=bw, duplex=math.inf), offload_all(trace)) for bw in LADDER
    ]
    steps = [s.step_s for s in sims]
    assert steps == sorted(steps)
    assert sims[-1].stall_s > 0 and sims[-1].step_s > sims[-1].trace_step_s


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_step_time_grows_as_the_link_slows(traces: dict[str, Trace], name: str) -> None:
    # Both directions slow. A family whose copy out has not completed when backward needs it
    # takes its source back and is not reloaded (docs/design.md, stream ordering rule 3): on a slower link
    # that can save a reload, so monotonicity holds between rungs that reloaded the same bytes.
    trace = traces[name]
    sims = [simulate(trace, _hw(bw), offload_all(trace), max_inflight_bytes=0) for bw in LADDER]
    for fast, slow in itertools.pairwise(sims):
        if fast.bytes_reloaded == slow.bytes_reloaded:
            assert slow.step_s >= fast.step_s
    assert sims[-1].step_s > sims[-1].trace_step_s
    assert sims[-1].stall_s > 0 or sims[-1].backpressure_s > 0


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_more_room_never_predicts_a_slower_step(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    moved = offload_all(trace)
    for bw in (1e9, 1e7):
        # A larger look-ahead window. Copies out are instant: with a family still going out when
        # backward begins, a larger window can queue later families ahead of its reload (NOTE
        # [ Reload policy ]; test_window_can_queue_ahead_of_a_family_still_going_out), and so
        # can a walk last packed first where backward needs families in another order (the LSTM
        # op's saved tensors).
        hw = _hw(math.inf, h2d=bw, duplex=math.inf)
        by_window = [
            simulate(trace, hw, moved, prefetch_bytes=w).step_s
            for w in (0, 4 << 10, 64 << 10, 1 << 20, 1 << 30)
        ]
        if _needed_last_packed_first(trace, moved):
            assert by_window == sorted(by_window, reverse=True)
        # A larger in-flight bound, both directions slow.
        by_inflight = [
            simulate(trace, _hw(bw), moved, max_inflight_bytes=n, prefetch_bytes=0).step_s
            for n in (0, 16 << 10, 256 << 10, 1 << 30)
        ]
        assert by_inflight == sorted(by_inflight, reverse=True)


def _needed_last_packed_first(trace: Trace, placements: dict[int, Decision]) -> bool:
    """Whether backward first needs the moved families of ``placements`` (a rebuilt one's
    parent at the rebuild) in the order the window walks them: last packed first."""
    need = {}
    for r in trace.records:
        d = placements.get(r.family)
        if d is None or not r.unpack_events:
            continue
        fam = r.family
        if d.placement is REBUILD:
            fam = trace.records[r.rebuild_from].family
        need[fam] = min(need.get(fam, r.unpack_events[0]), r.unpack_events[0])
    first_pack = {f.family: f.first_pack_event for f in trace.families()}
    walk = sorted(need, key=first_pack.__getitem__, reverse=True)
    return walk == sorted(need, key=need.__getitem__)


def test_window_can_queue_ahead_of_a_family_still_going_out() -> None:
    # The executor's behaviour, modelled as it is: f1 (needed first) is still going out when
    # backward begins; a window that reaches f0 queues f0's reload before f1's can start.
    b = _Builder()
    b.fwd_start(0.0, "a")
    f0 = b.pack(1.0, 1000, "a")
    b.fwd_end(2.0, "a")
    b.fwd_start(3.0, "b")
    f1 = b.pack(4.0, 1000, "b")
    b.fwd_end(4.0, "b")
    b.bwd_start(4.5, "b")
    b.unpack(6.0, f1)
    b.bwd_start(6.5, "a")
    b.unpack(8.0, f0)
    trace = b.build(9.0)
    # 1000 B/s: f0 out over [1, 2], f1 over [4, 5]; backward begins at 4.5.
    small = simulate(trace, _hw(1000.0), offload_all(trace), prefetch_bytes=1000)
    large = simulate(trace, _hw(1000.0), offload_all(trace), prefetch_bytes=2000)
    # Small window: f1 (deferred to 5) comes back over [5, 6]; f0 over [6.5, 7.5]: in time.
    assert small.stall_s == 0.0
    # Large window: f0 comes back over [4.5, 5.5], f1 only over [5.5, 6.5]: half a second late.
    assert large.stall_s == pytest.approx(0.5)


def test_checkpoint_blocks_on_a_transformer_block(traces: dict[str, Trace]) -> None:
    trace = traces["gpt_block"]
    decisions = checkpoint_blocks(trace)
    assert {d.recompute_module for d in decisions.values()} == {"", "attn", "mlp"}
    sim = simulate(trace, IDEAL, decisions)
    spans = {s.module: s for s in trace.module_spans() if s.phase == "forward"}
    assert sim.recompute_s == pytest.approx(spans["attn"].duration_s + spans["mlp"].duration_s)
    assert sim.step_s == pytest.approx(sim.trace_step_s + sim.recompute_s)
    assert sim.bytes_recomputed > 0
    assert sim.peak_bytes < simulate(trace, IDEAL).peak_bytes
    _check_accounting(sim)


def _lines_run(fn: Callable[[], object], module: ModuleType) -> int:
    """How many lines of ``module``'s source ``fn()`` executes: a measure of work that, unlike a
    clock, is the same on every run."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        nonlocal count
        if frame.f_code.co_filename != module.__file__:
            return None
        count += event == "line"
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_checkpoint_blocks_work_grows_with_the_step_not_blocks_times_families() -> None:
    """Each block's families are cut from one sorted list: a scan of every family per block
    made predict_anchors quadratic (25 of its 37 s at 40k records, profiled)."""
    from offload.lifecycle import _anchors as simulator

    work = {}
    for layers in (16, 64):
        trace = transformer_trace(layers=layers, hidden=256, tokens=512)
        decisions = checkpoint_blocks(trace)  # the step's view is built here, once
        assert sum(d.placement is KEEP for d in decisions.values()) == layers  # each block's input
        work[layers] = _lines_run(lambda t=trace: checkpoint_blocks(t), simulator)
    # 4x the layers (blocks and families alike): linear work is 4x; the scan made it 10.4x.
    assert work[64] <= 4.5 * work[16], work


def test_anchors_and_step_choice() -> None:
    case = gpt_block(seed=0)
    trace = offload.profile(case.step, case.model, steps=2)
    hw = HardwareModel.h200()
    anchors = predict_anchors(trace, hw, step=0)
    assert list(anchors) == ["keep_all", "offload_all", "checkpoint_blocks"]
    assert anchors["offload_all"] == simulate(trace, hw, offload_all(trace, step=0), step=0)
    first, last = simulate(trace, hw, step=0), simulate(trace, hw)
    assert last == simulate(trace, hw, step=1)
    assert first.peak_bytes == last.peak_bytes  # same model, same sizes
    with pytest.raises(ValueError, match="family"):
        simulate(trace, hw, offload_all(trace, step=0), step=1)  # step 0's families


def test_rebuilding_a_gelu_output_lowers_the_peak_where_it_was_gone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
    )
    x = torch.randn(32, 64)
    trace = offload.profile(lambda: model(x).sum().backward(), model)
    links = _links(trace)
    assert len(links) == 2  # each GELU's output, from the input that GELU saved
    families = {f.family: f for f in trace.families()}
    first, last = sorted(links, key=lambda f: families[f].first_pack_event)
    span = {f: families[f].span_bytes for f in families}
    hw = HardwareModel.h200()
    keep = simulate(trace, hw)
    # The peak is the second block's forward end, where the first GELU output is no longer needed
    # until backward; the second is saved right there (its pack event), so it stays at the peak.
    assert simulate(trace, hw, {first: REBUILD}).peak_bytes == keep.peak_bytes - span[first]
    assert simulate(trace, hw, {last: REBUILD}).peak_bytes == keep.peak_bytes
    both = simulate(trace, hw, dict.fromkeys(links, REBUILD))
    assert both.peak_bytes == keep.peak_bytes - span[first]
    # Parents kept: the step is the trace plus one elementwise kernel per rebuilt family.
    cost = sum(span[c] + span[p] for c, p in links.items()) / hw.pointwise_bytes_per_s
    assert both.rebuild_s == pytest.approx(cost, rel=1e-12)
    assert both.step_s == pytest.approx(keep.step_s + cost, rel=1e-12)
    assert both.bytes_rebuilt == span[first] + span[last]
    assert both.stall_s == 0.0 and both.bytes_reloaded == 0
    _check_accounting(both)


def _linked_transformer(layers: int) -> Trace:
    """transformer_trace with only each layer's GELU output (saved by mlp.fc2) linked to its
    input (saved by mlp.act): its LayerNorm outputs' links dropped."""
    trace = transformer_trace(layers=layers, hidden=256, tokens=512)
    act = {
        r.module.removesuffix(".mlp.act"): r.seq
        for r in trace.records
        if r.module.endswith(".mlp.act")
    }
    records = tuple(
        dataclasses.replace(
            r,
            rebuild_from=act[r.module.removesuffix(".mlp.fc2")]
            if r.module.endswith(".mlp.fc2")
            else -1,
        )
        for r in trace.records
    )
    return dataclasses.replace(trace, records=records)


def test_rebuild_on_a_transformer_trace() -> None:
    layers = 3
    trace = _linked_transformer(layers)
    links = _links(trace)
    assert len(links) == layers
    gelu_out = 4 * 512 * 256 * 2  # bytes of one [tokens, 4h] bf16 activation
    hw = _pointwise(IDEAL, 4.0e12)
    keep = simulate(trace, hw)
    rebuilt = dict.fromkeys(links, REBUILD)
    sim = simulate(trace, hw, rebuilt)
    # At forward's end (the keep-all peak) every GELU output is gone; backward rebuilds the last
    # layer's first, while the others are still gone.
    assert sim.peak_bytes == keep.peak_bytes - (layers - 1) * gelu_out
    assert sim.rebuild_s == pytest.approx(layers * 2 * gelu_out / 4.0e12, rel=1e-12)
    assert sim.step_s == pytest.approx(keep.step_s + sim.rebuild_s, rel=1e-12)
    # Parents on the host, reloaded by the default policy on an instant link: nothing waits.
    moved = simulate(trace, hw, {**rebuilt, **dict.fromkeys(links.values(), CPU)}, prefetch_bytes=0)
    assert moved.stalls == 0 and moved.step_s == pytest.approx(sim.step_s, rel=1e-12)
    assert moved.bytes_reloaded == layers * gelu_out
    # Reloads planned only for the parents' own unpacks: each rebuild starts one, a counted stall.
    parents = [trace.records[r.rebuild_from] for r in trace.records if r.rebuild_from >= 0]
    late = {p.family: Decision(placement=CPU, reload_event=p.unpack_events[0]) for p in parents}
    assert simulate(trace, hw, {**rebuilt, **late}).stalls == layers
    for s in (sim, moved):
        _check_accounting(s)


def test_simulations_of_one_trace_share_its_step_view_and_leave_no_cycles() -> None:
    """Every simulation of a step reads one view of it, built once per trace; a finished
    simulation's state is freed by reference counting (its copy jobs call back into it: the
    cycles are broken at the end), so no full collection has to walk the trace for it."""
    import gc

    from offload.lifecycle._sim_step import _StepView

    trace = _linked_transformer(3)
    hw = _pointwise(HardwareModel.h200(), 4.0e12)
    links = _links(trace)
    mixed = {
        **offload_all(trace),
        **dict.fromkeys(links, REBUILD),
        **dict.fromkeys(links.values(), NVME),
    }
    assert _StepView.of(trace, 0) is _StepView.of(trace, 0)
    first = [simulate(trace, hw, d) for d in (None, mixed, offload_all(trace, tier="nvme"))]
    # Until nothing is left: a collection can run callbacks that free more (an earlier test's
    # closed offload manager was found on a second one), which this test must not count.
    while gc.collect():
        pass
    gc.disable()
    try:
        again = [simulate(trace, hw, d) for d in (None, mixed, offload_all(trace, tier="nvme"))]
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert again == first
    assert unreachable == 0
    assert first[1].bytes_reloaded > 0 and first[1].rebuild_s > 0  # copies and rebuilds ran


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector(enabled: bool) -> None:
    import gc

    from offload.lifecycle._nogc import gc_paused

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_reload_lives_for_one_backward_of_a_step_with_two() -> None:
    """Two backwards of one graph in a step: the k-th unpack of a record is backward pass k, and
    a reload dies after its family's last unpack of a pass (NOTE [ Backward passes ]). The
    simulator held each reload to its last use in the second backward: offloading everything
    peaked at 524,288 B, 8 of the 9 families of 65,536 B, back by the end of the first backward.
    Now it peaks as a single backward does, at 196,608."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
    x = torch.randn(64, 256)

    def step(twice: bool) -> None:
        y = model(x)
        y.pow(2).mean().backward(retain_graph=twice)
        if twice:
            y.sum().backward()

    hw = HardwareModel.h200()
    two = offload.profile(lambda: step(True), model, warmup_steps=0)
    one = offload.profile(lambda: step(False), model, warmup_steps=0)
    peaks = [simulate(t, hw, offload_all(t, rebuild=False)).peak_bytes for t in (one, two)]
    assert peaks == [196_608, 196_608]
    # Where each pass-0 trigger fires again in the second backward: an unpack at its record's
    # second unpack, a module's backward start right after the unpack before that one.
    from offload.lifecycle._trace import BackwardPasses

    passes = BackwardPasses(two.records)
    assert passes.count == 2
    by_seq = {r.seq: r for r in two.records}
    for r in two.records:
        if len(r.unpack_events) == 2:
            assert passes.again(r.unpack_events[0], 1) == r.unpack_events[1]
            assert passes.of_family([r.seq]) == tuple((u, u) for u in r.unpack_events)
    starts = [e for e in two.events if e.kind is EventKind.BACKWARD_START and e.module == "6"]
    (start,) = starts
    u6 = min(by_seq[s].unpack_events[1] for s in by_seq if by_seq[s].module == "6")
    assert passes.again(start.index, 1) == u6 - 1  # right after module 7's second unpack
    assert two.events[u6 - 1].kind is EventKind.BACKWARD_END
