"""Reloads: a family's bytes back on the device for an unpack, in rule 3's stream order.

Rule 3 of NOTE [ Stream ordering ] (in _executor.py): the destination is allocated on the
compute stream, the H2D copy waits for that allocation (and for D), and the consumer waits on
R. An NVMe reload lands on the device as soon as its file read is seen done (NOTE [ NVMe
reloads land early ]). Which reloads start ahead of their unpack is the look-ahead's
(``_lookahead.py``); waiting for pool room for NVMe staging is ``_backpressure.py``'s.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from offload import _backpressure, _faults, _lookahead, _release, storage
from offload._errors import OffloadError, from_storage
from offload._family import (
    Family,
    Life,
    aligned_buffer,
    aligned_offset,
    rebuild,
    step_of,
)
from offload._points import point
from offload._tiers import kind_of
from offload.lifecycle._calls import graph_task
from offload.storage._host_tier import read_at_once

if TYPE_CHECKING:
    from offload._executor import Executor
    from offload._family import _Member


_ASK: Any = object()  # unpack's ``step`` not given: read from the family


def mark_ahead(ex: Executor, fam: Family, ahead: bool) -> None:
    # Bytes reloaded (or reused) and not yet unpacked: what the look-ahead window bounds.
    if fam.ahead != ahead:
        fam.ahead = ahead
        ex._ahead_bytes += fam.nbytes if ahead else -fam.nbytes


def reuse(ex: Executor, fam: Family) -> bool:
    """A reload whose buffer is still alive (another member holds it): keep using it."""
    raw = fam.resident_ref() if fam.resident_ref is not None else None
    if raw is None:
        return False
    fam.resident = raw
    fam.unpacked = 0
    fam.unpack_round += 1
    fam.to(Life.COPYING_IN)
    fam.to(Life.RESIDENT)
    fam.reload_started_s = 0.0  # no reload: no lead to count (NOTE [ Reloads done at once ])
    mark_ahead(ex, fam, True)
    return True


def start_reload(ex: Executor, fam: Family) -> None:
    # Memory first: an allocation that fails (a device OOM, a full pool) leaves the family
    # off the device as it was, for the unpack to try again.
    # A whole tensor on a CPU device comes back in a buffer of its dtype (NOTE [ Whole
    # tensors ] in _family.py).
    dense = fam.dense if not ex.cuda else None
    if dense is None:
        raw, off = aligned_buffer(fam.nbytes, fam.storage_mod, ex.device)
    else:
        raw, off = aligned_buffer(fam.nbytes, fam.storage_mod, ex.device, dense[0])
    fam.reload_stream = ex.streams.current()  # the pool raw came from (rule 3)
    allocated = None
    kind = kind_of(fam.tier)
    if ex.cuda and fam.spill is None and not kind.in_host_memory:
        staging = ex.pool.allocate(fam.nbytes)  # NVMe -> pinned staging -> device
        if fam.life is not Life.OFF_DEVICE:
            staging.release()  # the family was released meanwhile, as below
            return
        fam.staging = staging
        # Rule 3: raw exists. Recorded now, not when the copy is issued (later, on
        # whichever thread polls): the H2D copy waits for this point of the stream raw
        # came from.
        allocated = ex.streams.record(fam.reload_stream)
    if fam.life is not Life.OFF_DEVICE:
        return  # released while memory was allocated: see NOTE [ Re-entrant release ]
    fam.to(Life.COPYING_IN)
    fam.unpacked = 0
    fam.unpack_round += 1
    mark_ahead(ex, fam, True)
    fam.reload_started_s = time.perf_counter()
    fam.resident, fam.resident_ref, fam.typed, fam.view = raw, weakref.ref(raw), None, None
    if ex.meter is not None:
        ex.meter.watch(raw.untyped_storage(), fam.nbytes)
    whole = None if dense is None else _whole_view(fam, raw, off)
    if whole is not None:
        dst = whole
    else:
        dst = (raw if dense is None else raw.view(torch.uint8))[off : off + fam.nbytes]
    try:
        if not ex.cuda:
            if whole is not None and kind.in_host_memory:
                reload = fam.tier._read_whole(fam.handle, whole, fam.dense)
            else:
                reload = fam.tier.read(fam.handle, dst)
            if read_at_once(reload):
                fam.to(Life.RESIDENT)  # NOTE [ Reloads done at once ]
            else:
                fam.reload = reload
                if not kind.in_host_memory:
                    ex._reading.append((fam, None))
        elif fam.spill is not None:
            # NVMe write still running (or failed): the pinned copy is right here.
            _h2d_copy(ex, fam, dst, fam.spill.tensor)
        elif kind.in_host_memory:
            _h2d_copy(ex, fam, dst, fam.handle.region.tensor)
        else:
            # NVMe -> pinned staging (I/O threads) now; staging -> device once the read
            # is seen done (NOTE [ NVMe reloads land early ]), at the latest at unpack.
            fam.reload = fam.tier.read(fam.handle, fam.staging)
            ex._reading.append((fam, allocated))
        if ex.step is not None:
            # Counted in the current step (``stats.last``), like everything backward does;
            # the step that packed the family may already be folded into the totals.
            ex.step.stats.reloads += 1
    except BaseException as e:
        # Nothing was started (a read that fails to start raises before queueing I/O).
        undo_reload(ex, fam)
        # No local may hold the error: its traceback holds this frame (a reference cycle
        # that kept the step's families until a GC pass).
        if isinstance(e, OffloadError) or not isinstance(e, storage.StorageError):
            raise
        raise from_storage(e, f"reloading a saved tensor of {fam.module or '<root>'}") from e


def _whole_view(fam: Family, raw: torch.Tensor, off: int) -> torch.Tensor | None:
    """The dense tensor of ``fam`` over ``raw`` (a buffer of its dtype) at byte ``off``, as
    ``rebuild`` makes its members, and kept as the family's last view, for the reload to fill
    as itself; None where ``off`` is no multiple of its item size (``rebuild`` then raises as
    before)."""
    assert fam.dense is not None
    dtype, size, stride = fam.dense
    item = dtype.itemsize
    if off % item:
        return None
    out = raw.as_strided(size, stride, off // item)
    fam.typed = raw
    fam.view = (dtype, size, stride, 0, out)
    return out


def undo_reload(ex: Executor, fam: Family) -> None:
    """A reload that failed, or never started: the family is off the device as before. Its
    staging goes back (a retry allocates new; keeping it leaked it until close), and its
    unfilled buffer is dropped, ``resident_ref`` too: an error's traceback may keep the
    buffer alive, and a later reuse must not take it for a finished reload."""
    if fam.staging is not None:
        staging, fam.staging = fam.staging, None
        staging.release()
    take_reading(ex, fam)
    fam.resident = fam.resident_ref = fam.typed = fam.view = fam.reload = None
    mark_ahead(ex, fam, False)
    fam.to(Life.OFF_DEVICE)


# NOTE [ NVMe reloads land early ]
#     An NVMe reload is two copies: file -> pinned staging on the I/O threads, then staging
#     -> device on the H2D stream. Issued only at unpack, the second would queue behind all
#     the compute before it, and every NVMe record would cost a bubble. So each poll (every pack,
#     module boundary, backward trigger and unpack) issues it for the reads it finds done,
#     from the compute-side thread that polls, never from an I/O thread's callback (no CUDA
#     work there). The H2D stream waits on the event recorded right after the destination
#     was allocated (rule 3), not on one recorded when the copy is issued; the staging goes
#     back after R (rule 4). A read that failed is left to its unpack, which raises. On a
#     CPU device the read fills the destination itself and landing only takes it.


def land_reads(ex: Executor) -> None:
    """Land every NVMe reload whose file read completed (NOTE [ NVMe reloads land
    early ]). Caller holds the lock."""
    reading, ex._reading = ex._reading, []
    for fam, allocated in reading:
        read = fam.reload
        if read is not None and fam.life is Life.COPYING_IN and not ex.capture.done(read):
            ex._reading.append((fam, allocated))
        elif read is not None and fam.life is Life.COPYING_IN:
            if read.exception(timeout=0) is not None:
                ex._reading.append((fam, allocated))  # its unpack raises the error
                continue
            land(ex, fam, allocated)
            ex.landed_early += 1


def take_reading(ex: Executor, fam: Family) -> Any:
    """Forget ``fam``'s entry among the reads in flight; its allocation event."""
    for i, (f, allocated) in enumerate(ex._reading):
        if f is fam:
            del ex._reading[i]
            return allocated
    return None


