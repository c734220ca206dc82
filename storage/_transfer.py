"""Transfers (a future with ``.wait()``) and the engine that runs copies between host buffers."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from offload.storage._errors import StorageError

logger = logging.getLogger("offload.storage")

# NOTE [ Transfer ordering ]
# storage knows nothing about CUDA streams. Ordering crosses its boundary in two ways only:
#   * ``after=`` on a write: any object with ``.synchronize()`` (a CUDA event recorded after the
#     D2H copy into the region) or ``.wait()`` (a Transfer). The worker that first reads the source
#     calls it, so a file write or checksum never reads a region before its D2H finished (docs/design.md,
#     NOTE [ Stream ordering ] rule 4), and no hook ever blocks on the disk. Pass a CUDA event
#     made with ``torch.cuda.Event(blocking=True)``: without it, each waiting I/O thread spins a
#     CPU core until the copy ends (``cudaEventSynchronize`` without ``cudaEventBlockingSync``).
#   * the Transfer a call returns: ``.wait()`` is the only synchronisation a caller may rely on.
#     In deferred mode (``CopyEngine(deferred=True)``) every copy and every file I/O runs on a
#     worker thread after a random delay and released regions are poisoned with 0xFF, so a caller
#     that reads a destination, or releases a source, before ``.wait()`` sees garbage in CPU tests.
# Inside a tier: a read of a record starts only after the record's write completed (chained on its
# future, never by blocking a worker), and a record's region or file range is released only after
# every transfer that touches it completed, even when ``free()`` came first. The Transfer completes
# after that cleanup, so when ``.wait()`` returns (or raises) nothing is left in flight.


class Transfer:
    """The completion of one copy or file I/O.

    ``.wait()`` returns once the bytes are where they were sent, or re-raises the error that
    stopped them (:class:`~offload.storage.StorageError` and its subclasses for I/O). It is the only
    synchronisation a caller may rely on (see NOTE [ Transfer ordering ]).

    Example:
        >>> t = Transfer.completed("copy")
        >>> t.done()
        True
        >>> t.wait()
    """

    __slots__ = ("_future", "label")

    def __init__(self, future: Future[Any], label: str = "transfer") -> None:
        self._future = future
        self.label = label

    @classmethod
    def completed(cls, label: str = "transfer") -> Transfer:
        """A transfer that has already finished successfully."""
        return cls(_SUCCEEDED, label)

    @classmethod
    def failed(cls, error: BaseException, label: str = "transfer") -> Transfer:
        """A transfer that has already failed with ``error``."""
        future: Future[Any] = Future()
        future.set_exception(error)
        return cls(future, label)

    def done(self) -> bool:
        """Whether it finished (successfully or not); never blocks."""
        future = self._future
        return future is _SUCCEEDED or future.done()  # finished(), inline: asked per record

    def wait(self, timeout: float | None = None) -> None:
        """Block until it finished; re-raise its error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the transfer keeps running).
        """
        future = self._future
        if future is _SUCCEEDED:
            return  # see finished()
        try:
            future.result(timeout)
        finally:
            # A raised error's traceback holds this frame, which holds this transfer, whose future
            # holds the error: a cycle that would keep whatever the callers' frames hold (saved
            # tensors, host regions) alive until a GC pass. (concurrent.futures does the same.)
            del self, future

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until it finished; return its error instead of raising it (``None`` on success)."""
        future = self._future
        return None if future is _SUCCEEDED else future.exception(timeout)

    def add_done_callback(self, fn: Callable[[Transfer], object]) -> None:
        """Call ``fn(self)`` when it finishes (at once if it already has), on the finishing thread."""
        self._future.add_done_callback(lambda _: fn(self))

    def synchronize(self) -> None:
        """Same as :meth:`wait`, so a Transfer can be the ``after=`` of another write."""
        self.wait()

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        else:
            state = "failed" if self._future.exception() is not None else "done"
        return f"Transfer({self.label!r}, {state})"


