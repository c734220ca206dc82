"""The executor: moves alias families off the compute device and back, in the stream order below.

It knows families, tiers, streams and events; the manager (``_offloader.py``) decides which saved
tensors come here and when backward is about to need them.

NOTE [ Stream ordering ]
    These rules and no others (docs/design.md; each, broken, gives a silent wrong gradient):
    1. Offload: pack records event P on the current stream (a deferred pack: on the stream that
       was current at its pack, see NOTE [ Fill after pack ]); the D2H stream waits on P, copies
       into a host region, records D. The family keeps its source (``t.detach()``'s bytes) until D is
       seen complete (polled at every pack and module boundary); sources get no record_stream.
    2. Back-pressure: bytes of copies not yet seen complete never exceed ``max_inflight_bytes``;
       beyond it pack waits on the oldest D.
    3. Reload: the destination is allocated on the current (compute) stream, because the caching
       allocator reuses a block only on the stream that allocated it; the H2D stream waits on an
       event recorded right after that allocation and on D, copies, records R; unpack makes the
       current stream wait on R. While the source is still held, unpack returns views of it and
       nothing is copied. An unpack on a stream other than the allocating one marks the buffer
       used there (NOTE [ Reload buffers used on another stream ]).
    4. Host regions and file ranges are freed only after the last event that read or wrote them
       (D, R, or the tier's own transfer) completed; CPU code never reads a region before D.
    5. On CUDA, unpack and backward pre-hooks run on the autograd device thread; on CPU in the
       caller's. All executor state sits behind one lock; nothing is thread-local.
    On a CPU-only machine the "device" is the CPU: copies go through ``storage``'s copy engine
    (synchronous, or deferred with random delays in tests) and ``.wait()`` is the only ordering.
    Who waits how: ``torch.cuda.Event()`` defaults to ``blocking=False``, and
    ``Event.synchronize()`` (``cudaEventSynchronize``, GIL released) then waits as the device's
    schedule flag says: under the default ``cudaDeviceScheduleAuto``, with no more CUDA contexts
    than cores, the CPU thread spins until the event completes. ``blocking=True`` adds
    ``cudaEventBlockingSync``: the thread sleeps until woken (torch/cuda/streams.py:174,183-192 and
    245-254; the flags in torch/csrc/cuda/Event.cpp, THCPEvent_pynew; c10/cuda/CUDAEvent.h:218-226,
    263). The flag changes nothing else: ``query()`` (``cudaEventQuery``, CUDAEvent.h:103-119) and
    stream waits (``cudaStreamWaitEvent``) behave the same. The compute thread keeps spinning
    events (its back-pressure waits on D are stalls; a sleeping thread wakes later). An NVMe
    write's I/O threads wait for D before reading staging, each piece's thread on its own (up to
    ``io_threads``, 8, per record): they get a blocking event recorded right after D, so a record
    waiting for its D2H copy keeps no core busy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload import _backpressure, _faults, _lookahead, _release, _reload, storage
from offload._device import DeviceStreams, GraphCapture, copy_streams
from offload._errors import from_storage, modified_after_save
from offload._family import (
    CONJ,
    NEG,
    Family,
    Life,
    _Member,
    span_of,
    storage_bytes,
)
from offload._points import point
from offload._stats import StepStats
from offload._tiers import TierKind, kind_of
from offload.lifecycle._simulate import automatic_bounds
from offload.lifecycle._trace import WHOLE_STORAGE_FACTOR
from offload.storage._tier import written_at_once
from offload.storage._transfer import reset_in_forked_child

log = logging.getLogger("offload")

# NOTE [ Objects per saved tensor ]
#     What a pack makes and holds until backward outlives the collector's young generations:
#     each such object goes to the oldest one, and CPython (3.11 to 3.13) runs a full
#     collection, a walk over every object of the process, once the objects moved there since
#     the last one outnumber a quarter of those there then. So each object held per saved
#     tensor costs about four objects' walk of a full collection, whatever the process's size.
#     bench_hooks' min-memory step at da2bc86 held 7.1 objects per saved tensor (the identity
#     pair: 0.5), and the collector took 20.7 us per saved tensor, 16.3 of it in full
#     collections (the identity pair: 0.2). So a pack holds nothing it can do without: a
#     member's size is a plain tuple (one of ints, which the collector stops tracking at its
#     first pass; a torch.Size it tracks for good), a storage with one family maps to that
#     family rather than to a list, and a host range comes back with its byte view (NOTE
#     [ Recent regions ] in storage/_pool.py), 5.6 per saved tensor at 9aecf2a. A member is
#     then counted by its family's token, not by a weak reference in a list per family (NOTE
#     [ Member tokens ] in _family.py), and an unpack trigger names its one family without a
#     list: 4.1 per saved tensor in min-memory mode, 3.3 under the plan (bench_hooks' steps).
#     Left: the member; the family with the weak references to its storage and its root
#     (both needed: NOTE [ Alias handling ]); the tier's handle; and the node object torch
#     keeps once a pack asked for ``grad_fn``. Under a plan a kept tensor holds its detached
#     tensor, and its storage object with the weak reference that ``Step.kept_by_plan`` asks.
#     The cpu tier's host region is the step before's object (NOTE [ Reused region objects ]
#     in storage/_pool.py): 3.75 -> 3.19 objects per saved tensor at c05aa15 in min-memory
#     mode, counted as every object the collector tracks that a forward made and still holds,
#     and the collector's time per step 6.05 -> 3.71 ms (full collections every 12 steps,
#     then every 20).


class _StepState:
    """The families of one step, in pack order, and what is in flight."""

    def __init__(self, index: int, host_allocations: int = 0) -> None:
        self.index = index
        self.ref = weakref.ref(self)  # its families' ``step_ref``
        self.host_allocations = host_allocations  # the pool's count of slabs when it began
        self.families: list[Family] = []
        # Families by ``id()`` of their storage: one family, or a list of them.
        self.by_storage: dict[int, Family | list[Family]] = {}
        self.prefetch_next = -1  # highest family order the look-ahead has not passed yet
        self.walk_task = -1  # the backward (graph task) the look-ahead last walked in
        # Where the last walk stopped for the window, if it did (NOTE [ A walk that stops
        # again ] in _lookahead.py): (family, bytes ahead, largest family).
        self.stopped: tuple[Family, int, int] | None = None
        self.stored_bytes = 0  # bytes of its families (the automatic look-ahead's measure)
        # The automatic look-ahead window, and the (largest family, stored bytes) it is for.
        self.window = 0
        self.window_of = (-1, -1)
        self.revisit: list[Family] = []  # passed while their copy out was still in flight
        # Named by a backward trigger, by order: reloaded under the window (NOTE [ Module
        # triggers under the window ]).
        self.wanted: dict[int, Family] = {}
        # Under a plan: trigger key -> families whose reload it starts (filled at pack): an
        # unpack's, one family or a list; a backward trigger's, a list.
        self.triggers: dict[tuple[str, str, int, int], Family | list[Family]] = {}
        # False under a plan: reloads start at their planned triggers only, never through the
        # look-ahead window (which would bring back more than the plan's budget allows).
        self.windowed = True
        self.stats = StepStats(steps=1)
        self.started_s = time.perf_counter()
        self.failed = False
        self.counted = False  # its stats are in the manager's totals (see Executor.count_step)
        self.backward_seen = False  # its backward's end is queued (stats.step_s)


class Executor:
    """Offload and reload alias families for one manager.

    Args:
        device: the compute device (CPU on a CPU-only machine).
        tiers: ``storage`` tiers in spill order.
        cpu_budget_bytes: the most bytes this manager keeps in the cpu tier.
        max_inflight_bytes: back-pressure bound on copies out in flight; 0 = twice the largest
            family seen so far, at least 256 MiB.
        prefetch_bytes: how many reloaded-but-unused bytes backward may run ahead by; 0 = a
            quarter of the bytes the step stored, at least twice the largest family, at most
            the automatic ``max_inflight_bytes`` (see ``_lookahead.window_bytes``).
        pool: host regions for D2H copies and NVMe staging (GPU paths).
        staging_bytes: the most pinned bytes NVMe writes may hold while the disk catches up.
        room: whether a reload buffer of that many bytes fits on the device now; a prefetch
            that does not is skipped (see NOTE [ Prefetch under memory pressure ]). ``None``:
            every prefetch is tried.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        tiers: Sequence[storage.Tier],
        cpu_budget_bytes: int,
        max_inflight_bytes: int,
        prefetch_bytes: int,
        pool: storage.HostPool,
        staging_bytes: int = 0,
        room: Callable[[int], bool] | None = None,
    ) -> None:
        self.device = device
        self.room = room
        # See NOTE [ No query while capturing ] in _device.py: every completion query goes
        # through it; ``_in_capture`` is its last answer on the step's threads.
        self.capture = GraphCapture(device)
        self._in_capture = False
        self.cuda = device.type == "cuda"
        self.tiers = list(tiers)
        self.cpu_budget_bytes = cpu_budget_bytes
        self._max_inflight_bytes = max_inflight_bytes
        self._prefetch_bytes = prefetch_bytes
        self._largest = 0  # bytes of the largest family stored so far
        self.pool = pool
        self.lock = threading.RLock()
        self.step: _StepState | None = None
        self.cpu_bytes = 0  # this manager's bytes in the cpu tier, as the pool counts them
        self._next_fid = 0
        self._pending_free: list[Family] = []  # GPU: freed families waiting for D / R
        self._pending_regions: list[tuple[Any, Any]] = []  # GPU: staging waiting for R
        # GPU: (before, after, step) events around compute waits on R, not yet read (NOTE
        # [ Stall time on CUDA ]).
        self._stall_marks: list[tuple[Any, Any, _StepState]] = []
        # Copies out not yet seen complete, oldest first, of every step: a step's last copies are
        # often still in flight when the next step begins (pipelining, two forwards before their
        # backwards), and they must still be retired (their sources dropped) and counted by
        # back-pressure.
        self._inflight: deque[Family] = deque()
        self._deferred_releases: deque[tuple[Family, int, int, int]] = deque()  # see release()
        self._inflight_bytes = 0
        # CPU device: writes whose family was freed first (backward ran ahead of a slow tier),
        # each with its bytes. They still read their sources and count toward the in-flight
        # bound until they end: uncounted, they piled up with their sources, without bound, when
        # the tier was slower than the steps.
        self._orphans: deque[tuple[storage.Transfer, Family, storage.Tier]] = deque()  # + the tier
        self._orphan_bytes = 0
        # Counts moved after their step was folded into the manager's totals (a write that failed
        # late, see _faults.recount): the manager adds these to its totals (take_late).
        self.late = StepStats()
        self._failed_tiers: set[str] = set()  # tiers a late write failure was logged for
        # Per tier: the last step a record of it failed in, and how many consecutive steps did
        # (NOTE [ Quarantined tiers ]).
        self._failing: dict[str, tuple[int, int]] = {}
        self.quarantined: list[str] = []  # tier names set aside, in order
        self.warn_once: Callable[[str, str], None] | None = None  # the manager's, set by it
        self._forked = False  # a forked child that has not yet dropped the parent's families
        reset_in_forked_child(self)
        self._ahead_bytes = 0  # see _reload.mark_ahead
        # GPU + NVMe: records whose file write runs from pinned staging, oldest first, each with
        # its write's handle (kept here: freeing the family clears ``fam.handle``).
        self._writing: deque[tuple[Family, Any]] = deque()
        self._writing_bytes = 0
        self.staging_bytes = staging_bytes
        # NVMe reloads whose file read runs, each with the event recorded right after its
        # destination's allocation (GPU; None on CPU): see NOTE [ NVMe reloads land early ].
        self._reading: list[tuple[Family, Any]] = []
        self.landed_early = 0  # NVMe reloads taken to the device before their unpack
        self._d2h: Any = None
        self._h2d: Any = None
        # Families whose bytes are not dropped yet (held here, so that one whose release was cut
        # short is still found: see _release.release_lost).
        self._live: dict[Family, None] = {}
        self.meter: Any = None  # offload._live.SavedBytes while one counts reload buffers
        # Which stream an op ran on (NOTE [ Stream ordering ]); injected, so CPU tests can see it.
        self.streams = DeviceStreams(device)
        if self.cuda:
            # Drawn here, never at import: see "Importing is free", and NOTE [ Copy streams ].
            self._d2h, self._h2d = copy_streams(device)

    @property
    def max_inflight_bytes(self) -> int:
        return self._max_inflight_bytes or automatic_bounds(self._largest, 0)[0]

    # -- steps -------------------------------------------------------------------------------

    def begin_step(self, index: int) -> StepStats:
        with self.lock:
            _release.forget_parent(self)
            capturing = self._capturing()  # see NOTE [ No query while capturing ]
            if not capturing:
                _release.drain_releases(self)
                _release.release_lost(self)
            self.step = _StepState(index, self.pool.host_allocations)
            if not capturing:
                _release.collect_pending(self)
            return self.step.stats

    def _capturing(self) -> bool:
        """Whether a CUDA graph capture runs (NOTE [ No query while capturing ]); the answer
        is kept for releases on other threads."""
        capture = self.capture
        self._in_capture = now = capture.possible and capture.capturing()
        return now

    def count_host_allocations(self) -> None:
        """The current step's ``stats.host_allocations``: slabs the host pool (shared with other
        managers) allocated since the step began."""
        with self.lock:
            step = self.step
            if step is not None:
                step.stats.host_allocations = self.pool.host_allocations - step.host_allocations

    def fail_step(self) -> None:
        """The step's block raised: drop every family of the step now (their handles may live on
        in a traceback) and release their bytes. A later unpack raises ``OffloadError``."""
        with self.lock:
            step = self.step
            if step is None:
                return
            step.failed = True
            if not step.families:
                return  # (a step inside a CUDA graph capture: abandon's waits are forbidden)
            _release.abandon(
                self,
                step.families,
                f"the step that saved this tensor (step {step.index}) raised; its offloaded "
                "activations were released. Run forward again.",
            )
            # Earlier steps' copies stay in flight (their graphs may still run backward).
            self._inflight = deque(f for f in self._inflight if f.life is Life.COPYING_OUT)
            self._inflight_bytes = sum(f.nbytes for f in self._inflight)

    def count_step(self) -> None:
        """The manager added the current step's stats to its totals: a count moved later goes to
        ``late`` (see ``_faults.recount``)."""
        with self.lock:
            if self.step is not None:
                self.step.counted = True

    def settle(self) -> None:
        """Wait for every write still running and account for how each ended (a failed one
        moves its record's counts, see ``_faults.recount``): the stats read next are final. A stats
        read calls it (``ActivationOffloader.stats``)."""
        with self.lock:
            _release.forget_parent(self)
            capturing = self._capturing()  # see NOTE [ No query while capturing ]
            if not capturing:
                _release.drain_releases(self)
            with point("drain"):
                writes = [f.handle.written for f in self._inflight if f.handle is not None]
                writes += [written for written, _, _ in self._orphans]
                writes += [handle.written for _, handle in self._writing]
                for written in writes:
                    with contextlib.suppress(storage.StorageError):
                        written.wait()  # a failure is handled by poll(): next tier, or recounted
                if self._stall_marks and not capturing:
                    _reload.gather_stalls(self, wait=True)
                self.poll()

    def take_late(self) -> StepStats:
        """Counts moved since the last call for steps already in the manager's totals (see
        ``_faults.recount``), for those totals; they start again from zero."""
        with self.lock:
            late, self.late = self.late, StepStats()
            return late

    def device_saved_bytes(self) -> int:
        """Saved bytes this executor holds on the device now, roughly: sources of copies out
        in flight and reloads not yet unpacked (the profiling step's memory probe subtracts
        them, see ``ActivationOffloader``)."""
        return self._inflight_bytes + self._orphan_bytes + self._ahead_bytes

    def live_families(self) -> int:
        with self.lock:
            _release.forget_parent(self)
            if not self._capturing():  # see NOTE [ No query while capturing ]
                _release.drain_releases(self)
                _release.release_lost(self)
            return sum(1 for f in self._live if f.life is not Life.FREED)

    # -- offload -----------------------------------------------------------------------------

    def offload(
        self,
        t: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None = None,
        stream: Any = None,
        key: Any = None,
        st: torch.UntypedStorage | None = None,
        n: int = -1,
        item: int = 0,
    ) -> _Member:
        """Store ``t``'s family (once per family) and return the member handle.

        ``tier``: the tier a plan chose (``"cpu"`` or ``"nvme"``), tried first; the others
        follow in their order (a fallback, counted). ``None``: the tiers in order.
        ``stream``: the stream the op that saved ``t`` ran on, when that is not the current
        one (a deferred pack, NOTE [ Fill after pack ]); the copy is ordered after its work.
        ``key``: the pack's record key, kept by the member (its unpack's triggers). ``st``,
        ``n``, ``item``: ``t.untyped_storage()``, ``t.numel()`` and ``t.element_size()``, when
        the caller read them already (a pack: each fact of a tensor is read once).
        """
        base = t._base  # its version root (lifecycle.version_root): a view's base, else t
        root = t if base is None else base
        if st is None:
            st, n, item = t.untyped_storage(), t.numel(), t.element_size()
        version = t._version
        stride = t.stride()
        bits = (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)
        # span_of(t), inline (once per saved tensor); the member keeps ``start``.
        # (An int, not a SymInt: packs run eagerly.)
        start: int = t.storage_offset() * item  # type: ignore[assignment]
        contiguous = False
        if n == 0:
            end = start
        elif t.is_contiguous():  # the common case: its elements are one dense run
            end = start + n * item
            contiguous = True
        else:
            end = span_of(t)[1]
        size = tuple(t.shape)
        with self.lock:
            step = self.step
            assert step is not None, "offload outside a step"
            self._poll()
            fam = None
            got = step.by_storage.get(id(st))
            if got is not None:
                # (A storage's one family itself, else a list: NOTE [ Objects per saved tensor ].)
                same_id = (got,) if isinstance(got, Family) else got
                dead = False
                for f in same_id:
                    # See NOTE [ Alias handling ].
                    held = f.storage_ref()
                    if held is not st:
                        dead = dead or held is None
                        continue
                    if (
                        f.root_ref() is root
                        and f.version == version
                        and f.covers(start, end)
                        and f.life is not Life.FREED
                    ):
                        fam = f
                        break
                if dead:
                    # Families of storages that died since: the id is another storage's now, and
                    # they can match no pack again. Kept, the lists grew all step long (the
                    # allocator hands a freed object's address out again soon), and each pack
                    # walked them.
                    live = [f for f in same_id if f.storage_ref() is not None]
                    if not live:
                        del step.by_storage[id(st)]
                    else:
                        step.by_storage[id(st)] = live[0] if len(live) == 1 else live
            if fam is None:
                # What is copied, and the guard: ``t.detach()``, not the graph (see NOTE [ Alias
                # handling ]). A member of a family stored already needs no copy of its own.
                # A whole tensor if its bytes are its storage's (_new_family asks that).
                plain = contiguous and start == 0 and not bits and type(t) is torch.Tensor
                fam = self._new_family(
                    step, t.detach(), st, root, base is not None, version, start, end, module,
                    tier, stream, bits, stride, (t.dtype, size, stride) if plain else None,
                )  # fmt: skip
            else:
                step.stats.records_deduplicated += 1
            # ``size``: a plain tuple of ints, which the collector stops tracking (a torch.Size
            # it tracks for good: NOTE [ Objects per saved tensor ]).
            member = _Member(self, fam, t.dtype, size, stride, start, bits, dtensor, key)
            fam.members += 1
            return member

    def again(self, m: _Member, key: Any) -> _Member | None:
        """The handle for a second pack of the tensor the same op packed as ``m`` just now (NOTE
        [ Packed again ] in _pack.py): ``m`` itself where no record key tells the two apart (a
        min-memory step), else a handle of its own for ``key``. None when the family is gone."""
        fam = m.family
        with self.lock:
            step = self.step
            if fam.life is Life.FREED or step is None:
                return None
            step.stats.records_deduplicated += 1
            fam.members += 1
            if key is None and m.key is None:
                m.holders += 1
                return m
            return _Member(self, fam, m.dtype, m.size, m.stride, m.offset_bytes, m.bits, None, key)

    def share(self, m: _Member) -> _Member | None:
        """Another handle on ``m``'s family, rebuilding the same view (a recipe's use of its
        parent: the family's bytes then stay until both handles have been unpacked or died).
        ``None`` when the family is gone."""
        with self.lock:
            fam = m.family
            if fam.life is Life.FREED or fam.error is not None:
                return None
            twin = _Member.__new__(_Member)
            for name in _Member.__slots__:
                if name != "__weakref__":
                    setattr(twin, name, getattr(m, name))
            twin.key, twin.seq, twin.holders = None, -1, 1
            fam.members += 1
            return twin

    def _new_family(
        self,
        step: _StepState,
        t: torch.Tensor,
        st: torch.UntypedStorage,
        root: torch.Tensor,
        view: bool,
        version: int,
        start: int,
        end: int,
        module: str,
        tier: str | None = None,
        stream: Any = None,
        bits: int = -1,
        stride: tuple[int, ...] | None = None,
        dense: tuple[Any, ...] | None = None,
    ) -> Family:
        # See NOTE [ Alias handling ]: a view spanning at least a quarter of its storage brings
        # the whole storage along (WHOLE_STORAGE_FACTOR, which a trace's family spans follow
        # too), so sibling views packed later (q, k and v of one qkv output)
        # find their bytes already stored; a small slice of a large storage copies only itself,
        # and so does a tensor that is no view (its siblings count versions apart: none can join).
        whole = st.nbytes()
        if dense is not None and end - start != whole:
            dense = None  # ``t``'s own bytes are not its storage's whole (checked before a view
            # is widened to the whole storage below: ``t`` would be too small a source then)
        if view and whole <= WHOLE_STORAGE_FACTOR * (end - start):
            start, end = 0, whole
        fam = Family(
            self._next_fid, st, root, version, start, end - start, st.data_ptr(), module,
            len(step.families), step.ref,
        )  # fmt: skip
        self._next_fid += 1
        if dense is not None:
            # The storage's whole bytes are ``t``'s elements: copied as ``t`` itself (NOTE
            # [ Whole tensors ] in _family.py).
            fam.dense = dense
            source = t
        else:
            source = storage_bytes(t, start, end, bits, stride)
        self._store(step, fam, source, tier, stream)
        fam.guard = t
        step.families.append(fam)
        step.stored_bytes += fam.nbytes
        got = step.by_storage.get(id(st))  # (one family, or a list of several)
        if got is None:
            step.by_storage[id(st)] = fam
        elif isinstance(got, Family):
            step.by_storage[id(st)] = [got, fam]
        else:
            got.append(fam)
        step.prefetch_next = fam.order
        self._live[fam] = None
        return fam

    def _store(
        self,
        step: _StepState,
        fam: Family,
        source: torch.Tensor,
        prefer: str | None = None,
        stream: Any = None,
    ) -> None:
        """Start the copy out into the first tier with room (NOTE [ Stream ordering ] rule 1);
        ``prefer`` names a tier to try first; ``stream`` the stream that wrote the source when
        it is not the current one."""
        n = fam.nbytes
        if n > self._largest:
            self._largest = n
        if self._inflight or self._orphans:
            _backpressure.bound_inflight(self, step, n)
        region = None
        event = None
        # P (rule 1) on the stream of the op that saved the tensor: the current one at its pack,
        # else the one a deferred pack remembered (NOTE [ Fill after pack ]). Recorded on the
        # stream current at the flush, P did not order the copy after a fill queued on another
        # stream (an op run under torch.cuda.stream(s2)): its stale bytes were stored.
        packed = self.streams.record(stream if stream is not None else self.streams.current())
        if self.cuda:
            # Pinned staging of NVMe writes is bounded too: disk slower than PCIe must not
            # exhaust the pool.
            while self._writing and self._writing_bytes + n > self.staging_bytes:
                _backpressure.wait_oldest_write(self, step)
            # The D2H copy lands in a pinned region; for NVMe that region is staging. A full
            # pool first gets back what copies and file writes in flight hold (NOTE [ A full
            # pool waits for what is in flight ]).
            while region is None:
                try:
                    region = self.pool.allocate(n)
                except storage.StorageFullError as e:
                    if not _backpressure.wait_for_room(self, step):
                        raise from_storage(
                            e, "no pinned host memory for a D2H copy (raise cpu_budget)"
                        ) from e
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(packed)  # rule 1: the copy reads t only after P
                # (A whole tensor into the region's view of its shape: NOTE [ Typed copies ].)
                dense = fam.dense
                dst = region._shaped(dense) if dense is not None else region.tensor[:n]
                dst.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)  # D: the host region holds the bytes
        last_error: BaseException | None = None
        failed: tuple[str, BaseException] | None = None  # the first tier that failed, not full
        tiers = tuple(self.tiers)  # a copy: a failure below may quarantine one
        if prefer is not None and prefer != tiers[0].name:
            tiers = tuple(sorted(tiers, key=lambda t: t.name != prefer))
        try:
            for tier in tiers:
                kind = kind_of(tier)
                charge = kind.charge(n)
                if self.cpu_bytes + charge > self.cpu_budget_bytes:  # see cpu_charge
                    last_error = storage.StorageFullError(
                        f"cpu_budget of {self.cpu_budget_bytes} bytes is used up "
                        f"({self.cpu_bytes} held); {charge} more needed",
                        bytes_needed=n,
                    )
                    continue
                try:
                    if region is not None and kind.in_host_memory:
                        handle = tier.write(region, n)  # adopts the region; D orders the reads
                    elif region is not None:
                        # The I/O threads wait for D before reading the staging region, which stays
                        # the record's copy until the file write completed (see _poll_writes).
                        # They wait on an event of their own: see NOTE [ Stream ordering ], "Who
                        # waits how".
                        handle = tier.write(region, n, after=self._io_event())
                        fam.spill = region
                    else:
                        handle = _backpressure.write_waiting(self, step, tier, source, fam, kind)
                except storage.StorageError as e:  # full, or an I/O error: the next tier
                    with point("fault", f"writing to the {tier.name} tier"):
                        last_error = e
                        if e.errno is not None and failed is None:  # the OS said so: say it once
                            failed = (tier.name, e)
                        _faults.tier_failed(self, tier, step, e)
                    continue
                if (
                    tier is not tiers[0]
                    or last_error is not None
                    or (prefer is not None and prefer != tier.name)
                ):
                    step.stats.fallbacks += 1  # (a plan's tier may be quarantined)
                if failed is not None:
                    _faults.say_write_failed(
                        self, failed[0], fam, failed[1], f"went to the {tier.name} tier"
                    )
                break
            else:
                if region is not None:
                    # Rule 4: the D2H copy into the region may still be running.
                    assert event is not None
                    event.synchronize()
                    region.release()
                assert last_error is not None
                raise from_storage(
                    last_error,
                    f"no allowed tier ({', '.join(t.name for t in self.tiers)}) has room for {n} bytes",
                ) from last_error
        finally:
            # A caught error's traceback holds this frame: dropping it here breaks the cycle that
            # kept the frame's tensors (the saved one, its region) alive until a GC pass.
            last_error = failed = None
        fam.tier, fam.handle = tier, handle
        fam.source, fam.source_event = source, event
        fam.to(Life.COPYING_OUT)
        self.cpu_bytes += charge
        kind.count(step.stats, n)
        # In flight until a poll sees it done, a copy done in the call (a CPU device's) too:
        # the version check at its retirement (_retire) sees an in-place change that the ops
        # after the pack made, as autograd would.
        self._inflight.append(fam)
        self._inflight_bytes += n

    def _io_event(self) -> Any:
        """An event for I/O threads to wait on: D again, blocking (NOTE [ Stream ordering ])."""
        io = torch.cuda.Event(blocking=True)
        # Recorded under the lock right after D: it completes when D does, or later when another
        # manager on the device (which shares the D2H stream, NOTE [ Copy streams ]) queued a
        # copy between them; only _store queues work there.
        io.record(self._d2h)
        return io

    @staticmethod
    def _check_version(fam: Family) -> None:
        # Saved-tensor hooks switch off autograd's in-place check, and a copy racing an in-place
        # change could store either version: fail like autograd does instead of guessing.
        if fam.guard is not None and fam.guard._version != fam.version and fam.error is None:
            fam.error = modified_after_save(
                f"a tensor saved by {fam.module or '<root>'}", fam.guard, fam.version
            )

    def _copy_out_done(self, fam: Family) -> bool:
        if self.cuda:
            # The device copy may go once D completed: the bytes are in pinned memory (the host
            # tier's region, or NVMe staging whose file write goes on without it).
            return fam.source_event is None or self.capture.query(fam.source_event)
        if written_at_once(fam.handle) and not self.capture.possible:
            return True  # (a copy done in its call: no transfer to ask)
        return self.capture.done(fam.handle)

    def poll(self) -> None:
        """Retire finished copies out (drop their sources) and free what waited for events."""
        # (The lock first: dynamo cannot trace it, so a module hook it traces, of a model
        # compiled after its manager, breaks the graph here, and fullgraph=True fails with a
        # note saying why: see _warn_traced in _warnings.py.)
        with self.lock:
            self._poll()

    def _poll(self) -> None:
        """``poll`` for a caller that holds the lock (a pack, an unpack's look-ahead: once per
        saved tensor, where taking the lock again cost more than the check)."""
        if not (
            self._inflight
            or self._deferred_releases
            or self._orphans
            or self._writing
            or self._reading
            or self._pending_regions
            or self._pending_free
            or self._stall_marks
            or self._forked
        ):
            return  # nothing waits (every pack and module boundary asks)
        # (Asked only where a capture can run, or the last answer was yes: one call less per
        # pack on CPU.)
        if (self.capture.possible or self._in_capture) and self._capturing():
            return  # see NOTE [ No query while capturing ]
        if self._forked:
            _release.forget_parent(self)
        if self._deferred_releases:
            _release.drain_releases(self)
        inflight = self._inflight
        while inflight:
            fam = inflight[0]
            if not self._copy_out_done(fam):
                break
            if not inflight or inflight[0] is not fam:
                continue  # released while it was asked: see NOTE [ Re-entrant release ]
            inflight.popleft()
            self._inflight_bytes -= fam.nbytes
            self._retire(fam)
        while self._orphans and self.capture.done(self._orphans[0][0]):
            written, fam, tier = self._orphans.popleft()
            self._orphan_bytes -= fam.nbytes
            _faults.forget_failed_write(self, fam, written, tier)
        if self._writing:
            self._poll_writes()
        if self._reading:
            _reload.land_reads(self)
        if self._pending_regions or self._pending_free:
            _release.collect_pending(self)
        if self._stall_marks:
            _reload.gather_stalls(self)

    def _poll_writes(self) -> None:
        """GPU + NVMe: release the pinned copy of records whose file write completed; adopt it
        into the cpu tier (or keep it) when the write failed, so no byte is lost."""
        while self._writing and self.capture.done(self._writing[0][1]):
            fam, handle = self._writing.popleft()
            self._writing_bytes -= fam.nbytes
            region, fam.spill = fam.spill, None
            if fam.life is Life.FREED:
                _faults.forget_failed_write(self, fam, handle.written, handle.tier)
            if fam.life is Life.FREED or region is None:
                if region is not None:
                    _release.release_after(self, region, fam.reload_event)
                continue
            error = handle.written.exception(timeout=0)
            if error is None:
                # Rule 4: D and the I/O threads are done with it; a reload from it may not be.
                _release.release_after(self, region, fam.reload_event)
                continue
            _faults.staged_write_failed(self, fam, handle, region, error)

    def _retire(self, fam: Family) -> None:
        if fam.life is not Life.COPYING_OUT:
            return
        self._check_version(fam)
        fam.guard = None
        if self.cuda:
            fam.source = None  # rule 1: D completed
            fam.source_event = None
            fam.to(Life.OFF_DEVICE)
            if fam.spill is not None:
                self._writing.append((fam, fam.handle))
                self._writing_bytes += fam.nbytes
            return
        handle = fam.handle
        error = None if written_at_once(handle) else handle.written.exception(timeout=0)
        if error is None:
            fam.source = None  # the device bytes may go now
            fam.source_event = None
            fam.to(Life.OFF_DEVICE)
            return
        _faults.copy_out_failed(self, fam, error)

    def _cpu_room(self, kind: TierKind, nbytes: int) -> bool:
        """Whether ``cpu_budget`` has room for a record of ``nbytes`` in a tier of ``kind``
        (see cpu_charge)."""
        return self.cpu_bytes + kind.charge(nbytes) <= self.cpu_budget_bytes

    # -- reload ------------------------------------------------------------------------------

    def prefetch(
        self,
        needed: Sequence[Family] = (),
        step: _StepState | None = None,
        *,
        window: bool = True,
        used: Sequence[Family] = (),
    ) -> None:
        """A backward trigger: start the reloads of ``needed``, then the look-ahead's (see
        ``_lookahead.prefetch``), as one ``offload::prefetch`` point."""
        with point("prefetch"):
            _lookahead.prefetch(self, needed, step, window=window, used=used)

    def prefetch_step(self, step: _StepState, *, restart: bool = False) -> None:
        """A pipeline's backward chunk of ``step`` is about to run: start its look-ahead window
        (see ``_lookahead.prefetch_step``)."""
        with point("prefetch", "step"):
            _lookahead.prefetch_step(self, step, restart=restart)

    def unpack(self, m: _Member) -> torch.Tensor:
        """The member's tensor, with the family's bytes on the device (``_reload.unpack``)."""
        return _reload.unpack(self, m)

    # -- release -----------------------------------------------------------------------------

    def release(
        self, fam: Family, unpacked_in: int = -1, holders: int = 1, unpacks: int = 1
    ) -> None:
        """One member handle died (held by ``holders`` saved variables, unpacked ``unpacks``
        times in round ``unpacked_in``); free the family's bytes when it was the last.

        Runs from ``_Member.__del__``, so on any thread and at any allocation (a GC pass), also
        on a copy engine or I/O thread in the middle of completing a transfer that the thread
        holding the lock waits for: blocking on the lock there deadlocked ``close()``. Such a
        release is queued instead and done by the next lock holder (``_release.drain_releases``).
        """
        if (
            self._in_capture  # see NOTE [ No query while capturing ]: done after the capture
            or (self.capture.possible and self.capture.capturing())
            or not self.lock.acquire(blocking=False)
        ):
            # (deque.append is atomic)
            self._deferred_releases.append((fam, unpacked_in, holders, unpacks))
            return
        try:
            _release.release(self, fam, unpacked_in, holders, unpacks)
            if self._deferred_releases:
                _release.drain_releases(self)
        finally:
            self.lock.release()

    def _after_fork_in_child(self) -> None:
        # See NOTE [ Forked children ] in storage/_transfer.py: only a new lock here, at the
        # fork; the rest at the next call (_release.forget_parent), when the tiers' locks are new too.
        self.lock = threading.RLock()
        self._forked = True

    def close(self) -> None:
        """Release every family's bytes (later unpacks raise) and wait for copies in flight."""
        _release.close(self)
