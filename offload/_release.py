"""Releases: a family's bytes go back once its last member handle died (or its step failed, its
manager closed, or the process forked), and only after rule 4 allows.

Rule 4 of NOTE [ Stream ordering ] (in _executor.py): host regions and file ranges are freed
only after the last event or transfer that read or wrote them completed, so a family freed
while its copies run waits in ``_pending_free`` (a staging region in ``_pending_regions``) and
``collect_pending`` drops it later. A release can run from any thread at any allocation (NOTE
[ Re-entrant release ]); ``Executor.release`` is the entry point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from offload import _faults, _reload, storage
from offload._errors import OffloadError
from offload._family import Family, Life, live_members
from offload._points import point
from offload._tiers import kind_of

if TYPE_CHECKING:
    from offload._executor import Executor


# NOTE [ Re-entrant release ]
#     A release runs from a member's finalizer, which a GC pass runs at whatever allocation
#     starts it, on the allocating thread, where the executor's lock (re-entrant) is often
#     held already. So inside the executor any call that can allocate (an event query:
#     ``torch.cuda.Event.query`` makes a ``super()`` object; a tensor or host region; a tier
#     write) may free a family and take it out of ``_inflight``. Code that reads executor
#     state, makes such a call, then acts on what it read reads it again: poll retires the
#     head of ``_inflight`` only if it is still the family whose copy it asked about (the
#     next one's copy may still run), a reload whose family was freed while its memory was
#     allocated stops, a failed write's new copy (next tier, or pinned) whose family was
#     freed meanwhile is freed too, and lists a release appends to are swapped out before
#     they are walked (``collect_pending``).


def drain_releases(ex: Executor) -> None:
    # Caller holds the lock.
    while ex._deferred_releases:
        release(ex, *ex._deferred_releases.popleft())


def release(
    ex: Executor, fam: Family, unpacked_in: int = -1, holders: int = 1, unpacks: int = 1
) -> None:
    # ``unpacked_in``: the unpack round the dying member was last unpacked in. Unpacked
    # since the last reload, it takes that unpack with it: ``unpacked`` counts the live
    # members' unpacks, so that the last live member's unpack is the one that drops the
    # buffer. (Counted, the unpack of v by ``att @ v``, freed with its node, made the unpack
    # of k the last of q, k, v: the buffer was dropped under k's view and q's unpack
    # reloaded the family again, two buffers held at once.)
    # A member ``holders`` saved variables held (NOTE [ Packed again ] in _pack.py) takes
    # their unpacks of this round with it, and counted for each of them.
    if unpacked_in == fam.unpack_round and fam.unpacked > 0:
        fam.unpacked -= 1 if holders == 1 else min(unpacks, holders, fam.unpacked)
    fam.members -= holders
    if fam.members > 0 or fam.life is Life.FREED:
        return
    if fam.life is Life.OFF_DEVICE and not ex.cuda:
        # unowned(ex, fam) and free(ex, fam), inline for a family stored and off the device
        # on CPU (once per family): nothing in flight, no event to wait for.
        if fam.ahead:
            _reload.mark_ahead(ex, fam, False)
        fam.life = Life.FREED  # (every state but FREED leads there: Family.to's check)
        drop(ex, fam)
        return
    unowned(ex, fam)


def unowned(ex: Executor, fam: Family) -> None:
    """``fam``'s last member handle is gone: free its bytes (as soon as rule 4 allows)."""
    if fam.life is Life.COPYING_OUT and fam in ex._inflight:
        ex._inflight.remove(fam)
        ex._inflight_bytes -= fam.nbytes
        if fam.handle is not None and not ex.capture.done(fam.handle):
            # Its write still runs (backward ran ahead of the tier): it stays counted.
            if fam.spill is not None:
                # GPU + NVMe: the I/O threads read the pinned copy until the write ends; it
                # joins the queue of such writes (the staging bound; _poll_writes releases
                # it). Held unqueued, with its device source, nothing bounded it.
                ex._writing.append((fam, fam.handle))
                ex._writing_bytes += fam.nbytes
            elif not ex.cuda:
                ex._orphans.append((fam.handle.written, fam, fam.tier))
                ex._orphan_bytes += fam.nbytes
        elif fam.handle is not None:
            _faults.forget_failed_write(ex, fam, fam.handle.written, fam.tier)
    free(ex, fam)