class CopyEngine:
    """Runs copies between tensors and host regions, and paces a tier's file I/O.

    By default a copy runs at once on the calling thread and file I/O runs as soon as a thread is
    free. With ``deferred=True`` (for tests, docs/design.md "Stream ordering" rule (a)) each copy runs on
    a worker thread and each file I/O task starts only after a random delay of up to
    ``max_delay_s``, tiers poison the regions they release with 0xFF, and :meth:`paused` holds all
    of it back, so a test can show that a caller which did not ``.wait()`` sees garbage.

    Args:
        deferred: run copies late, on a worker thread.
        max_delay_s: the longest random delay before a deferred copy or I/O task.
        seed: seed of the delays, for reproducible interleavings.

    Example:
        >>> engine = CopyEngine(deferred=True, max_delay_s=0.001, seed=0)
        >>> src, dst = torch.arange(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
        >>> t = engine.copy(dst, src)
        >>> t.wait(); dst.tolist()
        [0, 1, 2, 3]
        >>> engine.close()
    """

    def __init__(
        self, *, deferred: bool = False, max_delay_s: float = 0.002, seed: int | None = None
    ):
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0 seconds; got {max_delay_s}")
        self._deferred = bool(deferred)
        self._max_delay_s = float(max_delay_s)
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        self._gate = threading.Event()
        self._gate.set()
        self._worker: IoThreads | None = None
        self._worker_lock = threading.Lock()
        self._stopped: threading.Event | None = None  # set once the last close's worker stopped
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # See NOTE [ Forked children ]: the parent's worker thread is not here.
        self._random_lock = threading.Lock()
        self._worker_lock = threading.Lock()
        self._worker = None
        self._stopped = None

    @property
    def deferred(self) -> bool:
        return self._deferred

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: object = None) -> Transfer:
        """Copy ``src`` into ``dst`` (same number of bytes) once ``after`` completed."""

        def run() -> None:
            wait_for(after)
            dst.copy_(src)

        return Transfer(self.submit(run), "copy")

    def submit(self, fn: Callable[[], object]) -> Future[Any]:
        """Run ``fn`` at once (returning its finished future) or, when deferred, on the worker."""
        if not self._deferred:
            return run_now(fn)
        with self._worker_lock:
            if self._worker is None:
                track_gc_passes()
                self._worker = IoThreads(1, "storage-copy", "deferred copies")
            worker = self._worker

        @functools.wraps(fn)  # named as fn in the warning about tasks abandoned at exit
        def late() -> object:
            self.delay()
            return fn()

        return worker.submit(late)

    def delay(self) -> None:
        """In deferred mode: wait while paused, then sleep a random time. Otherwise nothing."""
        if not self._deferred:
            return
        self._gate.wait()
        with self._random_lock:
            seconds = self._random.uniform(0.0, self._max_delay_s)
        time.sleep(seconds)

    def poison(self, span: torch.Tensor) -> None:
        """In deferred mode, overwrite bytes that are about to be released with 0xFF."""
        if self._deferred and span.numel():
            span.fill_(0xFF)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold back every deferred copy and I/O task until the block exits.

        Raises:
            ValueError: the engine is not deferred (nothing could be held back).
        """
        if not self._deferred:
            raise ValueError("paused() needs CopyEngine(deferred=True)")
        self._gate.clear()
        try:
            yield
        finally:
            self._gate.set()

    def close(self) -> None:
        """Finish queued copies and stop the worker thread. Idempotent.

        Called on a storage thread (see :func:`on_worker_thread`), it returns at once and the
        worker is stopped from a thread of its own: waiting there would wait on itself. A close
        elsewhere meanwhile waits for that.
        """
        self._gate.set()
        with self._worker_lock:
            worker, self._worker = self._worker, None
            if worker is not None:
                self._stopped = threading.Event()
            stopped = self._stopped
        if worker is None:
            if stopped is not None and not on_worker_thread():
                stopped.wait()  # a close handed to another thread: done when it is
            return
        assert stopped is not None
        done = stopped

        def stop() -> None:
            try:
                # See NOTE [ Closing inside a GC pass ]: the queued copies still run.
                worker.shutdown(wait=not in_gc_pass())
            finally:
                done.set()

        if not finish_elsewhere(stop):
            stop()


_worker_state = threading.local()

# NOTE [ Closing inside a GC pass ]
# A tier's owner dropped without close() (a manager in a reference cycle) is closed by its
# finalizer, which a GC pass runs on whatever thread happened to allocate: also a thread that is
# just starting (``Thread._bootstrap_inner`` allocates while it holds threading's lock of thread
# states, ``_shutdown_locks_lock``, in Python <= 3.12). Joining a thread takes that lock again, so
# a close that joined its I/O threads there would wait on itself, and the thread starting the
# new one would wait on it for ever (a loop of dropped NVMe managers hangs within about 100).
# By the time threads stop, every transfer has completed and the workers are idle: inside a GC
# pass they are told to exit and left to do so on their own.
_gc_state = threading.local()
_gc_tracked = False
_gc_track_lock = threading.Lock()


def _note_gc(phase: str, info: dict[str, Any]) -> None:
    _gc_state.collecting = phase == "start"


# NOTE [ Forked children ]
# A child forked from this process (os.fork, a fork-started DataLoader or multiprocessing worker)
# has none of storage's threads, and the locks they held at the fork stay held in it for ever.
# Every object that owns threads, locks or transfers registers itself here when it is made, and
# in the child ``_after_fork_in_child()`` runs on each (in no particular order, so each touches
# only its own state): new locks; transfers and thread pools of the parent forgotten (their
# futures never complete here); an NVMe tier forgets the parent's records and spill file (its
# descriptor shares the parent's file offset-free, but the ranges are the parent's), closing the
# inherited descriptors without removing the parent's directory, and makes new threads and a
# new private directory at its next write. Host memory records stay: the child has a copy of
# the bytes (on CPU; CUDA and pinned memory do not survive a fork). The offload executor drops
# the parent's saved tensors at its next call (NOTE there). Nothing runs at the fork but these
# resets; registering installs one os.register_at_fork hook, at the first object, never at import.
_fork_resets: weakref.WeakSet[Any] = weakref.WeakSet()
_fork_lock = threading.Lock()
_fork_hooked = False


def reset_in_forked_child(owner: object) -> None:
    """Have ``owner._after_fork_in_child()`` run in each child forked from this process (see
    NOTE [ Forked children ]); ``owner`` is held weakly."""
    global _fork_hooked
    with _fork_lock:
        _fork_resets.add(owner)
        if not _fork_hooked and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_reset_forked)
            _fork_hooked = True


def _reset_forked() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()  # the parent's may have been held by another thread
    for owner in list(_fork_resets):
        owner._after_fork_in_child()


def track_gc_passes() -> None:
    """Start telling GC passes apart (see :func:`in_gc_pass`); called where storage makes its
    first thread pool, never at import."""
    global _gc_tracked
    with _gc_track_lock:
        if not _gc_tracked:
            gc.callbacks.append(_note_gc)
            _gc_tracked = True


def in_gc_pass() -> bool:
    """Whether this thread is inside a garbage collection (a finalizer runs there), once
    :func:`track_gc_passes` was called. See NOTE [ Closing inside a GC pass ]."""
    return getattr(_gc_state, "collecting", False)


def mark_worker_thread() -> None:
    """Called first on each of storage's threads (see :func:`on_worker_thread`)."""
    _worker_state.active = True


