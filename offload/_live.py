"""Live bytes of the tensors ops allocate: a CPU run's stand-in for the CUDA allocator's peak.

Used by the tests and benchmarks to check memory claims on CPU, where no allocator reports a
peak. Nothing imports it at ``import offload``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SavedBytes:
    """Peak bytes of the saved tensors a manager holds on its device: what a plan's predicted
    peak counts on CPU (no allocator there), measured instead of estimated.

    Counted: each storage a pack leaves in place that is not a parameter's (or a pipeline
    stage's held input), from that pack until the storage is freed, each reload buffer, from
    its allocation until freed, and each activation output rebuilt at unpack, from its rebuild
    until freed; a storage once however many records share it. ``peak``
    counts whole storages; ``peak_planned`` counts a reload buffer as its family's bytes, as a
    plan does (the buffer is up to ``ALIGN_BYTES`` longer, to give the bytes their original
    address alignment). Not counted: what offload never sees (transients, gradients), and
    copies-out in flight (on CPU a copy completes inside its pack). Install with :meth:`on`;
    nothing is counted otherwise.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> mgr = offload.ActivationOffloader(model, min_offload_bytes=1 << 20)  # keeps all
        >>> with SavedBytes.on(mgr) as meter:
        ...     with mgr:
        ...         loss = model(torch.randn(4, 8)).sum()
        ...     loss.backward()
        >>> meter.peak == 2 * 4 * 8 * 4  # the Linear's input and the Tanh output
        True
        >>> mgr.close()
    """

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.live_planned = self.peak_planned = 0
        self._tracked: dict[int, weakref.finalize] = {}
        self._lock = threading.Lock()  # finalizers run on the thread that drops a storage

    @classmethod
    @contextlib.contextmanager
    def on(cls, mgr: Any) -> Iterator[SavedBytes]:
        """Count ``mgr``'s saved bytes inside the block."""
        meter = cls()
        mgr._meter = meter
        if mgr._executor is not None:
            mgr._executor.meter = meter
        try:
            yield meter
        finally:
            mgr._meter = None
            if mgr._executor is not None:
                mgr._executor.meter = None

    def watch(self, storage: torch.UntypedStorage, planned_bytes: int | None = None) -> None:
        """Count ``storage`` until it is freed (``planned_bytes`` of it in ``live_planned``)."""
        key = storage._cdata
        with self._lock:
            if key in self._tracked:
                return
            n = storage.nbytes()
            used = n if planned_bytes is None else planned_bytes
            self._tracked[key] = weakref.finalize(storage, self._free, key, n, used)
            self.live += n
            self.live_planned += used
            self.peak = max(self.peak, self.live)
            self.peak_planned = max(self.peak_planned, self.live_planned)

    def _free(self, key: int, n: int, used: int) -> None:
        with self._lock:
            self.live -= n
            self.live_planned -= used
            self._tracked.pop(key, None)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by ops run under it and still alive (CPU peak memory).

    An op's output counts when its storage is none of the op's inputs' (views, in-place and
    ``out=`` ops allocate nothing) and is new to the counter; it stops counting when a finalizer
    on the storage object fires. Host-pool regions are views of slabs allocated before the step.
    Storages created while ``paused`` is above 0 are not counted (code whose memory the
    measurement leaves out, such as another pipeline stage's chunks on the same device).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.paused = 0
        self._tracked: dict[int, weakref.finalize] = {}
        # Finalizers run on whichever thread drops a storage: they only append to a deque
        # (thread-safe), and the dispatching thread drains it.
        self._freed: collections.deque[tuple[int, int]] = collections.deque()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        flat_in = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage()._cdata for t in flat_in if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            while self._freed:  # a freed storage's address may come back for this output
                key, n = self._freed.popleft()
                self.live -= n
                self._tracked.pop(key, None)
            st = t.untyped_storage()
            key = st._cdata
            if key in inputs or key in self._tracked:
                continue
            n = st.nbytes()
            self._tracked[key] = weakref.finalize(st, self._freed.append, (key, n))
            self.live += n
            self.peak = max(self.peak, self.live)
        return out
