"""Helpers shared by the tests of the simulator: traces built by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
from models import ALL_MODELS

import offload
from offload.lifecycle import (
    Event,
    EventKind,
    HardwareModel,
    Placement,
    Simulation,
    TensorRecord,
    Trace,
)

CPU, NVME, KEEP, RECOMPUTE = Placement.CPU, Placement.NVME, Placement.KEEP, Placement.RECOMPUTE


REBUILD = Placement.REBUILD


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


def _pointwise(hw: HardwareModel, bytes_per_s: float = 2000.0) -> HardwareModel:
    """``hw`` with an elementwise rate; at 2000 B/s a 1000-byte rebuild from 1000 bytes takes 1 s."""
    return dataclasses.replace(hw, pointwise_bytes_per_s=bytes_per_s)


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    out = {}
    for name, factory in ALL_MODELS.items():
        case = factory(seed=0)
        out[name] = offload.profile(case.step, case.model)
    return out