def on_worker_thread() -> bool:
    """Whether this thread is one of storage's own: a copy engine's or an NVMe tier's I/O
    thread, where done callbacks run, and where a GC pass may finalize an owner of a tier."""
    return getattr(_worker_state, "active", False)


def finish_elsewhere(finish: Callable[[], object]) -> bool:
    """On a storage thread, run ``finish`` (the waiting part of a close) on a new thread and
    return True: it waits for transfers in flight, the one running on this thread among them.
    Elsewhere return False. The thread is no daemon: the interpreter waits for it at exit.

    For owners of tiers whose close may run anywhere (a finalizer, a done callback).

    Example:
        >>> closed = []
        >>> def close() -> None:
        ...     if not finish_elsewhere(close):
        ...         closed.append(True)  # wait for transfers, release, ...
        >>> close(); closed  # not on a storage thread: it runs here
        [True]
    """
    if not on_worker_thread():
        return False
    try:
        threading.Thread(target=finish, name="storage-close").start()
    except RuntimeError as e:  # no thread to be had: at interpreter shutdown (3.12+), or none left
        logger.warning("storage: closing on one of its own threads, as no other starts (%s)", e)
        return False
    return True


# NOTE [ Closing in the background ]
# A GC pass runs finalizers on whatever thread allocated, in the middle of anything. An owner of
# tiers dropped without close() (a manager in a reference cycle) and finalized there would wait
# for its transfers in flight, on the training thread, for as long as a stalled disk takes.
# Such a close goes to one
# closer thread instead (close_later). That thread is started beforehand, at a safe point
# (start_closer, where an owner makes its tiers), never in a GC pass: a pass may run inside
# threading's own locks, where starting a thread waits on itself (NOTE [ Closing inside a GC
# pass ]); close_later only puts on a SimpleQueue, which is reentrant (made for finalizers). The
# thread is a daemon, so an idle closer never holds the interpreter up; an exit hook lets it
# finish the closes queued before exit, as a non-daemon thread would have been waited for.
_closer_lock = threading.Lock()
_closer_jobs: queue.SimpleQueue[Callable[[], object]] | None = None


