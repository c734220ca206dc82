"""Storage tiers that fail on chosen calls: fault injection through the ``Tier`` contract.

:class:`FailingHostTier` and :class:`FailingNvmeTier` are the real tiers (every byte still moves
through :class:`~offload.storage.HostTier` / :class:`~offload.storage.NvmeTier`) whose ``write``
and ``read`` fail on the calls a test arms, with the errors the contract in ``storage/_tier.py``
names, where it says they arrive:

* ``at="submit"``: the call itself raises (a ``write`` raises :class:`StorageFullError` when the
  record does not fit; a read that fails to start raises :class:`StorageError`);
* ``at="completion"``: the call returns, and the returned transfer's ``.wait()`` raises (an I/O
  error or :class:`ChecksumError`), after ``gate`` opens when one is given: a failure that
  arrives late, on a thread of its own. A failed write releases the record's space and every
  later read of it re-raises, as the contract says; a region source stays the caller's.

An ``OSError`` (``OSError(errno.EIO, ...)``) becomes what the tier makes of a real one: on the
NVMe tier the :class:`StorageError` (or, for ENOSPC, :class:`StorageFullError`) that names the
directory and the reason, as a failing disk would give.

:func:`install` makes every tier a manager builds (at its first step) a failing one, for the rest
of the test: the manager takes tiers by name only (``tiers=("cpu", "nvme")``), so the classes it
builds them from are the one place to hand it others.

Example:
    >>> import errno, torch
    >>> from offload import storage
    >>> tier = FailingHostTier(storage.HostPool(1 << 20, slab_bytes=1 << 20))
    >>> tier.faults.fail("read", OSError(errno.EIO, "injected"), calls={0})
    >>> h = tier.write(torch.arange(4.0))
    >>> tier.read(h, torch.empty(4)).exception().errno, tier.faults.injected
    (5, 1)
    >>> tier.free(h); tier.close()
"""

from __future__ import annotations

import copy
import sys
import threading
from collections import Counter
from collections.abc import Callable, Container
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch

from offload import storage

Method = Literal["write", "read"]
When = Literal["submit", "completion"]


@dataclass(frozen=True)
class Fault:
    """How the armed calls of one method fail.

    Args:
        error: the exception (copied for each failure) or a function making one.
        at: ``"submit"`` (the call raises) or ``"completion"`` (its transfer's ``.wait()`` does).
        calls: which calls fail, counted from 0 since the fault was armed; ``None``: every one.
        gate: completion only: the failure arrives once this event is set (at most 30 s later).
    """

    error: BaseException | Callable[[], BaseException]
    at: When = "completion"
    calls: Container[int] | None = None
    gate: threading.Event | None = None

    def make(self) -> BaseException:
        return self.error() if callable(self.error) else copy.copy(self.error)


