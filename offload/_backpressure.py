"""Back-pressure: copies out in flight stay under their bound, and a full pool waits for the
transfers in flight to give room back before a record spills or an error reaches the user.

Rule 2 of NOTE [ Stream ordering ] (in _executor.py) and NOTE [ A full pool waits for what is
in flight ] below; the copies themselves are the executor's (``Executor._store``) and the
reloads' (``_reload.py``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch

from offload import _release, _reload, storage
from offload._family import Family

if TYPE_CHECKING:
    from offload._executor import Executor, _StepState
    from offload._tiers import TierKind


# NOTE [ A full pool waits for what is in flight ]
#     Host regions of the pool (shared by the host tier, NVMe staging and, on CUDA, every
#     D2H copy) go back when the copies and file writes that use them complete. A pool
#     allocation that fails while some are in flight waits for the oldest copy out (an
#     NVMe record's staging goes back once its file write ends; on CUDA its D moves it to
#     the file writes), then for the oldest file write, then for an NVMe reload's read
#     (landed, its staging goes after R), then for staging regions and families waiting
#     for their events (rule 4), retrying after each; only once nothing in flight can
#     give room back does the record go to the next tier (a spill) or the error reach the
#     user. An unpack's reload waits the same way for NVMe staging.


def wait_for_room(ex: Executor, step: _StepState | None) -> bool:
    """Wait for the oldest transfer in flight that holds pool memory and give back what
    finished; False when none is left (NOTE [ A full pool waits for what is in flight ])."""
    used = ex.pool.used_bytes
    ex.poll()
    if ex.pool.used_bytes < used:
        return True  # transfers that finished meanwhile gave room back
    wait = _oldest_holding_room(ex)
    if wait is None:
        return False
    if step is not None:  # counted first: a test's copy engine may hold it back till then
        step.stats.backpressure_waits += 1
    with contextlib.suppress(storage.StorageError):
        wait()  # a failure is handled by poll(): next tier, or the pinned copy is kept
    ex.poll()
    return True


def _oldest_holding_room(ex: Executor) -> Any:
    """How to wait for the oldest transfer in flight whose end gives pool memory back (in
    the order of NOTE [ A full pool waits for what is in flight ]); None when none is."""
    if ex._orphans:
        return ex._orphans[0][0].wait  # its family is gone
    if ex._inflight:
        return functools.partial(wait_copy_out, ex, ex._inflight[0])
    if ex._writing:
        return ex._writing[0][1].wait
    for fam, _ in ex._reading:
        # A read that is done was landed by poll (its staging goes after R), or failed
        # (its unpack raises): waiting for it again gives nothing back.
        if fam.staging is not None and fam.reload is not None and not fam.reload.done():
            return fam.reload.wait
    if ex._pending_regions:
        return ex._pending_regions[0][1].synchronize  # rule 4: R, the copy reading it
    if ex._pending_free:
        return functools.partial(_wait_events, ex, ex._pending_free[0])
    return None


def _wait_events(ex: Executor, fam: Family) -> None:
    """Rule 4: wait for every transfer and event that may still touch ``fam``'s regions."""
    _release.wait_transfers(ex, fam)
    for event in (fam.source_event, fam.reload_event):
        if event is not None:
            event.synchronize()


def write_waiting(
    ex: Executor,
    step: _StepState,
    tier: storage.Tier,
    source: torch.Tensor,
    fam: Family,
    kind: TierKind,
) -> Any:
    """CPU device: ``tier.write(source)`` (``fam``'s, in a tier of ``kind``), waiting for room
    when the pool is full (its region, or NVMe staging; NOTE [ A full pool waits for what is
    in flight ])."""
    while True:
        try:
            if fam.dense is not None and kind.in_host_memory:
                # A whole tensor, as itself (NOTE [ Whole tensors ] in _family.py).
                return tier._write_whole(source, fam.nbytes, fam.dense)  # type: ignore[attr-defined]
            return tier.write(source)
        except storage.StorageFullError as e:
            # directory None: host memory (a tier's own cap or disk names its directory).
            if e.directory is not None or not wait_for_room(ex, step):
                raise


def wait_oldest_write(ex: Executor, step: _StepState) -> None:
    """GPU + NVMe: wait for the oldest file write still holding pinned staging (a failure
    is handled by _poll_writes), then give back what finished."""
    step.stats.backpressure_waits += 1
    with contextlib.suppress(storage.StorageError):
        ex._writing[0][1].wait()
    ex._poll_writes()


def bound_inflight(ex: Executor, step: _StepState, incoming: int) -> None:
    # Rule 2: wait on the oldest copies until the new one fits the in-flight bound.
    while (ex._inflight or ex._orphans) and (
        ex._inflight_bytes + ex._orphan_bytes + incoming > ex.max_inflight_bytes
    ):
        step.stats.backpressure_waits += 1
        if ex._orphans:
            with contextlib.suppress(storage.StorageError):
                ex._orphans[0][0].wait()  # its family is gone: an error changes nothing
        else:
            wait_copy_out(ex, ex._inflight[0])
        ex.poll()


def wait_copy_out(ex: Executor, fam: Family) -> None:
    if ex.cuda:
        # Rule 2: the oldest D. An NVMe record's file write goes on from pinned staging
        # (bounded by staging_bytes): device memory is freed at PCIe speed, not disk speed.
        if fam.source_event is not None:
            fam.source_event.synchronize()
        return
    with contextlib.suppress(storage.StorageError):
        fam.handle.wait()  # a failure is handled by poll(): next tier, or keep the source


def reload_waiting(ex: Executor, fam: Family) -> None:
    """``_start_reload`` for an unpack, waiting for room when the pool has none for the
    NVMe staging (NOTE [ A full pool waits for what is in flight ])."""
    while True:
        try:
            _reload.start_reload(ex, fam)
            return
        except storage.StorageFullError as e:
            if e.directory is not None or not wait_for_room(ex, ex.step):
                raise
