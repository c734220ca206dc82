"""What the offloader did: per step and in total."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LEAD_WINDOW = 10_000  # prefetch lead times a total keeps for its median


@dataclass(kw_only=True)
class StepStats:
    """Counters of one step (``last``) or summed over all steps (``total``).

    Byte and time fields carry their unit in the name. Peaks are maxima, not sums, in ``total``.

    Attributes:
        steps: steps counted (1 for ``last``).
        records: saved tensors seen by pack (every member of an alias family).
        records_kept: saved tensors left where they were (parameters, small, ``keep=``, other
            device, packed during backward, paused).
        records_deduplicated: saved tensors that shared an already-stored alias family.
        records_offloaded_cpu / records_offloaded_nvme: alias families stored in each tier.
        bytes_offloaded_cpu / bytes_offloaded_nvme: bytes stored in each tier. A record is
            counted when its write starts; if the write fails later, the count moves to the
            tier that took the record instead, or goes (in ``total`` alone once a later step
            has begun). ``mgr.stats`` waits for the writes still running before it reads, so
            what it returns is final (a write failing inside ``close()`` is taken off
            ``total`` too).
        bytes_recomputed: bytes rebuilt by recomputation instead of stored (planner; 0 here).
        records_rebuilt / bytes_rebuilt: saved tensors not stored but rebuilt at unpack:
            autocast weight casts from their parameter, and GELU / SiLU / norm outputs
            from their inputs (always without a budget; under one where the plan says
            REBUILD); an output several ops saved counts each record but its bytes once (NOTE
            [ Weight casts ], NOTE [ Activation recipes ] in ``offload/_recipe.py``).
        reloads: family reloads started (prefetched or not). A family unpacked while its copy
            out (or its file write, on CPU) still runs gets its source back and is not
            reloaded, so ``reloads`` can be lower than the records offloaded.
        stalls: unpacks that found no reload started and had to load synchronously.
        stall_s: seconds unpack spent waiting for bytes (stalls and late prefetches). On
            CUDA: the device time the consumer stream stood still waiting for a reload's copy
            (CUDA events around its wait, read once complete), plus host time an unpack
            blocked (an NVMe read); the host clock alone read about 0 there.
        prefetch_lead_s_p50: median seconds between a prefetch starting and its unpack (in
            ``total``: over the last ``LEAD_WINDOW`` prefetches, so that a long run's stats
            neither grow nor slow down).
        backpressure_waits: packs that waited for older copies (``max_inflight_bytes``).
        prefetches_skipped: prefetches not started because the device had no room for the
            reload (its unpack loads it then, a stall); each try counts.
        fallbacks: records that went to a later tier because an earlier one was full or failed,
            or stayed where they were when a write failed after pack and no later tier had
            room (only the first such failure of each tier is logged as a warning); counted
            in the step that packed the record.
        tiers_quarantined: tiers set aside during the step because their records failed
            (not "full": an I/O or checksum error) in ``QUARANTINE_FAILING_STEPS`` (3)
            consecutive steps; later records go to the next tier (in ``total``: how many were).
        host_allocations: new host pool slabs allocated during the step.
        peak_allocated_bytes / peak_reserved_bytes: CUDA allocator peaks over the step (0 on CPU).
            Under a pipeline attachment, whose microbatch steps overlap, the manager does not
            reset the counters: the peak since the caller last reset them
            (``torch.cuda.reset_peak_memory_stats``).
        predicted_peak_bytes / predicted_step_s: the plan's predictions (0 without a plan).
        step_s: wall seconds from the step's start to the end of its backward.
        unplanned_records: records no plan entry matched (0 without a plan).
        min_memory_steps: 1 for a step under ``gpu_budget`` run in min-memory mode because
            its signature has no plan that holds the budget (``on_infeasible="min_memory"``,
            a signature whose profile never finished, or one past the profiled signatures whose
            shared plan cannot hold the budget); profiling steps are not counted. In ``total``:
            how many steps ran so.
    """

    steps: int = 0
    records: int = 0
    records_kept: int = 0
    records_deduplicated: int = 0
    records_offloaded_cpu: int = 0
    records_offloaded_nvme: int = 0
    bytes_offloaded_cpu: int = 0
    bytes_offloaded_nvme: int = 0
    bytes_recomputed: int = 0
    records_rebuilt: int = 0
    bytes_rebuilt: int = 0
    reloads: int = 0
    stalls: int = 0
    stall_s: float = 0.0
    prefetch_lead_s_p50: float = 0.0
    backpressure_waits: int = 0
    prefetches_skipped: int = 0
    fallbacks: int = 0
    tiers_quarantined: int = 0
    host_allocations: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    step_s: float = 0.0
    unplanned_records: int = 0
    min_memory_steps: int = 0
    _leads: list[float] = field(default_factory=list, repr=False)

    _PEAKS = ("peak_allocated_bytes", "peak_reserved_bytes", "predicted_peak_bytes")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of the public fields (JSON-ready)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("_")
        }

    def add(self, other: StepStats, *, median: bool = True) -> None:
        """Accumulate ``other`` (a finished step) into this total; ``median=False`` leaves
        ``prefetch_lead_s_p50`` for :meth:`finish` (a sort of up to 10,000 lead times)."""
        for f in dataclasses.fields(self):
            name = f.name
            if name == "_leads":
                self._leads.extend(other._leads)
                del self._leads[:-LEAD_WINDOW]
            elif name == "prefetch_lead_s_p50":
                continue
            elif name in self._PEAKS:
                setattr(self, name, max(getattr(self, name), getattr(other, name)))
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))
        if median:
            self.prefetch_lead_s_p50 = _median(self._leads)

    def finish(self) -> None:
        """Compute ``prefetch_lead_s_p50`` from the lead times held."""
        self.prefetch_lead_s_p50 = _median(self._leads)


@dataclass
class OffloadStats:
    """``last``: the most recent step; ``total``: every step so far.

    Example:
        >>> stats = OffloadStats()
        >>> stats.as_dict()["total"]["steps"]
        0
    """

    last: StepStats = field(default_factory=StepStats)
    total: StepStats = field(default_factory=StepStats)

    def as_dict(self) -> dict[str, Any]:
        return {"last": self.last.as_dict(), "total": self.total.as_dict()}


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