def start_closer() -> None:
    """Start the background closer (NOTE [ Closing in the background ]) unless it runs. Call it
    where starting a thread is safe (never in a GC pass), before :func:`close_later` is needed."""
    global _closer_jobs
    with _closer_lock:
        if _closer_jobs is not None:
            return
        jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        track_gc_passes()  # close_later's callers tell GC passes apart
        threading.Thread(
            target=_run_closer, args=(jobs,), name="storage-closer", daemon=True
        ).start()
        atexit.register(_finish_closes, jobs)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forget_closer)
        _closer_jobs = jobs


def close_later(close: Callable[[], object]) -> bool:
    """Queue ``close`` (the waiting part of an owner's close) for the background closer and
    return True; False when no closer was started. Safe in a GC pass. See NOTE [ Closing in the
    background ]."""
    jobs = _closer_jobs
    if jobs is None:
        return False
    jobs.put(close)
    return True


def wait_for_closes(timeout: float | None = None) -> bool:
    """Wait until the closes queued so far have run (not in a GC pass); False on timeout."""
    jobs = _closer_jobs
    if jobs is None:
        return True
    done = threading.Event()
    jobs.put(done.set)
    return done.wait(timeout)


def _run_closer(jobs: queue.SimpleQueue[Callable[[], object]]) -> None:
    while True:
        job = jobs.get()
        try:
            job()
        except Exception:
            logger.exception("storage: a close handed to the background closer failed")
        del job  # the owner's resources go with the close, not with the next wait


def _finish_closes(jobs: queue.SimpleQueue[Callable[[], object]]) -> None:
    if jobs is _closer_jobs:
        wait_for_closes()


def _forget_closer() -> None:
    # A forked child has no closer thread: a queue nobody reads would swallow its closes.
    global _closer_jobs
    _closer_jobs = None


# NOTE [ Exiting with I/O in flight ]
# The interpreter's exit must not wait for ever on a write that never ends (a disk that stalls,
# an ``after=`` whose D2H never completes). The I/O threads were a ThreadPoolExecutor's, whose
# exit hook joins every worker: one stuck write held the process at exit for ever. They are
# daemon threads of storage's own (IoThreads), and one exit hook waits for their tasks for as
# long as they make progress: each task that finishes restarts a stall clock of EXIT_STALL_S,
# so a normal exit still waits for every write that completes, however many are queued. When
# none finished for that long, it logs one warning naming the tasks left and fails their
# futures with StorageError: whatever waits on them next (a close, the manager's finalizer, the
# background closer) goes on, releases what their transfers held and removes the private
# directory. The stuck threads are never joined, and the spill file's descriptors stay open to
# the end of the process: a thread that wakes late writes into the unlinked spill file, never
# into a file opened later under a reused descriptor number (the bytes its task was given, freed
# by then, nothing reads any more). The hook is threading's own exit hook (concurrent.futures
# uses it too): it runs where the executor's join ran, before the interpreter joins non-daemon
# threads (a storage-close thread may wait on the stuck write) and before atexit hooks
# (finalizers close tiers there).
EXIT_STALL_S = 5.0

_pools: weakref.WeakSet[IoThreads] = weakref.WeakSet()
_pools_lock = threading.Lock()
_exit_hooked = False
_abandoned = False  # the exit hook gave up on a task


_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]  # future, fn, args