def land(ex: Executor, fam: Family, allocated: Any) -> None:
    """``fam``'s NVMe read completed: on CUDA, issue staging -> device now."""
    fam.reload = None
    if ex.cuda and fam.staging is not None:
        raw = fam.resident
        assert raw is not None
        off = aligned_offset(raw, fam.storage_mod)
        _h2d_copy(ex, fam, raw[off : off + fam.nbytes], fam.staging.tensor, allocated)
        staging, fam.staging = fam.staging, None
        _release.release_after(ex, staging, fam.reload_event)


def _h2d_copy(
    ex: Executor, fam: Family, dst: torch.Tensor, host: torch.Tensor, allocated: Any = None
) -> None:
    if allocated is None:
        # Rule 3: dst exists. On the stream whose pool dst came from, which is not the
        # current one when an NVMe reload's unpack (on the consumer's stream) runs this: the
        # block's earlier user on that stream must be done with it before the copy
        # overwrites it.
        allocated = ex.streams.record(fam.reload_stream)
    with torch.cuda.stream(ex._h2d):
        ex._h2d.wait_event(allocated)  # rule 3: after dst's allocation
        dst.copy_(host[: fam.nbytes], non_blocking=True)
        fam.reload_event = torch.cuda.Event()
        fam.reload_event.record(ex._h2d)  # R: the device buffer holds the bytes


