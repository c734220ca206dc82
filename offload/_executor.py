"""The executor: moves alias families off the compute device and back, in the stream order below.

It knows families, tiers, streams and events; the manager (``_offloader.py``) decides which saved
tensors come here and when backward is about to need them.

NOTE [ Stream ordering ]
    These rules and no others (DESIGN.md; each was a silent wrong gradient when broken):
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
    waiting for its D2H copy no longer keeps up to 8 cores busy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from offload import storage
from offload._device import DeviceStreams, GraphCapture, copy_streams
from offload._errors import OffloadError, from_storage, modified_after_save
from offload._family import (
    ALIGN_BYTES,
    Family,
    Life,
    aligned_buffer,
    aligned_offset,
    rebuild,
    span_of,
    storage_bytes,
)
from offload._stats import StepStats
from offload.lifecycle._calls import graph_task
from offload.lifecycle._simulate import automatic_bounds
from offload.lifecycle._tensors import version_root
from offload.lifecycle._trace import WHOLE_STORAGE_FACTOR
from offload.storage._transfer import reset_in_forked_child
from offload.storage._units import round_up

log = logging.getLogger("offload")


_CONJ, _NEG = 1, 2  # _Member.bits

# NOTE [ Quarantined tiers ]
# A tier whose records fail in QUARANTINE_FAILING_STEPS consecutive steps (a write or a read
# raised an error other than "full": EIO, EROFS, ChecksumError from a disk losing writes) is set
# aside for the rest of the manager's life: it leaves ``Executor.tiers``, so later records go to
# the next tier (a plan's choice of it counts as a fallback), and the manager warns once. Records
# already in it stay there: their reads still go to it, and raise if they fail. A full tier is
# never set aside (space comes back), nor is the last tier left: with nothing to take its records
# each failure raises as before.
QUARANTINE_FAILING_STEPS = 3


def _step_of(fam: Family) -> _StepState | None:
    """The step that packed ``fam``, while it lives."""
    return fam.step_ref() if fam.step_ref is not None else None


def host_charge(nbytes: int) -> int:
    """What a record of ``nbytes`` takes from ``cpu_budget``: its host region, padded as the
    pool pads it (``HostPool.allocate``). Counted unpadded, one manager's padding took the
    shared pool's room that another manager had claimed for its own budget."""
    return round_up(nbytes)


class _Member:
    """What pack returns for an offloaded tensor: its family and how to rebuild the view.

    Dropping it (autograd freed the saved variable, or the graph died) releases the family's bytes
    once no member is left. Its family holds it weakly: see ``Executor._release_lost``.
    """

    __slots__ = (
        "__weakref__",
        "bits",
        "dtensor",
        "dtype",
        "executor",
        "family",
        "key",
        "offset_bytes",
        "seq",
        "size",
        "stride",
        "unpacked_in",
    )

    def __init__(self, executor: Executor, family: Family, t: torch.Tensor, dtensor: Any) -> None:
        self.key: Any = None  # (module, call index, ordinal) under a plan: unpack triggers
        self.seq = -1  # the recorder's record number during a profiling step
        self.unpacked_in = -1  # the family's unpack round it was last unpacked in
        self.executor = executor
        self.family = family
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset_bytes = int(t.storage_offset()) * t.element_size()
        # A lazy conjugate or negative view (``h.conj()``, its ``.imag``) is its bytes plus a
        # flag; copied bytes carry no flag, so the view gets its flags back at unpack.
        self.bits = (_CONJ if t.is_conj() else 0) | (_NEG if t.is_neg() else 0)
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a DTensor, else None

    def __del__(self) -> None:
        # Once per saved tensor: try/except, not contextlib.suppress (an object per call).
        try:  # noqa: SIM105
            self.executor.release(self.family, self.unpacked_in)
        except Exception:  # in a finalizer: nothing to raise to
            pass


