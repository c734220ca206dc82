"""Late faults: a tier that fails after pack returned, its records' fallbacks and retries,
and the quarantine of a tier that keeps failing.

A write that fails at pack (full, or an I/O error the tier raised at once) goes to the next
tier in ``Executor._store``; this module handles what fails later: a write whose error arrives
through its handle, a read that fails at unpack, and tiers failing step after step. Each fault
runs as an ``offload::fault`` point (``_points.py``).

NOTE [ Late write failures ]
    A write that fails after pack returned (EIO, a late ENOSPC, a read-only remount) loses no
    byte: on a CPU device the record's source is still held, so it goes to the tiers after
    the failed one (all that are left once it was quarantined), and with none left the
    source stays where it is and unpack returns it; on CUDA an NVMe record's pinned copy is
    still held, so the cpu tier adopts it (when ``cpu_budget`` has room) or it stays the
    record's copy. Its counts move from the failed tier to where it went (``recount``), and
    the first failure of each tier is a warning, later ones debug lines.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from offload import _release, storage
from offload._family import Family, Life, step_of
from offload._points import point
from offload._stats import StepStats
from offload._tiers import CPU, kind_of

if TYPE_CHECKING:
    from offload._executor import Executor, _StepState

log = logging.getLogger("offload")

# NOTE [ Quarantined tiers ]
# A tier whose records fail in QUARANTINE_FAILING_STEPS consecutive steps (a write or a read
# raised an error other than "full": EIO, EROFS, ChecksumError from a disk losing writes) is set
# aside for the rest of the manager's life: it leaves ``Executor.tiers``, so later records go to
# the next tier (a plan's choice of it counts as a fallback), and the manager warns once. Records
# already in it stay there: their reads still go to it, and raise if they fail. A full tier is
# never set aside (space comes back), nor is the last tier left: with nothing to take its records
# each failure raises as before.
QUARANTINE_FAILING_STEPS = 3


def tiers_after(ex: Executor, tier: storage.Tier) -> list[storage.Tier]:
    """The tiers a record that failed in ``tier`` may go to next: those after it, or all
    that are left once it was quarantined (NOTE [ Quarantined tiers ])."""
    if tier not in ex.tiers:
        return list(ex.tiers)
    return ex.tiers[ex.tiers.index(tier) + 1 :]


def tier_failed(
    ex: Executor, tier: storage.Tier, step: _StepState | None, error: BaseException
) -> None:
    """A record of ``step`` failed in ``tier``: count the consecutive failing steps, and set
    the tier aside at QUARANTINE_FAILING_STEPS (see NOTE [ Quarantined tiers ])."""
    if isinstance(error, storage.StorageFullError) or not isinstance(error, storage.StorageError):
        return
    step = step or ex.step
    if step is None:
        return
    last, run = ex._failing.get(tier.name, (-2, 0))
    if step.index == last:
        return
    run = run + 1 if step.index == last + 1 else 1
    ex._failing[tier.name] = (step.index, run)
    if run < QUARANTINE_FAILING_STEPS or tier not in ex.tiers or len(ex.tiers) < 2:
        return
    ex.tiers.remove(tier)
    ex.quarantined.append(tier.name)
    (ex.step or step).stats.tiers_quarantined += 1
    msg = (
        f"the {tier.name} tier failed in {run} consecutive steps (the last error: {error}); "
        f"it is set aside for the rest of this manager's life and its records go to the "
        f"{ex.tiers[0].name} tier (stats.tiers_quarantined counts it). Check the disk "
        "(dmesg) or point nvme_dir elsewhere, and make a new manager to use it again"
    )
    if ex.warn_once is not None:
        ex.warn_once(f"quarantined {tier.name}", msg)
    else:
        log.warning("offload: %s", msg)


def say_write_failed(ex: Executor, tier: str, fam: Family, error: BaseException, now: str) -> None:
    """Log that a write into ``tier`` failed after pack returned, and where the record is
    ``now``: a warning the first time for each tier, then at debug level (a full disk fails
    every record of every step, and a warning each buried the log). ``stats.fallbacks``
    counts them all."""
    first = tier not in ex._failed_tiers
    ex._failed_tiers.add(tier)
    log.log(
        logging.WARNING if first else logging.DEBUG,
        "offload: writing %d bytes of %s to the %s tier failed (%s); they %s%s",
        fam.nbytes,
        fam.module or "<root>",
        tier,
        str(error),  # not the error: a log handler keeping it kept its traceback's frames
        now,
        "; later failures of this tier are counted in stats.fallbacks and not logged again"
        if first
        else "",
    )


def copy_out_failed(ex: Executor, fam: Family, error: BaseException) -> None:
    """CPU device: ``fam``'s write failed after pack returned, its source still held (see
    NOTE [ Late write failures ])."""
    with point("fault", f"a late failure of the {fam.tier.name} tier"):
        # The write failed after pack returned (EIO, late ENOSPC): try the next tier from the
        # source, which is still held; with none left, keep the source where it is (its bytes stay
        # on the device and unpack returns them) and say so once.
        failed = fam.tier.name
        ex.cpu_bytes -= kind_of(fam.tier).charge(fam.nbytes)
        # On CUDA the source is device memory, which no tier takes (host memory only): it stays.
        failed_in = fam.tier
        later = [] if ex.cuda else tiers_after(ex, failed_in)
        fam.tier = fam.handle = None  # the failed write released its own space
        tier_failed(ex, failed_in, step_of(fam), error)
        stats_of(ex, fam).fallbacks += 1
        assert fam.source is not None  # held until a copy out succeeds
        for tier in later:
            if fam.life is Life.FREED:
                return  # released by a GC pass in a write below: see NOTE [ Re-entrant release ]
            if not ex._cpu_room(kind_of(tier), fam.nbytes):
                continue
            try:
                fam.tier, fam.handle = tier, tier.write(fam.source)
                fam.handle.wait()
            except storage.StorageError:
                continue  # a failed write released its own space
            # drop gives these back; without this, cpu_bytes went negative.
            ex.cpu_bytes += kind_of(tier).charge(fam.nbytes)
            recount(ex, fam, failed_in, tier)
            say_write_failed(ex, failed, fam, error, f"went to the {tier.name} tier")
            if fam.life is Life.FREED:
                _release.drop(ex, fam)  # released while it was written: its new copy goes too
                return
            fam.source = None
            fam.to(Life.OFF_DEVICE)
            return
        recount(ex, fam, failed_in, None)
        fam.error = None
        say_write_failed(ex, failed, fam, error, f"stay on {ex.device}")
        fam.tier = fam.handle = None


def staged_write_failed(
    ex: Executor, fam: Family, handle: storage.StoredHandle, region: Any, error: BaseException
) -> None:
    """GPU + NVMe: ``fam``'s file write from its pinned copy ``region`` failed: adopt the region
    into the cpu tier (or keep it), so no byte is lost (see NOTE [ Late write failures ])."""
    with point("fault", f"a late failure of the {handle.tier.name} tier"):
        stats_of(ex, fam).fallbacks += 1
        tier_failed(ex, handle.tier, step_of(fam), error)
        cpu = next((t for t in ex.tiers if kind_of(t).in_host_memory), None)
        if cpu is not None and ex._cpu_room(CPU, fam.nbytes):
            fam.tier, fam.handle = cpu, cpu.write(region, fam.nbytes)
            ex.cpu_bytes += CPU.charge(fam.nbytes)
            recount(ex, fam, handle.tier, cpu)
            say_write_failed(ex, handle.tier.name, fam, error, f"went to the {cpu.name} tier")
            if fam.life is Life.FREED and fam not in ex._live:
                # Freed and dropped by a GC pass in that write (NOTE [ Re-entrant
                # release ]); one still waiting for its events is dropped with this handle.
                _release.drop(ex, fam)
        else:
            # Before the log line, which allocates: see NOTE [ Re-entrant release ].
            fam.tier = fam.handle = None
            fam.spill = region  # the record's only copy now
            recount(ex, fam, handle.tier, None)
            say_write_failed(ex, handle.tier.name, fam, error, "stay in pinned memory")


def forget_failed_write(
    ex: Executor, fam: Family, written: storage.Transfer, tier: storage.Tier
) -> None:
    """A write of ``fam`` into ``tier`` that ended after its family was let go (freed, or
    being freed): if it failed, its bytes were never stored there, though counted so."""
    if ex.capture.done(written) and written.exception(timeout=0) is not None:
        recount(ex, fam, tier, None)


def recount(ex: Executor, fam: Family, failed: storage.Tier, now: storage.Tier | None) -> None:
    """A write into tier ``failed`` failed after pack returned (and counted it there), and
    the record went to tier ``now`` instead (``None``: nowhere, it stayed where it was or
    was no longer needed): move its count, in its step's stats until the manager added
    those to its totals (at the next step), then in ``late``, which it adds next."""
    s = stats_of(ex, fam)
    kind_of(failed).count(s, fam.nbytes, -1)
    if now is not None:
        kind_of(now).count(s, fam.nbytes)


def stats_of(ex: Executor, fam: Family) -> StepStats:
    """Where a count about ``fam`` that changes after pack goes: its own step's stats until
    the manager added them to its totals (at the next step), then ``late``, which it adds
    next. (The current step's stats took a late failure of an earlier step's record.)"""
    step = step_of(fam)
    return step.stats if step is not None and not step.counted else ex.late
