"""The exceptions users can catch.

``storage`` cannot import ``offload`` (the import direction), so its errors derive from
``OSError`` only. The classes here derive from both :class:`OffloadError` and the matching
``storage`` class, and the executor re-raises storage errors as these (``raise ... from e``):
``except offload.OffloadError`` catches every one, and ``except storage.StorageError`` still works.
"""

from __future__ import annotations

import torch

from offload import lifecycle, storage


class OffloadError(Exception):
    """Base class of every error offload raises on purpose.

    Example:
        >>> issubclass(StorageFullError, OffloadError), issubclass(StorageFullError, OSError)
        (True, True)
    """


class StorageError(OffloadError, storage.StorageError):
    """Bytes could not be stored or brought back (I/O error, closed store)."""


class ChecksumError(StorageError, storage.ChecksumError):
    """Bytes read back from NVMe differ from those written; they are never returned."""


class StorageFullError(StorageError, storage.StorageFullError):
    """No allowed tier has room: ``.directory`` (for NVMe) and ``.bytes_needed`` say what failed."""


def from_storage(e: BaseException, context: str) -> BaseException:
    """The offload-level error for a storage error ``e`` (others are returned unchanged)."""
    if isinstance(e, OffloadError) or not isinstance(e, storage.StorageError):
        return e
    msg = f"{context}: {e.message}" if context else e.message
    if isinstance(e, storage.StorageFullError):
        return StorageFullError(
            msg, directory=e.directory, bytes_needed=e.bytes_needed, errno=e.errno
        )
    if isinstance(e, storage.ChecksumError):
        return ChecksumError(msg, path=e.path, file_offset=e.file_offset, nbytes=e.nbytes)
    return StorageError(msg, errno=e.errno)


def modified_after_save(what: str, t: torch.Tensor, expected_version: int) -> RuntimeError:
    """Autograd's error for ``t``, a saved tensor changed in place after it was saved, which
    ``what`` names: saved-tensor hooks switch autograd's own check off, and offload keeps it."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} ({list(t.shape)}, {t.dtype}) is at version {t._version}; expected "
        f"version {expected_version} instead (offload keeps autograd's check: the in-place "
        "change came after the tensor was saved, e.g. an optimizer step before backward)"
    )


class BudgetInfeasibleError(OffloadError, lifecycle.BudgetInfeasibleError):
    """No plan fits the step under ``gpu_budget``: ``.min_feasible_bytes`` says what would,
    ``.budget_bytes`` what was asked.

    Example:
        >>> issubclass(BudgetInfeasibleError, ValueError), issubclass(BudgetInfeasibleError, OffloadError)
        (True, True)
    """


def from_infeasible(e: lifecycle.BudgetInfeasibleError) -> BudgetInfeasibleError:
    """The offload-level error for the planner's ``e``."""
    if isinstance(e, BudgetInfeasibleError):
        return e
    return BudgetInfeasibleError(
        str(e), budget_bytes=e.budget_bytes, min_feasible_bytes=e.min_feasible_bytes
    )