class Faults:
    """The faults armed on a tier (or, under :func:`install`, on every tier of one kind), and
    what they did: ``calls`` per method since it was armed, ``injected`` failures in all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, Fault] = {}
        self.calls: Counter[str] = Counter()
        self.injected = 0

    def fail(
        self,
        method: Method,
        error: BaseException | Callable[[], BaseException],
        *,
        at: When = "completion",
        calls: Container[int] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        """Arm ``method``: its ``calls`` (all by default) fail with ``error`` ``at`` submit or
        completion. Arming again replaces the fault and restarts the count."""
        if method not in ("write", "read"):
            raise ValueError(f"method must be 'write' or 'read'; got {method!r}")
        if at not in ("submit", "completion"):
            raise ValueError(f"at must be 'submit' or 'completion'; got {at!r}")
        if gate is not None and at != "completion":
            raise ValueError("a gate delays a failure at completion only")
        with self._lock:
            self._armed[method] = Fault(error, at, calls, gate)
            self.calls[method] = 0

    def heal(self, method: Method | None = None) -> None:
        """Disarm ``method`` (every method by default)."""
        with self._lock:
            if method is None:
                self._armed.clear()
            else:
                self._armed.pop(method, None)

    def take(self, method: Method) -> Fault | None:
        """The fault this call of ``method`` fails with, if any (counts the call)."""
        with self._lock:
            fault = self._armed.get(method)
            if fault is None:
                return None
            n = self.calls[method]
            self.calls[method] += 1
            if fault.calls is not None and n not in fault.calls:
                return None
            self.injected += 1
            return fault


class FailingTier(storage.Tier):
    """A real tier's ``write`` and ``read``, failing where :attr:`faults` says (a mixin: the
    concrete classes are :class:`FailingHostTier` and :class:`FailingNvmeTier`)."""

    faults: Faults

    def _init_faults(self, faults: Faults | None) -> None:
        self.faults = faults if faults is not None else Faults()

    def write(
        self, source: storage.HostRegion | torch.Tensor, nbytes: int | None = None, *, after=None
    ) -> storage.StoredHandle:
        fault = self.faults.take("write")
        if fault is not None and fault.at == "submit":
            raise self._injected(fault.make(), "writing a record", nbytes)
        handle = super().write(source, nbytes, after=after)  # type: ignore[safe-super]
        if fault is not None:
            # The bytes are stored, then the write fails: the record's space goes back (as
            # NvmeTier's failed writes do) and every read of it re-raises.
            handle._write = self._fail_after(
                handle, "write", handle.written, fault, "writing a record", failure_frees=True
            )
        return handle

    def read(
        self, handle: storage.StoredHandle, into: storage.HostRegion | torch.Tensor
    ) -> storage.Transfer:
        fault = self.faults.take("read")
        if fault is not None and fault.at == "submit":
            self._check_own(handle)
            raise self._injected(fault.make(), "reading a record", None)
        transfer = super().read(handle, into)  # type: ignore[safe-super]
        if fault is None:
            return transfer
        return self._fail_after(handle, "read", transfer, fault, "reading a record")

    def _fail_after(
        self,
        handle: storage.StoredHandle,
        label: str,
        transfer: storage.Transfer,
        fault: Fault,
        action: str,
        *,
        failure_frees: bool = False,
    ) -> storage.Transfer:
        """A transfer that fails once ``transfer`` ended (and ``fault.gate`` opened), through the
        tier's own bookkeeping: close() waits for it, the record is released after it."""

        def start() -> Future[Any]:
            future: Future[Any] = Future()

            def fail() -> None:
                if fault.gate is not None:
                    fault.gate.wait(timeout=30)
                future.set_exception(fault.make())

            if fault.gate is None:
                fail()
            else:
                threading.Thread(target=fail, name="failing-tier", daemon=True).start()
            return future

        return self._run(
            handle,
            f"{self.name} {label}",
            transfer._future,
            start,
            on_error=lambda e: self._injected(e, action, handle.nbytes),
            failure_frees=failure_frees,
        )

    def _injected(self, error: BaseException, action: str, nbytes: int | None) -> BaseException:
        """What the tier makes of ``error``: a StorageError stays; an OSError becomes one."""
        if isinstance(error, OSError) and not isinstance(error, storage.StorageError):
            mapped = storage.StorageError(f"{action} failed: {error.strerror}", errno=error.errno)
            mapped.__cause__ = error
            return mapped
        return error


class FailingHostTier(FailingTier, storage.HostTier):
    """:class:`~offload.storage.HostTier` failing where ``faults`` says."""

    def __init__(self, *args: Any, faults: Faults | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_faults(faults)


class FailingNvmeTier(FailingTier, storage.NvmeTier):
    """:class:`~offload.storage.NvmeTier` failing where ``faults`` says; an ``OSError`` becomes
    the error a failing disk gives (naming the directory, the reason, the bytes needed)."""

    def __init__(self, *args: Any, faults: Faults | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_faults(faults)

    def _injected(self, error: BaseException, action: str, nbytes: int | None) -> BaseException:
        return self._map_error(error, action, nbytes)


_FAILING = {"cpu": (storage.HostTier, FailingHostTier), "nvme": (storage.NvmeTier, FailingNvmeTier)}


def install(monkeypatch: pytest.MonkeyPatch, *kinds: str) -> dict[str, Faults]:
    """From now on to the end of the test, every ``"cpu"`` / ``"nvme"`` tier (``kinds``; both by
    default) made through the ``offload`` modules' names for them (the manager makes its tiers
    at its first step) is a failing one sharing one :class:`Faults` per kind, returned by kind.
    The classes stay classes (subclasses of the real ones): type checks still hold."""
    out: dict[str, Faults] = {}
    for kind in kinds or tuple(_FAILING):
        real, failing = _FAILING[kind]
        faults = out[kind] = Faults()

        def __init__(self: Any, *args: Any, _faults: Faults = faults, **kwargs: Any) -> None:
            super(type(self), self).__init__(*args, faults=_faults, **kwargs)

        made = type(failing.__name__, (failing,), {"__init__": __init__})
        for name, module in list(sys.modules.items()):
            if (
                name.startswith("offload")
                and name != real.__module__
                and getattr(module, real.__name__, None) is real
            ):
                monkeypatch.setattr(module, real.__name__, made)
    return out