class _StepState:
    """The families of one step, in pack order, and what is in flight."""

    def __init__(self, index: int, host_allocations: int = 0) -> None:
        self.index = index
        self.host_allocations = host_allocations  # the pool's count of slabs when it began
        self.families: list[Family] = []
        self.by_storage: dict[int, list[Family]] = {}
        self.prefetch_next = -1  # highest family order the look-ahead has not passed yet
        self.walk_task = -1  # the backward (graph task) the look-ahead last walked in
        self.stored_bytes = 0  # bytes of its families (the automatic look-ahead's measure)
        self.revisit: list[Family] = []  # passed while their copy out was still in flight
        # Named by a backward trigger, by order: reloaded under the window (NOTE [ Module
        # triggers under the window ]).
        self.wanted: dict[int, Family] = {}
        # Under a plan: trigger key -> families whose reload it starts (filled at pack).
        self.triggers: dict[tuple[str, str, int, int], list[Family]] = {}
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
        cpu_budget_bytes: the most bytes this manager keeps in the host tier.
        max_inflight_bytes: back-pressure bound on copies out in flight; 0 = twice the largest
            family seen so far, at least 256 MiB.
        prefetch_bytes: how many reloaded-but-unused bytes backward may run ahead by; 0 = a
            quarter of the bytes the step stored, at least twice the largest family, at most
            the automatic ``max_inflight_bytes`` (see :meth:`prefetch_bytes`).
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
        self.host_bytes = 0  # this manager's bytes in the host tier, as the pool counts them
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
        self._deferred_releases: deque[tuple[Family, int]] = deque()  # see release()
        self._inflight_bytes = 0
        # CPU device: writes whose family was freed first (backward ran ahead of a slow tier),
        # each with its bytes. They still read their sources and count toward the in-flight
        # bound until they end: uncounted, they piled up with their sources, without bound, when
        # the tier was slower than the steps.
        self._orphans: deque[tuple[storage.Transfer, Family, str]] = deque()  # + the tier
        self._orphan_bytes = 0
        # Counts moved after their step was folded into the manager's totals (a write that failed
        # late, see _recount): the manager adds these to its totals (take_late).
        self.late = StepStats()
        self._failed_tiers: set[str] = set()  # tiers a late write failure was logged for
        # Per tier: the last step a record of it failed in, and how many consecutive steps did
        # (NOTE [ Quarantined tiers ]).
        self._failing: dict[str, tuple[int, int]] = {}
        self.quarantined: list[str] = []  # tier names set aside, in order
        self.warn_once: Callable[[str, str], None] | None = None  # the manager's, set by it
        self._forked = False  # a forked child that has not yet dropped the parent's families
        reset_in_forked_child(self)
        self._ahead_bytes = 0  # see _mark_ahead
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
        # short is still found: see _release_lost).
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

    def prefetch_bytes(self, step: _StepState) -> int:
        """The look-ahead window for ``step``'s reloads: the given bound, else a quarter of
        the bytes ``step`` stored, at least twice the largest family and at most the automatic
        ``max_inflight_bytes``. A window of the automatic in-flight bound alone (at least 256
        MiB) brought every family of a smaller step back when its backward began, so min-memory
        mode peaked as high as keeping everything (a 4-block GPT-2-style step storing 52.4 MB:
        76,669,892 saved bytes held at once, as many as without offloading)."""
        if self._prefetch_bytes:
            return self._prefetch_bytes
        return automatic_bounds(self._largest, step.stored_bytes)[1]  # as the simulator assumes

    # -- steps -------------------------------------------------------------------------------

    def begin_step(self, index: int) -> StepStats:
        with self.lock:
            self._forget_parent()
            capturing = self._capturing()  # see NOTE [ No query while capturing ]
            if not capturing:
                self._drain_releases()
                self._release_lost()
            self.step = _StepState(index, self.pool.host_allocations)
            if not capturing:
                self._collect_pending()
            return self.step.stats

    def _capturing(self) -> bool:
        """Whether a CUDA graph capture runs (NOTE [ No query while capturing ]); the answer
        is kept for releases on other threads."""
        self._in_capture = now = self.capture.capturing()
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
                return  # (a step inside a CUDA graph capture: _abandon's waits are forbidden)
            self._abandon(
                step.families,
                f"the step that saved this tensor (step {step.index}) raised; its offloaded "
                "activations were released. Run forward again.",
            )
            # Earlier steps' copies stay in flight (their graphs may still run backward).
            self._inflight = deque(f for f in self._inflight if f.life is Life.COPYING_OUT)
            self._inflight_bytes = sum(f.nbytes for f in self._inflight)

    def count_step(self) -> None:
        """The manager added the current step's stats to its totals: a count moved later goes to
        ``late`` (see ``_recount``)."""
        with self.lock:
            if self.step is not None:
                self.step.counted = True

    def settle(self) -> None:
        """Wait for every write still running and account for how each ended (a failed one
        moves its record's counts, see ``_recount``): the stats read next are final. A stats
        read calls it (``ActivationOffloader.stats``)."""
        with self.lock:
            self._forget_parent()
            capturing = self._capturing()  # see NOTE [ No query while capturing ]
            if not capturing:
                self._drain_releases()
            writes = [f.handle.written for f in self._inflight if f.handle is not None]
            writes += [written for written, _, _ in self._orphans]
            writes += [handle.written for _, handle in self._writing]
            for written in writes:
                with contextlib.suppress(storage.StorageError):
                    written.wait()  # a failure is handled by poll(): next tier, or recounted
            if self._stall_marks and not capturing:
                self._gather_stalls(wait=True)
            self.poll()

    def take_late(self) -> StepStats:
        """Counts moved since the last call for steps already in the manager's totals (see
        ``_recount``), for those totals; they start again from zero."""
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
            self._forget_parent()
            if not self._capturing():  # see NOTE [ No query while capturing ]
                self._drain_releases()
                self._release_lost()
            return sum(1 for f in self._live if f.life is not Life.FREED)

    # -- offload -----------------------------------------------------------------------------

    def offload(
        self,
        t: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None = None,
        stream: Any = None,
    ) -> _Member:
        """Store ``t``'s family (once per family) and return the member handle.

        ``tier``: the tier a plan chose (``"host"`` or ``"nvme"``), tried first; the others
        follow in their order (a fallback, counted). ``None``: the tiers in order.
        ``stream``: the stream the op that saved ``t`` ran on, when that is not the current
        one (a deferred pack, NOTE [ Fill after pack ]); the copy is ordered after its work.
        """
        root = version_root(t)
        view = root is not t
        t = t.detach()  # what is copied, and the guard: not the graph (see NOTE [ Alias handling ])
        st = t.untyped_storage()
        version = t._version
        start, end = span_of(t)
        with self.lock:
            step = self.step
            assert step is not None, "offload outside a step"
            self.poll()
            fam = None
            same_id = step.by_storage.get(id(st))
            if same_id:
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
                    same_id[:] = [f for f in same_id if f.storage_ref() is not None]
            if fam is None:
                fam = self._new_family(
                    step, t, st, root, view, version, start, end, module, tier, stream
                )
            else:
                step.stats.records_deduplicated += 1
            member = _Member(self, fam, t, dtensor)
            fam.members += 1
            fam.member_refs.append(weakref.ref(member))
            return member

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
            twin.key, twin.seq = None, -1
            fam.members += 1
            fam.member_refs.append(weakref.ref(twin))
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
    ) -> Family:
        # See NOTE [ Alias handling ]: a view spanning at least a quarter of its storage brings
        # the whole storage along (WHOLE_STORAGE_FACTOR, which a trace's family spans follow
        # too), so sibling views packed later (q, k and v of one qkv output)
        # find their bytes already stored; a small slice of a large storage copies only itself,
        # and so does a tensor that is no view (its siblings count versions apart: none can join).
        whole = st.nbytes()
        if view and whole <= WHOLE_STORAGE_FACTOR * (end - start):
            start, end = 0, whole
        fam = Family(
            fid=self._next_fid,
            storage=st,
            root=root,
            version=version,
            span_start=start,
            nbytes=end - start,
            storage_ptr=st.data_ptr(),
            device=t.device,
            module=module,
            order=len(step.families),
            step=step,
        )
        self._next_fid += 1
        source = storage_bytes(t)[start:end]
        self._store(step, fam, source, tier, stream)
        fam.guard = t
        step.families.append(fam)
        step.stored_bytes += fam.nbytes
        step.by_storage.setdefault(id(st), []).append(fam)
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
        self._largest = max(self._largest, n)
        self._backpressure(step, n)
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
                self._wait_oldest_write(step)
            # The D2H copy lands in a pinned region; for NVMe that region is staging. A full
            # pool first gets back what copies and file writes in flight hold (NOTE [ A full
            # pool waits for what is in flight ]).
            while region is None:
                try:
                    region = self.pool.allocate(n)
                except storage.StorageFullError as e:
                    if not self._wait_for_room(step):
                        raise from_storage(
                            e, "no pinned host memory for a D2H copy (raise cpu_budget)"
                        ) from e
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(packed)  # rule 1: the copy reads t only after P
                region.tensor[:n].copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._d2h)  # D: the host region holds the bytes
        last_error: BaseException | None = None
        failed: tuple[str, BaseException] | None = None  # the first tier that failed, not full
        tiers = list(self.tiers)  # a copy: a failure below may quarantine one
        if prefer is not None and prefer != tiers[0].name:
            tiers = sorted(tiers, key=lambda t: t.name != prefer)
        try:
            for i, tier in enumerate(tiers):
                if tier.name == "host" and not self._host_room(n):
                    last_error = storage.StorageFullError(
                        f"cpu_budget of {self.cpu_budget_bytes} bytes is used up "
                        f"({self.host_bytes} held); {host_charge(n)} more needed",
                        bytes_needed=n,
                    )
                    continue
                try:
                    if region is not None and tier.name == "host":
                        handle = tier.write(region, n)  # adopts the region; D orders the reads
                    elif region is not None:
                        # The I/O threads wait for D before reading the staging region, which stays
                        # the record's copy until the file write completed (see _poll_writes).
                        # They wait on an event of their own: see NOTE [ Stream ordering ], "Who
                        # waits how".
                        handle = tier.write(region, n, after=self._io_event())
                        fam.spill = region
                    else:
                        handle = self._write_waiting(step, tier, source)
                except storage.StorageError as e:  # full, or an I/O error: the next tier
                    last_error = e
                    if e.errno is not None and failed is None:  # the OS said so: say it once
                        failed = (tier.name, e)
                    self._tier_failed(tier, step, e)
                    continue
                if i > 0 or last_error is not None or (prefer not in (None, tier.name)):
                    step.stats.fallbacks += 1  # (a plan's tier may be quarantined)
                if failed is not None:
                    self._say_write_failed(
                        failed[0], fam, failed[1], f"went to the {tier.name} tier"
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
        if tier.name == "host":
            self.host_bytes += host_charge(n)
            step.stats.bytes_offloaded_cpu += n
            step.stats.records_offloaded_cpu += 1
        else:
            step.stats.bytes_offloaded_nvme += n
            step.stats.records_offloaded_nvme += 1
        self._inflight.append(fam)
        self._inflight_bytes += n

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

    def _wait_for_room(self, step: _StepState | None) -> bool:
        """Wait for the oldest transfer in flight that holds pool memory and give back what
        finished; False when none is left (NOTE [ A full pool waits for what is in flight ])."""
        used = self.pool.used_bytes
        self.poll()
        if self.pool.used_bytes < used:
            return True  # transfers that finished meanwhile gave room back
        wait = self._oldest_holding_room()
        if wait is None:
            return False
        if step is not None:  # counted first: a test's copy engine may hold it back till then
            step.stats.backpressure_waits += 1
        with contextlib.suppress(storage.StorageError):
            wait()  # a failure is handled by poll(): next tier, or the pinned copy is kept
        self.poll()
        return True

    def _oldest_holding_room(self) -> Any:
        """How to wait for the oldest transfer in flight whose end gives pool memory back (in
        the order of NOTE [ A full pool waits for what is in flight ]); None when none is."""
        if self._orphans:
            return self._orphans[0][0].wait  # its family is gone
        if self._inflight:
            return functools.partial(self._wait_copy_out, self._inflight[0])
        if self._writing:
            return self._writing[0][1].wait
        for fam, _ in self._reading:
            # A read that is done was landed by poll (its staging goes after R), or failed
            # (its unpack raises): waiting for it again gives nothing back.
            if fam.staging is not None and fam.reload is not None and not fam.reload.done():
                return fam.reload.wait
        if self._pending_regions:
            return self._pending_regions[0][1].synchronize  # rule 4: R, the copy reading it
        if self._pending_free:
            return functools.partial(self._wait_events, self._pending_free[0])
        return None

    def _wait_events(self, fam: Family) -> None:
        """Rule 4: wait for every transfer and event that may still touch ``fam``'s regions."""
        self._wait_transfers(fam)
        for event in (fam.source_event, fam.reload_event):
            if event is not None:
                event.synchronize()

    def _write_waiting(self, step: _StepState, tier: storage.Tier, source: torch.Tensor) -> Any:
        """CPU device: ``tier.write(source)``, waiting for room when the pool is full (its
        region, or NVMe staging; NOTE [ A full pool waits for what is in flight ])."""
        while True:
            try:
                return tier.write(source)
            except storage.StorageFullError as e:
                # directory None: host memory (a tier's own cap or disk names its directory).
                if e.directory is not None or not self._wait_for_room(step):
                    raise

    def _io_event(self) -> Any:
        """An event for I/O threads to wait on: D again, blocking (NOTE [ Stream ordering ])."""
        io = torch.cuda.Event(blocking=True)
        # Recorded under the lock right after D: it completes when D does, or later when another
        # manager on the device (which shares the D2H stream, NOTE [ Copy streams ]) queued a
        # copy between them; only _store queues work there.
        io.record(self._d2h)
        return io

    def _wait_oldest_write(self, step: _StepState) -> None:
        """GPU + NVMe: wait for the oldest file write still holding pinned staging (a failure
        is handled by _poll_writes), then give back what finished."""
        step.stats.backpressure_waits += 1
        with contextlib.suppress(storage.StorageError):
            self._writing[0][1].wait()
        self._poll_writes()

    @staticmethod
    def _check_version(fam: Family) -> None:
        # Saved-tensor hooks switch off autograd's in-place check, and a copy racing an in-place
        # change could store either version: fail like autograd does instead of guessing.
        if fam.guard is not None and fam.guard._version != fam.version and fam.error is None:
            fam.error = modified_after_save(
                f"a tensor saved by {fam.module or '<root>'}", fam.guard, fam.version
            )

    def _backpressure(self, step: _StepState, incoming: int) -> None:
        # Rule 2: wait on the oldest copies until the new one fits the in-flight bound.
        while (self._inflight or self._orphans) and (
            self._inflight_bytes + self._orphan_bytes + incoming > self.max_inflight_bytes
        ):
            step.stats.backpressure_waits += 1
            if self._orphans:
                with contextlib.suppress(storage.StorageError):
                    self._orphans[0][0].wait()  # its family is gone: an error changes nothing
            else:
                self._wait_copy_out(self._inflight[0])
            self.poll()

    def _copy_out_done(self, fam: Family) -> bool:
        if self.cuda:
            # The device copy may go once D completed: the bytes are in pinned memory (the host
            # tier's region, or NVMe staging whose file write goes on without it).
            return fam.source_event is None or self.capture.query(fam.source_event)
        return self.capture.done(fam.handle)

    def _wait_copy_out(self, fam: Family) -> None:
        if self.cuda:
            # Rule 2: the oldest D. An NVMe record's file write goes on from pinned staging
            # (bounded by staging_bytes): device memory is freed at PCIe speed, not disk speed.
            if fam.source_event is not None:
                fam.source_event.synchronize()
            return
        with contextlib.suppress(storage.StorageError):
            fam.handle.wait()  # a failure is handled by poll(): next tier, or keep the source

    def poll(self) -> None:
        """Retire finished copies out (drop their sources) and free what waited for events."""
        with self.lock:
            if self._capturing():
                return  # see NOTE [ No query while capturing ]
            # (Every pack and module boundary comes here: each step is skipped when it has
            # nothing to do.)
            if self._forked:
                self._forget_parent()
            if self._deferred_releases:
                self._drain_releases()
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
                self._forget_failed_write(fam, written, tier)
            if self._writing:
                self._poll_writes()
            if self._reading:
                self._land_reads()
            if self._pending_regions or self._pending_free:
                self._collect_pending()
            if self._stall_marks:
                self._gather_stalls()

    def _poll_writes(self) -> None:
        """GPU + NVMe: release the pinned copy of records whose file write completed; adopt it
        into the host tier (or keep it) when the write failed, so no byte is lost."""
        while self._writing and self.capture.done(self._writing[0][1]):
            fam, handle = self._writing.popleft()
            self._writing_bytes -= fam.nbytes
            region, fam.spill = fam.spill, None
            if fam.life is Life.FREED:
                self._forget_failed_write(fam, handle.written, "nvme")
            if fam.life is Life.FREED or region is None:
                if region is not None:
                    self._release_after(region, fam.reload_event)
                continue
            error = handle.written.exception(timeout=0)
            if error is None:
                # Rule 4: D and the I/O threads are done with it; a reload from it may not be.
                self._release_after(region, fam.reload_event)
                continue
            self._stats_of(fam).fallbacks += 1
            self._tier_failed(handle.tier, _step_of(fam), error)
            host = next((t for t in self.tiers if t.name == "host"), None)
            if host is not None and self._host_room(fam.nbytes):
                fam.tier, fam.handle = host, host.write(region, fam.nbytes)
                self.host_bytes += host_charge(fam.nbytes)
                self._recount(fam, "nvme", "host")
                self._say_write_failed("nvme", fam, error, "went to the host tier")
                if fam.life is Life.FREED and fam not in self._live:
                    # Freed and dropped by a GC pass in that write (NOTE [ Re-entrant
                    # release ]); one still waiting for its events is dropped with this handle.
                    self._drop(fam)
            else:
                # Before the log line, which allocates: see NOTE [ Re-entrant release ].
                fam.tier = fam.handle = None
                fam.spill = region  # the record's only copy now
                self._recount(fam, "nvme", None)
                self._say_write_failed("nvme", fam, error, "stay in pinned memory")

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
        error = fam.handle.written.exception(timeout=0)
        if error is None:
            fam.source = None  # the device bytes may go now
            fam.source_event = None
            fam.to(Life.OFF_DEVICE)
            return
        # The write failed after pack returned (EIO, late ENOSPC): try the next tier from the
        # source, which is still held; with none left, keep the source where it is (its bytes stay
        # on the device and unpack returns them) and say so once.
        failed = fam.tier.name
        if failed == "host":
            self.host_bytes -= host_charge(fam.nbytes)
        # On CUDA the source is device memory, which the host tiers do not take: it stays.
        failed_in = fam.tier
        later = [] if self.cuda else self._tiers_after(failed_in)
        fam.tier = fam.handle = None  # the failed write released its own space
        self._tier_failed(failed_in, _step_of(fam), error)
        self._stats_of(fam).fallbacks += 1
        assert fam.source is not None  # held until a copy out succeeds
        for tier in later:
            if fam.life is Life.FREED:
                return  # released by a GC pass in a write below: see NOTE [ Re-entrant release ]
            if tier.name == "host" and not self._host_room(fam.nbytes):
                continue
            try:
                fam.tier, fam.handle = tier, tier.write(fam.source)
                fam.handle.wait()
            except storage.StorageError:
                continue  # a failed write released its own space
            if tier.name == "host":
                # _drop gives these back; without this, host_bytes went negative.
                self.host_bytes += host_charge(fam.nbytes)
            self._recount(fam, failed, tier.name)
            self._say_write_failed(failed, fam, error, f"went to the {tier.name} tier")
            if fam.life is Life.FREED:
                self._drop(fam)  # released while it was written: its new copy goes too
                return
            fam.source = None
            fam.to(Life.OFF_DEVICE)
            return
        self._recount(fam, failed, None)
        fam.error = None
        self._say_write_failed(failed, fam, error, f"stay on {self.device}")
        fam.tier = fam.handle = None

    def _tiers_after(self, tier: storage.Tier) -> list[storage.Tier]:
        """The tiers a record that failed in ``tier`` may go to next: those after it, or all
        that are left once it was quarantined (NOTE [ Quarantined tiers ])."""
        if tier not in self.tiers:
            return list(self.tiers)
        return self.tiers[self.tiers.index(tier) + 1 :]

    def _tier_failed(
        self, tier: storage.Tier, step: _StepState | None, error: BaseException
    ) -> None:
        """A record of ``step`` failed in ``tier``: count the consecutive failing steps, and set
        the tier aside at QUARANTINE_FAILING_STEPS (see NOTE [ Quarantined tiers ])."""
        if isinstance(error, storage.StorageFullError) or not isinstance(
            error, storage.StorageError
        ):
            return
        step = step or self.step
        if step is None:
            return
        last, run = self._failing.get(tier.name, (-2, 0))
        if step.index == last:
            return
        run = run + 1 if step.index == last + 1 else 1
        self._failing[tier.name] = (step.index, run)
        if run < QUARANTINE_FAILING_STEPS or tier not in self.tiers or len(self.tiers) < 2:
            return
        self.tiers.remove(tier)
        self.quarantined.append(tier.name)
        (self.step or step).stats.tiers_quarantined += 1
        msg = (
            f"the {tier.name} tier failed in {run} consecutive steps (the last error: {error}); "
            f"it is set aside for the rest of this manager's life and its records go to the "
            f"{self.tiers[0].name} tier (stats.tiers_quarantined counts it). Check the disk "
            "(dmesg) or point nvme_dir elsewhere, and make a new manager to use it again"
        )
        if self.warn_once is not None:
            self.warn_once(f"quarantined {tier.name}", msg)
        else:
            log.warning("offload: %s", msg)

    def _host_room(self, nbytes: int) -> bool:
        """Whether ``cpu_budget`` has room for a record of ``nbytes`` (see host_charge)."""
        return self.host_bytes + host_charge(nbytes) <= self.cpu_budget_bytes

    def _say_write_failed(self, tier: str, fam: Family, error: BaseException, now: str) -> None:
        """Log that a write into ``tier`` failed after pack returned, and where the record is
        ``now``: a warning the first time for each tier, then at debug level (a full disk fails
        every record of every step, and a warning each buried the log). ``stats.fallbacks``
        counts them all."""
        first = tier not in self._failed_tiers
        self._failed_tiers.add(tier)
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

    # -- reload ------------------------------------------------------------------------------

    def prefetch(
        self,
        needed: Sequence[Family] = (),
        step: _StepState | None = None,
        *,
        window: bool = True,
        used: Sequence[Family] = (),
    ) -> None:
        """Start the reloads of ``needed`` (backward is about to use them), then of the step's
        families below its look-ahead pointer while reloaded-but-unused bytes fit the window.

        ``step`` is the step that packed them (the current one by default): with two forwards
        before their backwards the current step may be another one. ``window=False`` (a plan
        names every reload's trigger): only ``needed``, and those of them still being copied
        out as soon as their copy completes. ``used``: the family an unpack just used (where a
        later backward's walk starts, see NOTE [ Later backward passes ]).
        """
        with self.lock:
            if step is None:
                step = self.step
            if step is None or step.failed or self._capturing():
                return  # (see NOTE [ No query while capturing ])
            window = window and step.windowed
            self.poll()
            for fam in needed:
                if window:
                    step.wanted[fam.order] = fam  # see NOTE [ Module triggers under the window ]
                elif fam.life is Life.COPYING_OUT:
                    step.revisit.append(fam)
                else:
                    self._begin_reload(fam)
            if window and needed:
                latest = max(needed, key=lambda f: f.order)
                if not (latest.unpacked and latest.unpacked_task == graph_task()):
                    self._begin_reload(latest)  # needed first: starts beyond the window too
            if not window:
                waiting, step.revisit = step.revisit, []
                for fam in waiting:
                    if fam.life is Life.COPYING_OUT:
                        step.revisit.append(fam)
                    else:
                        self._begin_reload(fam)
                return
            if step.revisit:
                # Passed while being copied out; needed before anything below the pointer.
                waiting = step.revisit
                step.revisit = [f for f in waiting if f.life is Life.COPYING_OUT]
                for fam in waiting:
                    self._begin_reload(fam)
            task = graph_task()
            if task != -1 and task != step.walk_task:
                if step.walk_task != -1:
                    # See NOTE [ Later backward passes ].
                    named = [
                        f.order
                        for f in (*needed, *used)
                        if f.step_ref is not None and f.step_ref() is step
                    ]
                    step.prefetch_next = max(named, default=len(step.families) - 1)
                step.walk_task = task
            if step.wanted:
                self._reload_wanted(step, task)
            while step.prefetch_next >= 0:
                fam = step.families[step.prefetch_next]
                if fam.life is Life.COPYING_OUT:
                    step.revisit.append(fam)
                elif (
                    fam.life is Life.OFF_DEVICE
                    and fam.members > 0
                    and not (fam.unpacked and fam.unpacked_task == task)
                ):
                    # Not one every member of which this backward has unpacked since its
                    # reload (the unpack before the walk reached it, backward's first): reused
                    # while autograd still held that buffer, it stayed to the next backward.
                    if self._ahead_bytes + fam.nbytes > self.prefetch_bytes(step):
                        break
                    if not self._begin_reload(fam):
                        break  # memory is short: the window waits for unpacks to make room
                step.prefetch_next -= 1

    # NOTE [ Module triggers under the window ]
    #     A module's backward trigger names the families its own ops packed (a module without
    #     children: all of them). In windowed mode they are reloaded under the look-ahead
    #     window too, last packed first, never all at once: a module running 8 x (matmul, tanh)
    #     would otherwise bring back every one of its saved tensors when its backward begins,
    #     as much as keeping them all. Inside one module the unpacks are the only events, so
    #     each prefetch (a trigger, and every unpack after it consumed a reload) starts the
    #     next wanted families that fit. Two start beyond the window: the one a trigger names
    #     that was packed last (the module's backward is about to unpack it), and the next one
    #     whenever nothing is reloaded ahead (one larger than the window still comes). Under a
    #     plan (``window=False``) the trigger starts what the plan said, at once. The simulator
    #     models the same rule (lifecycle/_simulate.py, NOTE [ Reload policy ]).

    def _reload_wanted(self, step: _StepState, task: int) -> None:
        """Start the families backward triggers named, last packed first, while they fit the
        window (see NOTE [ Module triggers under the window ])."""
        window = self.prefetch_bytes(step)
        for order in sorted(step.wanted, reverse=True):
            fam = step.wanted[order]
            if (
                fam.life is Life.OFF_DEVICE
                and fam.members > 0
                and not (fam.unpacked and fam.unpacked_task == task)
            ):
                if self._ahead_bytes and self._ahead_bytes + fam.nbytes > window:
                    return
                if not self._begin_reload(fam):
                    return  # memory is short: the unpacks make room
            # Reloading, resident, used by this backward, freed, or still copying out (its
            # unpack then uses the source): nothing more to start for it.
            del step.wanted[order]

    # NOTE [ Later backward passes ]
    #     A step may run several backwards over one graph (``l1.backward(retain_graph=True);
    #     l2.backward()``). The look-ahead's pointer only moves down, and the first backward
    #     takes it past the first packed family: the second got no window, only the reloads its
    #     modules' triggers and its unpacks asked for (8 x (Linear(128) + Tanh), a 4-family
    #     window: 131,072 B reloaded ahead of need midway through the first, 0 in the second).
    #     So the first prefetch under a new graph task (``torch._C._current_graph_task_id()``)
    #     of a step that an earlier backward walked starts the walk over, and the walk skips a
    #     family as already used only when this backward unpacked it (``unpacked_task``). It
    #     starts at the family packed last among those that prefetch names (the trigger's, or
    #     the one just unpacked), not at the top: the families above it were mostly saved by
    #     ops only an earlier loss reaches (``l1 = y.pow(2).mean()`` saves y, which ``l2 = y.sum()``
    #     never unpacks), and from the top the walk brought them back to be held, counted
    #     against the window, until the graph died. One the later backward does not use but
    #     that lies below the start is still brought back (the executor cannot tell: which
    #     nodes a backward runs is the engine's, and holding nodes to ask it would tie the
    #     graph into a reference cycle). Likewise a family some member of which only an
    #     earlier loss's ops saved is never unpacked by all its members again: its reload
    #     stays until the graph dies (as before; lifecycle's simulator counts it so).

    def prefetch_step(self, step: _StepState, *, restart: bool = False) -> None:
        """Start ``step``'s look-ahead window (a pipeline's backward chunk of its microbatch is
        about to run); ``restart``: from its last packed family again (a zero-bubble W chunk
        unpacks what its I chunk already did)."""
        with self.lock:
            if restart:
                step.prefetch_next = len(step.families) - 1
                for fam in step.families:
                    if fam.life is Life.OFF_DEVICE:
                        fam.unpacked = 0  # unpacked by the I chunk: the walk brings it back
                        fam.unpack_round += 1
        self.prefetch((), step)

    def _begin_reload(self, fam: Family) -> bool:
        """Prefetch ``fam``; False when memory for it is short now (a prefetch is only ahead of
        time: its unpack reloads it then, and raises there if memory is still short)."""
        if fam.life is Life.OFF_DEVICE and fam.members > 0 and not self._reuse(fam):
            if self.room is not None and not self.room(fam.nbytes + ALIGN_BYTES):
                # See NOTE [ Prefetch under memory pressure ] in _device.py.
                if self.step is not None:
                    self.step.stats.prefetches_skipped += 1
                return False
            try:
                self._start_reload(fam)
            except (torch.OutOfMemoryError, storage.StorageFullError):
                return False
        return True

    def _reload_waiting(self, fam: Family) -> None:
        """``_start_reload`` for an unpack, waiting for room when the pool has none for the
        NVMe staging (NOTE [ A full pool waits for what is in flight ])."""
        while True:
            try:
                self._start_reload(fam)
                return
            except storage.StorageFullError as e:
                if e.directory is not None or not self._wait_for_room(self.step):
                    raise

    def _mark_ahead(self, fam: Family, ahead: bool) -> None:
        # Bytes reloaded (or reused) and not yet unpacked: what the look-ahead window bounds.
        if fam.ahead != ahead:
            fam.ahead = ahead
            self._ahead_bytes += fam.nbytes if ahead else -fam.nbytes

    def _reuse(self, fam: Family) -> bool:
        """A reload whose buffer is still alive (another member holds it): keep using it."""
        raw = fam.resident_ref() if fam.resident_ref is not None else None
        if raw is None:
            return False
        fam.resident = raw
        fam.unpacked = 0
        fam.unpack_round += 1
        fam.to(Life.COPYING_IN)
        fam.to(Life.RESIDENT)
        self._mark_ahead(fam, True)
        return True

    def _start_reload(self, fam: Family) -> None:
        # Memory first: an allocation that fails (a device OOM, a full pool) leaves the family
        # off the device as it was, for the unpack to try again.
        raw, off = aligned_buffer(fam.nbytes, fam.storage_mod, self.device)
        fam.reload_stream = self.streams.current()  # the pool raw came from (rule 3)
        allocated = None
        if self.cuda and fam.spill is None and fam.tier.name != "host":
            staging = self.pool.allocate(fam.nbytes)  # NVMe -> pinned staging -> device
            if fam.life is not Life.OFF_DEVICE:
                staging.release()  # the family was released meanwhile, as below
                return
            fam.staging = staging
            # Rule 3: raw exists. Recorded now, not when the copy is issued (later, on
            # whichever thread polls): the H2D copy waits for this point of the stream raw
            # came from.
            allocated = self.streams.record(fam.reload_stream)
        if fam.life is not Life.OFF_DEVICE:
            return  # released while memory was allocated: see NOTE [ Re-entrant release ]
        fam.to(Life.COPYING_IN)
        fam.unpacked = 0
        fam.unpack_round += 1
        self._mark_ahead(fam, True)
        fam.reload_started_s = time.perf_counter()
        fam.resident, fam.resident_ref = raw, weakref.ref(raw)
        if self.meter is not None:
            self.meter.watch(raw.untyped_storage(), fam.nbytes)
        dst = raw[off : off + fam.nbytes]
        try:
            if not self.cuda:
                fam.reload = fam.tier.read(fam.handle, dst)
                if fam.tier.name == "nvme":
                    self._reading.append((fam, None))
            elif fam.spill is not None:
                # NVMe write still running (or failed): the pinned copy is right here.
                self._h2d_copy(fam, dst, fam.spill.tensor)
            elif fam.tier.name == "host":
                self._h2d_copy(fam, dst, fam.handle.region.tensor)
            else:
                # NVMe -> pinned staging (I/O threads) now; staging -> device once the read
                # is seen done (NOTE [ NVMe reloads land early ]), at the latest at unpack.
                fam.reload = fam.tier.read(fam.handle, fam.staging)
                self._reading.append((fam, allocated))
            if self.step is not None:
                # Counted in the current step (``stats.last``), like everything backward does;
                # the step that packed the family may already be folded into the totals.
                self.step.stats.reloads += 1
        except BaseException as e:
            # Nothing was started (a read that fails to start raises before queueing I/O).
            self._undo_reload(fam)
            # No local may hold the error: its traceback holds this frame (a reference cycle
            # that kept the step's families until a GC pass).
            if isinstance(e, OffloadError) or not isinstance(e, storage.StorageError):
                raise
            raise from_storage(e, f"reloading a saved tensor of {fam.module or '<root>'}") from e

    def _undo_reload(self, fam: Family) -> None:
        """A reload that failed, or never started: the family is off the device as before. Its
        staging goes back (a retry allocates new; keeping it leaked it until close), and its
        unfilled buffer is dropped, ``resident_ref`` too: an error's traceback may keep the
        buffer alive, and a later _reuse must not take it for a finished reload."""
        if fam.staging is not None:
            staging, fam.staging = fam.staging, None
            staging.release()
        self._take_reading(fam)
        fam.resident = fam.resident_ref = fam.reload = None
        self._mark_ahead(fam, False)
        fam.to(Life.OFF_DEVICE)

    # NOTE [ NVMe reloads land early ]
    #     An NVMe reload is two copies: file -> pinned staging on the I/O threads, then staging
    #     -> device on the H2D stream. Issued only at unpack, the second queued behind all the
    #     compute before it and every NVMe record cost a bubble. So each poll (every pack,
    #     module boundary, backward trigger and unpack) issues it for the reads it finds done,
    #     from the compute-side thread that polls, never from an I/O thread's callback (no CUDA
    #     work there). The H2D stream waits on the event recorded right after the destination
    #     was allocated (rule 3), not on one recorded when the copy is issued; the staging goes
    #     back after R (rule 4). A read that failed is left to its unpack, which raises. On a
    #     CPU device the read fills the destination itself and landing only takes it.

    def _land_reads(self) -> None:
        """Land every NVMe reload whose file read completed (NOTE [ NVMe reloads land
        early ]). Caller holds the lock."""
        reading, self._reading = self._reading, []
        for fam, allocated in reading:
            read = fam.reload
            if read is not None and fam.life is Life.COPYING_IN and not self.capture.done(read):
                self._reading.append((fam, allocated))
            elif read is not None and fam.life is Life.COPYING_IN:
                if read.exception(timeout=0) is not None:
                    self._reading.append((fam, allocated))  # its unpack raises the error
                    continue
                self._land(fam, allocated)
                self.landed_early += 1

    def _take_reading(self, fam: Family) -> Any:
        """Forget ``fam``'s entry among the reads in flight; its allocation event."""
        for i, (f, allocated) in enumerate(self._reading):
            if f is fam:
                del self._reading[i]
                return allocated
        return None

    def _land(self, fam: Family, allocated: Any) -> None:
        """``fam``'s NVMe read completed: on CUDA, issue staging -> device now."""
        fam.reload = None
        if self.cuda and fam.staging is not None:
            raw = fam.resident
            assert raw is not None
            off = aligned_offset(raw, fam.storage_mod)
            self._h2d_copy(fam, raw[off : off + fam.nbytes], fam.staging.tensor, allocated)
            staging, fam.staging = fam.staging, None
            self._release_after(staging, fam.reload_event)

    def _h2d_copy(
        self, fam: Family, dst: torch.Tensor, host: torch.Tensor, allocated: Any = None
    ) -> None:
        if allocated is None:
            # Rule 3: dst exists. On the stream whose pool dst came from, which is not the
            # current one when an NVMe reload's unpack (on the consumer's stream) runs this: the
            # block's earlier user on that stream must be done with it before the copy
            # overwrites it.
            allocated = self.streams.record(fam.reload_stream)
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(allocated)  # rule 3: after dst's allocation
            dst.copy_(host[: fam.nbytes], non_blocking=True)
            fam.reload_event = torch.cuda.Event()
            fam.reload_event.record(self._h2d)  # R: the device buffer holds the bytes

    def unpack(self, m: _Member) -> torch.Tensor:
        """The member's tensor, with the family's bytes on the device."""
        fam = m.family
        with self.lock:
            self._forget_parent()
            if fam.error is not None:
                raise fam.error
            if fam.life is Life.FREED:
                raise OffloadError(
                    f"saved tensor of {fam.module or '<root>'} was already released (the manager "
                    "was closed, or its step failed); run forward again"
                )
            if fam.life is Life.COPYING_OUT:
                self._check_version(fam)
                if fam.error is not None:
                    raise fam.error
            if fam.source is not None and (fam.life is Life.COPYING_OUT or fam.tier is None):
                # Rule 3: the source is still held (or storing it failed and it stayed): no copy.
                return self._wrap(m, self._source_view(m))
            # Prefetch follows the step that packed the family: with two forwards before their
            # backwards (pipelining, accumulation) the current step is another one. Counters go
            # to the current step, which is ``stats.last``.
            step = fam.step_ref() if fam.step_ref is not None else None
            stats = self.step.stats if self.step is not None else None
            prefetched = True
            if fam.life is Life.OFF_DEVICE and not self._reuse(fam):
                prefetched = False
                if stats is not None:
                    stats.stalls += 1
                self._reload_waiting(fam)
            if fam.life is Life.COPYING_IN:
                t0 = time.perf_counter()
                self._finish_reload(fam)
                if stats is not None:
                    stats.stall_s += time.perf_counter() - t0
                    if prefetched:
                        stats._leads.append(t0 - fam.reload_started_s)
            raw = fam.resident
            assert raw is not None
            consumer = self.streams.current()
            if fam.reload_stream is not None and consumer != fam.reload_stream:
                # See NOTE [ Reload buffers used on another stream ].
                self.streams.mark_used(raw, consumer)
            if self.cuda and fam.reload_event is not None:
                # Rule 3: the consumer runs on the current stream, after R. Waited at every
                # unpack, not only the one that finished the reload: a member unpacked later, or
                # one reusing a live buffer, may run on another stream.
                self._wait_reload(fam.reload_event, consumer)
            off = aligned_offset(raw, fam.storage_mod)
            out = rebuild(
                raw,
                off,
                fam,
                dtype=m.dtype,
                size=m.size,
                stride=m.stride,
                offset_bytes=m.offset_bytes,
            )
            fam.unpacked += 1
            m.unpacked_in = fam.unpack_round
            fam.unpacked_task = graph_task()
            self._mark_ahead(fam, False)
            if fam.unpacked >= fam.members:
                # Every live member has its view: drop the strong reference so the buffer dies
                # with autograd's use of it; a later unpack (retain_graph) reloads or reuses it.
                fam.resident = None
                fam.to(Life.OFF_DEVICE)
            if step is not None:
                self.prefetch((), step, used=(fam,))
            return self._wrap(m, out)

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

    def _wait_reload(self, reload_event: Any, consumer: Any) -> None:
        """Make ``consumer`` wait on R; time the wait on the device when R is not complete yet
        (NOTE [ Stall time on CUDA ])."""
        step = self.step
        # Inside a capture no query and no timing (NOTE [ No query while capturing ]).
        if step is None or self.capture.capturing() or self.capture.query(reload_event):
            consumer.wait_event(reload_event)  # complete (no stall), or nothing to count it
            return
        before = torch.cuda.Event(enable_timing=True)
        before.record(consumer)  # where the consumer's wait begins
        consumer.wait_event(reload_event)  # rule 3
        after = torch.cuda.Event(enable_timing=True)
        after.record(consumer)  # reached once R completed and the stream got there
        self._stall_marks.append((before, after, step))

    def _gather_stalls(self, wait: bool = False) -> None:
        """Add the device time of completed stall waits to ``stall_s`` (NOTE [ Stall time on
        CUDA ]); ``wait``: wait for those not complete yet."""
        marks, self._stall_marks = self._stall_marks, []
        for before, after, step in marks:
            if wait:
                after.synchronize()
            elif not self.capture.query(after):
                self._stall_marks.append((before, after, step))
                continue
            stats = step.stats if not step.counted else self.late
            stats.stall_s += before.elapsed_time(after) / 1e3

    def _finish_reload(self, fam: Family) -> None:
        try:
            if fam.reload is not None:
                fam.reload.wait()  # CPU copy, or NVMe -> staging on GPU
        except storage.StorageError as e:
            # The failed read has completed: nothing touches the staging region now.
            self._tier_failed(fam.tier, _step_of(fam), e)
            self._undo_reload(fam)
            # No local may hold the error: its traceback holds this frame (a reference cycle
            # that kept the step's families until a GC pass).
            if isinstance(e, OffloadError) or not isinstance(e, storage.StorageError):
                raise
            raise from_storage(e, f"reloading a saved tensor of {fam.module or '<root>'}") from e
        # NVMe: the bytes reached pinned staging (unless a poll already landed them); now
        # staging -> device on the H2D stream.
        self._land(fam, self._take_reading(fam))
        fam.to(Life.RESIDENT)

    def _source_view(self, m: _Member) -> torch.Tensor:
        # Views of the source only (slice, dtype view, as_strided), no ``set_``: on CUDA the D2H
        # stream may still read these bytes, and torch's CUDA sanitizer counts ``set_``'s return
        # (``Tensor(a!)``) as a write on the compute stream, unordered with that read: a data race
        # reported where there is none (torch/cuda/_sanitizer.py, ArgumentHandler.parse_outputs).
        fam = m.family
        item = m.dtype.itemsize
        src = fam.source  # uint8: the storage's bytes [span_start, span_start + nbytes)
        assert src is not None
        lo = -fam.span_start % item  # the first byte at a multiple of the item size
        usable = (src.numel() - lo) // item * item
        typed = src[lo : lo + usable].view(m.dtype)
        return typed.as_strided(m.size, m.stride, m.offset_bytes // item)

    @staticmethod
    def _wrap(m: _Member, local: torch.Tensor) -> torch.Tensor:
        if m.bits:
            if m.bits & _CONJ:
                local = local.conj()
            if m.bits & _NEG:
                local = torch._neg_view(local)
        if m.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = m.dtensor
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    # -- release -----------------------------------------------------------------------------

    def release(self, fam: Family, unpacked_in: int = -1) -> None:
        """One member handle died; free the family's bytes when it was the last.

        Runs from ``_Member.__del__``, so on any thread and at any allocation (a GC pass), also
        on a copy engine or I/O thread in the middle of completing a transfer that the thread
        holding the lock waits for: blocking on the lock there deadlocked ``close()``. Such a
        release is queued instead and done by the next lock holder (``_drain_releases``).
        """
        if (
            self._in_capture  # see NOTE [ No query while capturing ]: done after the capture
            or self.capture.capturing()
            or not self.lock.acquire(blocking=False)
        ):
            self._deferred_releases.append((fam, unpacked_in))  # deque.append is atomic
            return
        try:
            self._release(fam, unpacked_in)
            self._drain_releases()
        finally:
            self.lock.release()

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
    #     they are walked (``_collect_pending``).

    def _drain_releases(self) -> None:
        # Caller holds the lock.
        while self._deferred_releases:
            self._release(*self._deferred_releases.popleft())

    def _release(self, fam: Family, unpacked_in: int = -1) -> None:
        # ``unpacked_in``: the unpack round the dying member was last unpacked in. Unpacked
        # since the last reload, it takes that unpack with it: ``unpacked`` counts the live
        # members' unpacks, so that the last live member's unpack is the one that drops the
        # buffer. (Counted, the unpack of v by ``att @ v``, freed with its node, made the unpack
        # of k the last of q, k, v: the buffer was dropped under k's view and q's unpack
        # reloaded the family again, two buffers held at once.)
        if unpacked_in == fam.unpack_round and fam.unpacked > 0:
            fam.unpacked -= 1
        fam.members -= 1
        if fam.members > 0 or fam.life is Life.FREED:
            return
        self._unowned(fam)

    def _unowned(self, fam: Family) -> None:
        """``fam``'s last member handle is gone: free its bytes (as soon as rule 4 allows)."""
        if fam.life is Life.COPYING_OUT and fam in self._inflight:
            self._inflight.remove(fam)
            self._inflight_bytes -= fam.nbytes
            if fam.handle is not None and not self.capture.done(fam.handle):
                # Its write still runs (backward ran ahead of the tier): it stays counted.
                if fam.spill is not None:
                    # GPU + NVMe: the I/O threads read the pinned copy until the write ends; it
                    # joins the queue of such writes (the staging bound; _poll_writes releases
                    # it). Held unqueued, with its device source, nothing bounded it.
                    self._writing.append((fam, fam.handle))
                    self._writing_bytes += fam.nbytes
                elif not self.cuda:
                    self._orphans.append((fam.handle.written, fam, fam.tier.name))
                    self._orphan_bytes += fam.nbytes
            elif fam.handle is not None:
                self._forget_failed_write(fam, fam.handle.written, fam.tier.name)
        self._free(fam)

    def _free(self, fam: Family) -> None:
        self._mark_ahead(fam, False)
        # Rule 4: GPU copies that read or write the tier's region must be complete first.
        if self.cuda and not self._events_done(fam):
            fam.to(Life.FREED)
            self._pending_free.append(fam)
            return
        if fam.life is not Life.FREED:
            fam.to(Life.FREED)
        self._drop(fam)

    def _drop(self, fam: Family) -> None:
        # Safe to run again after an exception cut it short (see _release_lost): each release
        # is idempotent, and its field is cleared only after it (and after the count it moves).
        tier, handle = fam.tier, fam.handle
        if tier is not None and handle is not None:
            tier.free(handle)
            if tier.name == "host":
                self.host_bytes -= host_charge(fam.nbytes)
            fam.handle = None
        if fam.staging is not None:
            fam.staging.release()
            fam.staging = None
        if fam.spill is not None and not self._queued_write(fam):
            fam.spill.release()  # a spill still being written is released by _poll_writes
            fam.spill = None
        fam.source = fam.resident = fam.guard = None
        fam.source_event = fam.reload_event = fam.reload = None
        self._live.pop(fam, None)

    def _release_lost(self) -> None:
        """Finish releases that an exception cut short.

        A member handle is released from its ``__del__``, which autograd runs while it frees a
        graph; an exception raised there (a KeyboardInterrupt arriving, a signal handler's) is
        printed and dropped by Python, and the release stops where it was: the family kept its
        bytes, counted in ``host_bytes``, until ``close()``. Its member handles are gone,
        though (the family holds them weakly), so here, at the next step and whenever live
        families are counted, it is released; a family whose drop was cut short is dropped
        again. Caller holds the lock.
        """
        waiting = {id(f) for f in self._pending_free}
        for fam in list(self._live):
            if fam.life is not Life.FREED:
                if not any(ref() is not None for ref in fam.member_refs):
                    fam.members = 0
                    self._unowned(fam)
            elif id(fam) not in waiting:
                if self.cuda and not self._events_done(fam):
                    self._pending_free.append(fam)
                else:
                    self._drop(fam)

    def _events_done(self, fam: Family) -> bool:
        # Rule 4 covers the I/O future too: an NVMe read still filling the staging region must
        # finish before _drop hands that region back to the pool.
        if fam.reload is not None and not self.capture.done(fam.reload):
            return False
        if (
            fam.spill is not None
            and fam.handle is not None
            and not self.capture.done(fam.handle)
            and not self._queued_write(fam)
        ):
            return False  # I/O threads still read the pinned copy (unless _poll_writes frees it)
        return all(e is None or self.capture.query(e) for e in (fam.source_event, fam.reload_event))

    def _queued_write(self, fam: Family) -> bool:
        """Whether ``fam``'s file write is in the queue whose pinned copies _poll_writes frees."""
        return any(f is fam for f, _ in self._writing)

    def _collect_pending(self) -> None:
        # Swap the lists out first: a member's __del__ (gc inside _drop, same thread, re-entering
        # the RLock) may append to them meanwhile, and rebuilding them from a local copy lost it.
        regions, self._pending_regions = self._pending_regions, []
        for region, event in regions:
            if self.capture.query(event):
                region.release()
            else:
                self._pending_regions.append((region, event))
        pending, self._pending_free = self._pending_free, []
        for fam in pending:
            if self._events_done(fam):
                self._drop(fam)
            else:
                self._pending_free.append(fam)

    def _release_after(self, region: Any, event: Any) -> None:
        # Rule 4: a staging region goes back to the pool once the H2D copy reading it is done.
        if event is None or self.capture.query(event):
            region.release()
        else:
            self._pending_regions.append((region, event))

    def _abandon(self, families: Iterable[Family], why: str) -> None:
        """Free ``families`` now, whatever their state; a later unpack of one raises ``why``."""
        if self.cuda:  # rule 4: nothing may still read or write their regions
            self._d2h.synchronize()
            self._h2d.synchronize()
        for fam in families:
            if fam.life is not Life.FREED:
                fam.error = OffloadError(why)
                self._wait_transfers(fam)
                if fam.life is Life.COPYING_OUT and fam.handle is not None:
                    self._forget_failed_write(fam, fam.handle.written, fam.tier.name)
                self._free(fam)

    def _after_fork_in_child(self) -> None:
        # See NOTE [ Forked children ] in storage/_transfer.py: only a new lock here, at the
        # fork; the rest at the next call (_forget_parent), when the tiers' locks are new too.
        self.lock = threading.RLock()
        self._forked = True

    def _forget_parent(self) -> None:
        """In a forked child, at its first call: drop every family of the parent (their copies
        and reads ran on the parent's threads, which are not here; an NVMe record is in the
        parent's file), without waiting for anything; their host bytes go back to the pool. A
        graph saved before the fork raises a clear error at its unpack. Caller holds the lock.
        """
        if not self._forked:
            return
        self._forked = False
        why = (
            "this tensor was saved in the parent process before os.fork(); a forked child has "
            "none of the parent's copies, reads or I/O threads, so the offloaded activations "
            "saved before the fork were dropped here. Run forward again in this process"
        )
        if self.cuda:
            why += " (CUDA does not survive a fork: use the 'spawn' start method)"
        families = [*self._live, *self._pending_free]
        families += [fam for _, fam, _ in self._orphans] + [fam for fam, _ in self._writing]
        self._inflight.clear()
        self._orphans.clear()
        self._writing.clear()
        self._deferred_releases.clear()
        self._pending_free = []
        for region, _ in self._pending_regions:
            region.release()
        self._pending_regions = []
        for fam in families:
            if fam.error is None:
                fam.error = OffloadError(why)
            if fam.life is not Life.FREED:
                fam.to(Life.FREED)
            self._drop(fam)  # the tiers forgot the parent's transfers; no wait here
        self._live.clear()
        self._inflight_bytes = self._orphan_bytes = self._writing_bytes = self._ahead_bytes = 0
        if self.step is not None:
            self.step.families = []
            self.step.by_storage.clear()

    def _wait_transfers(self, fam: Family) -> None:
        for t in (fam.reload, getattr(fam.handle, "written", None)):
            if t is not None:
                with contextlib.suppress(storage.StorageError):
                    t.wait()

    def _forget_failed_write(self, fam: Family, written: storage.Transfer, tier: str) -> None:
        """A write of ``fam`` into ``tier`` that ended after its family was let go (freed, or
        being freed): if it failed, its bytes were never stored there, though counted so."""
        if self.capture.done(written) and written.exception(timeout=0) is not None:
            self._recount(fam, tier, None)

    def _recount(self, fam: Family, failed: str, now: str | None) -> None:
        """A write into tier ``failed`` failed after pack returned (and counted it there), and
        the record went to tier ``now`` instead (``None``: nowhere, it stayed where it was or
        was no longer needed): move its count, in its step's stats until the manager added
        those to its totals (at the next step), then in ``late``, which it adds next."""
        s = self._stats_of(fam)
        for name, sign in ((failed, -1), (now, 1)):
            if name == "host":
                s.bytes_offloaded_cpu += sign * fam.nbytes
                s.records_offloaded_cpu += sign
            elif name == "nvme":
                s.bytes_offloaded_nvme += sign * fam.nbytes
                s.records_offloaded_nvme += sign

    def _stats_of(self, fam: Family) -> StepStats:
        """Where a count about ``fam`` that changes after pack goes: its own step's stats until
        the manager added them to its totals (at the next step), then ``late``, which it adds
        next. (The current step's stats took a late failure of an earlier step's record.)"""
        step = fam.step_ref() if fam.step_ref is not None else None
        return step.stats if step is not None and not step.counted else self.late

    def close(self) -> None:
        """Release every family's bytes (later unpacks raise) and wait for copies in flight."""
        with self.lock:
            self._forget_parent()
            self._abandon(
                list(self._live),
                "the offload manager that saved this tensor was closed (by close(), or by its "
                "finalizer once nothing referenced it) before this backward ran; its offloaded "
                "activations were released. Run backward before closing the manager (and keep "
                "a reference to it while its graphs live), or run forward again.",
            )
            self._drain_releases()
            for fam in self._pending_free:
                self._wait_transfers(fam)  # rule 4: an NVMe read may still fill its staging
                self._drop(fam)
            for region, _ in self._pending_regions:
                region.release()
            for fam, handle in self._writing:
                with contextlib.suppress(storage.StorageError):
                    handle.wait()  # rule 4: the I/O threads read the spill until then
                # Freed above (or before): a write that failed stored nothing, though counted.
                self._forget_failed_write(fam, handle.written, "nvme")
                if fam.spill is not None:
                    fam.spill.release()
                    fam.spill = None
            self._writing.clear()
            self._writing_bytes = 0
            self._reading.clear()  # their families were released above
            # Copies out still in flight belong to families released above.
            self._inflight.clear()
            self._inflight_bytes = 0
            # Writes whose family went first: one that fails stored nothing, though counted
            # (cleared unread, they stayed counted in the totals).
            for written, fam, tier in self._orphans:
                with contextlib.suppress(storage.StorageError):
                    written.wait()
                self._forget_failed_write(fam, written, tier)
            self._orphans.clear()
            self._orphan_bytes = 0
            self._pending_free, self._pending_regions = [], []
            self._stall_marks = []
            self._live.clear()
            self.step = None