def unpack(ex: Executor, m: _Member, step: Any = _ASK, task: int | None = None) -> torch.Tensor:
    """The member's tensor, with the family's bytes on the device; ``step``: the state of the
    step that packed it (``step_of(m.family)``), and ``task``: the running backward's graph
    task, where the caller read them already."""
    fam = m.family
    with ex.lock:
        if ex._forked:
            _release.forget_parent(ex)
        if fam.error is not None:
            raise fam.error
        life = fam.life
        if life is not Life.RESIDENT:  # (a resident family, the common case, skips this)
            if life is Life.FREED:
                raise OffloadError(
                    f"saved tensor of {fam.module or '<root>'} was already released (the "
                    "manager was closed, or its step failed); run forward again"
                )
            if life is Life.COPYING_OUT:
                ex._check_version(fam)
                if fam.error is not None:
                    raise fam.error
            if fam.source is not None and (life is Life.COPYING_OUT or fam.tier is None):
                # Rule 3: the source is still held (or storing it failed and it stayed): no
                # copy.
                return m.wrap(m.source_view())
            _bring_back(ex, fam)
        elif fam.reload_started_s:
            _landed_at_once(ex, fam)
        # Prefetch follows the step that packed the family: with two forwards before their
        # backwards (pipelining, accumulation) the current step is another one. Counters go
        # to the current step, which is ``stats.last``.
        if step is _ASK:
            step = fam.step_ref() if fam.step_ref is not None else None
        raw = fam.resident
        assert raw is not None
        consumer = ex.streams.current()
        if fam.reload_stream is not None and consumer != fam.reload_stream:
            # See NOTE [ Reload buffers used on another stream ].
            ex.streams.mark_used(raw, consumer)
        if ex.cuda and fam.reload_event is not None:
            # Rule 3: the consumer runs on the current stream, after R. Waited at every
            # unpack, not only the one that finished the reload: a member unpacked later, or
            # one reusing a live buffer, may run on another stream.
            _wait_reload(ex, fam.reload_event, consumer)
        out = rebuild(raw, fam, m.dtype, m.size, m.stride, m.offset_bytes)
        fam.unpacked += 1
        if m.unpacked_in == fam.unpack_round:
            m.unpacks += 1
        else:
            m.unpacked_in, m.unpacks = fam.unpack_round, 1
        if task is None:
            task = graph_task()
        fam.unpacked_task = task
        if fam.ahead:  # mark_ahead(ex, fam, False), inline (once per unpack)
            fam.ahead = False
            ex._ahead_bytes -= fam.nbytes
        if fam.unpacked >= fam.members:
            # Every live member has its view: drop the strong reference so the buffer dies
            # with autograd's use of it; a later unpack (retain_graph) reloads or reuses it.
            fam.resident = fam.typed = fam.view = None
            fam.to(Life.OFF_DEVICE)
        if step is not None:
            _lookahead.after_unpack(ex, step, fam, task)
        return m.wrap(out) if m.bits or m.dtensor is not None else out


def _bring_back(ex: Executor, fam: Family) -> None:
    """An unpack's family not resident: reuse its live buffer, reload it now, or finish the
    reload in flight; a stall is counted (and timed) in the current step."""
    stats = ex.step.stats if ex.step is not None else None
    prefetched = True
    if fam.life is Life.OFF_DEVICE and not reuse(ex, fam):
        prefetched = False
        if stats is not None:
            stats.stalls += 1
        _backpressure.reload_waiting(ex, fam)
    if fam.life is Life.COPYING_IN:
        t0 = time.perf_counter()
        finish_reload(ex, fam)
        if stats is not None:
            stats.stall_s += time.perf_counter() - t0
            if prefetched:
                stats._leads.append(t0 - fam.reload_started_s)
    fam.reload_started_s = 0.0  # its lead counted, if it had one


def _landed_at_once(ex: Executor, fam: Family) -> None:
    """The first unpack of a family whose prefetch completed in its call: its lead, as
    ``_bring_back`` counts one (NOTE [ Reloads done at once ])."""
    if ex.step is not None:
        ex.step.stats._leads.append(time.perf_counter() - fam.reload_started_s)
    fam.reload_started_s = 0.0


