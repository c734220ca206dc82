"""Live bytes of the tensors ops allocate: a CPU run's stand-in for the CUDA allocator's peak.

Used by the tests and benchmarks to check memory claims on CPU, where no allocator reports a
peak. Nothing imports it at ``import offload``.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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