class IoThreads:
    """A fixed set of daemon threads that run tasks in the order submitted, for a tier's file
    I/O or a copy engine's copies. See NOTE [ Exiting with I/O in flight ].

    Args:
        threads: how many threads (started at once).
        name: the threads' name prefix.
        label: what the tasks are for, named in the warning about tasks abandoned at exit.
        initializer: run on each thread before its first task (a failure is logged and the
            thread runs its tasks anyway), e.g. setting the thread's CUDA device.

    Example:
        >>> io = IoThreads(2, "storage-example", "an example")
        >>> io.submit(sum, [1, 2]).result()
        3
        >>> io.shutdown()
    """

    def __init__(
        self,
        threads: int,
        name: str,
        label: str,
        *,
        initializer: Callable[[], object] | None = None,
    ) -> None:
        self.label = label
        self._initializer = initializer
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._pending: dict[Future[Any], str] = {}  # submitted, not finished -> the task's name
        self._lock = threading.Lock()
        self._abandoned = False
        _watch_at_exit(self)
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a thread; its result or error lands in the returned future."""
        future: Future[Any] = Future()
        with self._lock:
            self._pending[future] = getattr(fn, "__name__", "task")
        self._tasks.put((future, fn, args))
        return future

    def pending(self) -> list[Future[Any]]:
        """The futures of the tasks submitted and not finished."""
        with self._lock:
            return [f for f in self._pending if not f.done()]

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads once the tasks queued ran; with ``wait``, join them, unless the exit
        hook abandoned a task on them (it may never end)."""
        for _ in self._threads:
            self._tasks.put(None)
        if wait and not self._abandoned:
            for thread in self._threads:
                thread.join()

    def _abandon(self, why: str) -> Counter[str]:
        """Fail the futures of the tasks not finished with StorageError(why); count them by
        name."""
        with self._lock:
            left = {f: name for f, name in self._pending.items() if not f.done()}
            self._abandoned = bool(left)
        for future in left:
            _settle(future, None, StorageError(why))
        return Counter(left.values())

    def _work(self) -> None:
        mark_worker_thread()
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                logger.exception(
                    "storage: the initializer of an I/O thread (%s) failed", self.label
                )
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            del task
            if future.done():  # abandoned at exit before it started
                del fn, args
            else:
                result: object = None
                error: BaseException | None = None
                try:
                    result = fn(*args)
                except BaseException as e:
                    error = e
                # The task's sources and destinations go before its future finishes, not after
                # the thread that waited on it went on: a reload buffer the task wrote outlived
                # its use in backward by however long this thread took to be scheduled again.
                del fn, args
                _settle(future, result, error)
                del result, error
            with self._lock:
                self._pending.pop(future, None)
            del future


def _settle(future: Future[Any], result: object, error: BaseException | None) -> None:
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # the exit hook failed it meanwhile


def _watch_at_exit(pool: IoThreads) -> None:
    global _exit_hooked
    with _pools_lock:
        _pools.add(pool)
        if not _exit_hooked:
            # threading's own exit hook (private; CPython 3.9 on): before non-daemon threads
            # are joined. Where it is missing, atexit's, which runs only after that join.
            register = getattr(threading, "_register_atexit", atexit.register)
            try:
                register(_finish_io_at_exit)
            except RuntimeError:  # the interpreter is exiting already: nothing waits for these
                return
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_forget_pools)
            _exit_hooked = True


def _forget_pools() -> None:
    # A forked child (a DataLoader worker) has none of the threads, and their tasks are the
    # parent's: its exit waited EXIT_STALL_S for them, and warned.
    global _pools, _pools_lock
    _pools, _pools_lock = weakref.WeakSet(), threading.Lock()