# NOTE [ Reloads done at once ]
#     On a CPU device the cpu tier's read of a stored record copies in the call (NOTE
#     [ Copies done at once ] in storage/_host_tier.py): the family is resident when
#     ``start_reload`` returns, so it goes there at once, and its first unpack has nothing
#     to finish (no transfer to wait on, no landing, no stall time to take). That unpack
#     still counts the prefetch's lead, from ``reload_started_s``, which is nonzero exactly
#     while a reload's lead is uncounted: ``_bring_back`` and ``reuse`` clear it (a stall's
#     reload, done for its unpack, and a reused buffer have none). A read of any other tier
#     or engine, and every reload on CUDA, still goes through ``COPYING_IN`` and
#     ``finish_reload``.


# NOTE [ Reload buffers used on another stream ]
#     A reload buffer comes from the caching-allocator pool of the stream current when it
#     was allocated (rule 3): the stream of the node whose backward pre-hook started the
#     prefetch, or of the unpack that reloaded at once. The node that unpacks it may run on
#     another stream (autograd runs each node on the stream its forward op ran on). Freed
#     once autograd drops its view, the block would go back to the first stream's pool and
#     be handed out there while the consumer's kernels may still read it. So an unpack on a
#     stream other than the allocating one marks the buffer used there (record_stream): the
#     allocator then reuses the block only after the consumer's work queued so far.

# NOTE [ Stall time on CUDA ]
#     On CUDA an unpack does not block the host on a reload: it makes the compute stream
#     wait on R, so host seconds around it read about 0 while the compute stream waits for
#     the copy. ``stall_s`` adds, for each unpack that found R not yet complete, the device
#     time between an event recorded on the consumer stream just before its wait on R and
#     one just after (the time the stream stood still for the copy; about 0 when its own
#     queued work outlasted the copy), read once the second completed (at a later poll, or
#     at ``settle``, which waits for them). It goes to the stats of the step current at the
#     unpack, or to ``late`` once the manager has added those to its totals. Host seconds
#     an unpack blocks (an NVMe read into staging) are added as on CPU.


def _wait_reload(ex: Executor, reload_event: Any, consumer: Any) -> None:
    """Make ``consumer`` wait on R; time the wait on the device when R is not complete yet
    (NOTE [ Stall time on CUDA ])."""
    step = ex.step
    # Inside a capture no query and no timing (NOTE [ No query while capturing ]).
    if step is None or ex.capture.capturing() or ex.capture.query(reload_event):
        consumer.wait_event(reload_event)  # complete (no stall), or nothing to count it
        return
    before = torch.cuda.Event(enable_timing=True)
    before.record(consumer)  # where the consumer's wait begins
    consumer.wait_event(reload_event)  # rule 3
    after = torch.cuda.Event(enable_timing=True)
    after.record(consumer)  # reached once R completed and the stream got there
    ex._stall_marks.append((before, after, step))


def gather_stalls(ex: Executor, wait: bool = False) -> None:
    """Add the device time of completed stall waits to ``stall_s`` (NOTE [ Stall time on
    CUDA ]); ``wait``: wait for those not complete yet."""
    marks, ex._stall_marks = ex._stall_marks, []
    for before, after, step in marks:
        if wait:
            after.synchronize()
        elif not ex.capture.query(after):
            ex._stall_marks.append((before, after, step))
            continue
        stats = step.stats if not step.counted else ex.late
        stats.stall_s += before.elapsed_time(after) / 1e3


def finish_reload(ex: Executor, fam: Family) -> None:
    try:
        if fam.reload is not None:
            fam.reload.wait()  # CPU copy, or NVMe -> staging on GPU
    except storage.StorageError as e:
        # The failed read has completed: nothing touches the staging region now.
        with point("fault", f"a read of the {fam.tier.name} tier"):
            _faults.tier_failed(ex, fam.tier, step_of(fam), e)
            undo_reload(ex, fam)
        # No local may hold the error: its traceback holds this frame (a reference cycle
        # that kept the step's families until a GC pass).
        if isinstance(e, OffloadError) or not isinstance(e, storage.StorageError):
            raise
        raise from_storage(e, f"reloading a saved tensor of {fam.module or '<root>'}") from e
    # NVMe: the bytes reached pinned staging (unless a poll already landed them); now
    # staging -> device on the H2D stream. (A cpu tier's read, the common case, has no entry
    # among the reads.)
    land(ex, fam, take_reading(ex, fam) if ex._reading else None)
    fam.to(Life.RESIDENT)