def free(ex: Executor, fam: Family) -> None:
    if fam.ahead:
        _reload.mark_ahead(ex, fam, False)
    # Rule 4: GPU copies that read or write the tier's region must be complete first.
    if ex.cuda and not events_done(ex, fam):
        fam.to(Life.FREED)
        ex._pending_free.append(fam)
        return
    if fam.life is not Life.FREED:
        fam.to(Life.FREED)
    drop(ex, fam)


def drop(ex: Executor, fam: Family) -> None:
    # Safe to run again after an exception cut it short (see release_lost): each release
    # is idempotent, and its field is cleared only after it (and after the count it moves).
    tier, handle = fam.tier, fam.handle
    if tier is not None and handle is not None:
        tier.free(handle)
        ex.cpu_bytes -= kind_of(tier).charge(fam.nbytes)
        fam.handle = None
    if fam.staging is not None:
        fam.staging.release()
        fam.staging = None
    if fam.spill is not None and not queued_write(ex, fam):
        fam.spill.release()  # a spill still being written is released by _poll_writes
        fam.spill = None
    fam.source = fam.resident = fam.typed = fam.view = fam.guard = None
    fam.source_event = fam.reload_event = fam.reload = None
    ex._live.pop(fam, None)


def release_lost(ex: Executor) -> None:
    """Finish releases that an exception cut short.

    A member handle is released from its ``__del__``, which autograd runs while it frees a
    graph; an exception raised there (a KeyboardInterrupt arriving, a signal handler's) is
    printed and dropped by Python, and the release stops where it was: the family kept its
    bytes, counted in ``cpu_bytes``, until ``close()``. Its member handles are gone,
    though (its token says so: NOTE [ Member tokens ] in _family.py), so here, at the next
    step and whenever live families are counted, it is released; a family whose drop was
    cut short is dropped again. Caller holds the lock.
    """
    waiting = {id(f) for f in ex._pending_free}
    for fam in list(ex._live):
        if fam.life is not Life.FREED:
            if not live_members(fam):
                fam.members = 0
                unowned(ex, fam)
        elif id(fam) not in waiting:
            if ex.cuda and not events_done(ex, fam):
                ex._pending_free.append(fam)
            else:
                drop(ex, fam)


def events_done(ex: Executor, fam: Family) -> bool:
    # Rule 4 covers the I/O future too: an NVMe read still filling the staging region must
    # finish before drop hands that region back to the pool.
    if fam.reload is not None and not ex.capture.done(fam.reload):
        return False
    if (
        fam.spill is not None
        and fam.handle is not None
        and not ex.capture.done(fam.handle)
        and not queued_write(ex, fam)
    ):
        return False  # I/O threads still read the pinned copy (unless _poll_writes frees it)
    return all(e is None or ex.capture.query(e) for e in (fam.source_event, fam.reload_event))


def queued_write(ex: Executor, fam: Family) -> bool:
    """Whether ``fam``'s file write is in the queue whose pinned copies _poll_writes frees."""
    return any(f is fam for f, _ in ex._writing)


def collect_pending(ex: Executor) -> None:
    # Swap the lists out first: a member's __del__ (gc inside drop, same thread, re-entering
    # the RLock) may append to them meanwhile, and rebuilding them from a local copy lost it.
    regions, ex._pending_regions = ex._pending_regions, []
    for region, event in regions:
        if ex.capture.query(event):
            region.release()
        else:
            ex._pending_regions.append((region, event))
    pending, ex._pending_free = ex._pending_free, []
    for fam in pending:
        if events_done(ex, fam):
            drop(ex, fam)
        else:
            ex._pending_free.append(fam)


def release_after(ex: Executor, region: Any, event: Any) -> None:
    # Rule 4: a staging region goes back to the pool once the H2D copy reading it is done.
    if event is None or ex.capture.query(event):
        region.release()
    else:
        ex._pending_regions.append((region, event))