def _finish_io_at_exit() -> None:
    global _abandoned
    while True:
        with _pools_lock:
            pools = list(_pools)
        pending = [f for pool in pools for f in pool.pending()]
        if not pending:
            return
        done, _ = concurrent.futures.wait(
            pending, EXIT_STALL_S, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if not done:
            break
    _abandoned = True
    why = f"abandoned at interpreter exit: no I/O task of storage finished for {EXIT_STALL_S} s"
    count, left = 0, []
    for pool in pools:
        names = pool._abandon(why)
        if names:
            count += names.total()
            tasks = ", ".join(f"{n} x{k}" for n, k in sorted(names.items()))
            left.append(f"{tasks} ({pool.label})")
    logger.warning(
        "storage: exiting with %d I/O task(s) that made no progress for %s s; abandoned them "
        "(their transfers fail): %s",
        count,
        EXIT_STALL_S,
        "; ".join(left),
    )


def abandoned_at_exit() -> bool:
    """Whether the exit hook gave up on a task that may still run (NOTE [ Exiting with I/O in
    flight ]): its thread may yet use the files its tier holds."""
    return _abandoned


def wait_for(after: object) -> None:
    """Block until ``after`` completed: ``None``, or anything with ``.synchronize()`` (a CUDA
    event or stream, a Transfer) or ``.wait()``."""
    if after is None:
        return
    sync = getattr(after, "synchronize", None)
    if sync is None:
        sync = getattr(after, "wait", None)
    if sync is None:
        raise TypeError(
            "after= must have .synchronize() (a torch.cuda.Event) or .wait() (a Transfer); "
            f"got {type(after).__name__}"
        )
    sync()


def check_waitable(after: object) -> None:
    """Raise the TypeError of :func:`wait_for` now, at the API boundary, instead of on a worker."""
    if after is not None and not (hasattr(after, "synchronize") or hasattr(after, "wait")):
        wait_for(after)


# NOTE [ One finished future ]: a copy run at once (the default engine) or a record that needs no
# write completes before its call returns. A Future of its own each (a Condition, a lock, a
# deque and two lists that live as long as the record's handle) would cost about 20 us of a CPU
# step's pack and unpack per saved tensor, most of it cyclic-GC work on the objects kept. They
# share this one instead; a finished future is never changed again (set_result raises, cancel
# returns False, a callback added runs at once and is not kept), so sharing it is safe.
_SUCCEEDED: Future[Any] = Future()
_SUCCEEDED.set_result(None)


def finished(future: Future[Any]) -> bool:
    """``future.done()``, without taking its lock for the shared finished future."""
    return future is _SUCCEEDED or future.done()


def _error_of(future: Future[Any] | None) -> BaseException | None:
    """The error of a finished future (None: success, or no future)."""
    if future is None or future is _SUCCEEDED:
        return None
    return future.exception()


def run_now(fn: Callable[[], object]) -> Future[Any]:
    """Run ``fn`` here; its result or error lands in a finished future."""
    try:
        result = fn()
    except BaseException as e:  # the error belongs to whoever waits on the future
        return _failed(e)  # (made elsewhere: this frame, in its traceback, holds no future)
    if result is None:
        return _SUCCEEDED  # see NOTE [ One finished future ]
    future: Future[Any] = Future()
    future.set_result(result)
    return future


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def gather(futures: Sequence[Future[Any]]) -> Future[Any]:
    """A future that finishes when all of ``futures`` have (never earlier, even on an error) and
    carries the first error by position."""
    out: Future[Any] = Future()
    if not futures:
        out.set_result(None)
        return out
    pending = list(futures)  # emptied when the last one finishes (see below)
    remaining = [len(pending)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            error = next((f.exception() for f in pending if f.exception() is not None), None)
            # Each future holds this callback, which held them all: a cycle that kept a failed
            # piece's error, and the frames its traceback holds (host regions, saved tensors),
            # alive until a GC pass.
            pending.clear()
            if error is None:
                out.set_result(None)
            else:
                out.set_exception(error)

    for f in list(pending):
        f.add_done_callback(one_done)
    return out


def chain(
    prerequisite: Future[Any] | None,
    start: Callable[[], Future[Any]],
    finish: Callable[[BaseException | None], BaseException | None],
) -> Future[Any]:
    """``start()`` once ``prerequisite`` succeeded; then ``finish(error)`` (cleanup, which may
    replace the error) runs before the returned future finishes. Nothing blocks a thread."""
    if prerequisite is None or finished(prerequisite):
        # Often all of it is done here (the default engine runs copies at once): no callbacks,
        # and on success the shared finished future (NOTE [ One finished future ]), which is
        # asked nothing (a Future's done() and exception() take its lock).
        error = _error_of(prerequisite)
        inner: Future[Any] | None = None
        if error is None:
            try:
                inner = start()
            except BaseException as e:
                error = e
        if inner is None or finished(inner):
            if inner is not None:
                error = _error_of(inner)
            try:
                error = finish(error)
            except BaseException as e:
                error = e
            if error is None:
                return _SUCCEEDED
            failed = _failed(error)
            error = None  # its traceback may hold this frame: no cycle through it
            return failed
        return chain(inner, lambda: _SUCCEEDED, finish)
    out: Future[Any] = Future()

    def complete(error: BaseException | None) -> None:
        try:
            error = finish(error)
        except BaseException as e:
            error = e
        if error is None:
            out.set_result(None)
        else:
            out.set_exception(error)

    def begin(first: Future[Any] | None) -> None:
        if first is not None and first.exception() is not None:
            complete(first.exception())
            return
        try:
            inner = start()
        except BaseException as e:
            complete(e)
            return
        inner.add_done_callback(lambda f: complete(f.exception()))

    if prerequisite is None:
        begin(None)
    else:
        prerequisite.add_done_callback(begin)
    return out


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes, for any dtype (bf16, bool, fp8, ...).

    Raises:
        ValueError: the tensor is not contiguous (its bytes are not one range).

    Example:
        >>> byte_view(torch.ones(2, dtype=torch.bfloat16)).tolist()
        [128, 63, 128, 63]
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.is_contiguous():
        return tensor  # already its bytes, flat (and uint8 never requires grad)
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} and stride {tensor.stride()} is not "
            "contiguous; store the span of its storage instead"
        )
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