def abandon(ex: Executor, families: Iterable[Family], why: str) -> None:
    """Free ``families`` now, whatever their state; a later unpack of one raises ``why``."""
    if ex.cuda:  # rule 4: nothing may still read or write their regions
        ex._d2h.synchronize()
        ex._h2d.synchronize()
    for fam in families:
        if fam.life is not Life.FREED:
            fam.error = OffloadError(why)
            wait_transfers(ex, fam)
            if fam.life is Life.COPYING_OUT and fam.handle is not None:
                _faults.forget_failed_write(ex, fam, fam.handle.written, fam.tier)
            free(ex, fam)


def forget_parent(ex: Executor) -> None:
    """In a forked child, at its first call: drop every family of the parent (their copies
    and reads ran on the parent's threads, which are not here; an NVMe record is in the
    parent's file), without waiting for anything; their host bytes go back to the pool. A
    graph saved before the fork raises a clear error at its unpack. Caller holds the lock.
    """
    if not ex._forked:
        return
    ex._forked = False
    why = (
        "this tensor was saved in the parent process before os.fork(); a forked child has "
        "none of the parent's copies, reads or I/O threads, so the offloaded activations "
        "saved before the fork were dropped here. Run forward again in this process"
    )
    if ex.cuda:
        why += " (CUDA does not survive a fork: use the 'spawn' start method)"
    families = [*ex._live, *ex._pending_free]
    families += [fam for _, fam, _ in ex._orphans] + [fam for fam, _ in ex._writing]
    ex._inflight.clear()
    ex._orphans.clear()
    ex._writing.clear()
    ex._deferred_releases.clear()
    ex._pending_free = []
    for region, _ in ex._pending_regions:
        region.release()
    ex._pending_regions = []
    for fam in families:
        if fam.error is None:
            fam.error = OffloadError(why)
        if fam.life is not Life.FREED:
            fam.to(Life.FREED)
        drop(ex, fam)  # the tiers forgot the parent's transfers; no wait here
    ex._live.clear()
    ex._inflight_bytes = ex._orphan_bytes = ex._writing_bytes = ex._ahead_bytes = 0
    if ex.step is not None:
        ex.step.families = []
        ex.step.by_storage.clear()


def wait_transfers(ex: Executor, fam: Family) -> None:
    for t in (fam.reload, getattr(fam.handle, "written", None)):
        if t is not None:
            with contextlib.suppress(storage.StorageError):
                t.wait()


def close(ex: Executor) -> None:
    """Release every family's bytes (later unpacks raise) and wait for copies in flight."""
    with ex.lock, point("drain", "close"):
        forget_parent(ex)
        abandon(
            ex,
            list(ex._live),
            "the offload manager that saved this tensor was closed (by close(), or by its "
            "finalizer once nothing referenced it) before this backward ran; its offloaded "
            "activations were released. Run backward before closing the manager (and keep "
            "a reference to it while its graphs live), or run forward again.",
        )
        drain_releases(ex)
        for fam in ex._pending_free:
            wait_transfers(ex, fam)  # rule 4: an NVMe read may still fill its staging
            drop(ex, fam)
        for region, _ in ex._pending_regions:
            region.release()
        for fam, handle in ex._writing:
            with contextlib.suppress(storage.StorageError):
                handle.wait()  # rule 4: the I/O threads read the spill until then
            # Freed above (or before): a write that failed stored nothing, though counted.
            _faults.forget_failed_write(ex, fam, handle.written, handle.tier)
            if fam.spill is not None:
                fam.spill.release()
                fam.spill = None
        ex._writing.clear()
        ex._writing_bytes = 0
        ex._reading.clear()  # their families were released above
        # Copies out still in flight belong to families released above.
        ex._inflight.clear()
        ex._inflight_bytes = 0
        # Writes whose family went first: one that fails stored nothing, though counted
        # (cleared unread, they stayed counted in the totals).
        for written, fam, tier in ex._orphans:
            with contextlib.suppress(storage.StorageError):
                written.wait()
            _faults.forget_failed_write(ex, fam, written, tier)
        ex._orphans.clear()
        ex._orphan_bytes = 0
        ex._pending_free, ex._pending_regions = [], []
        ex._stall_marks = []
        ex._live.clear()
        ex.step = None
