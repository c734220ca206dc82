"""The exceptions ``storage`` raises on purpose.

They derive from :class:`OSError` because every one of them is about bytes that could not be kept
or brought back; code that already handles I/O errors handles these too. ``offload`` re-exports
them, so users catch ``offload.StorageError``.
"""

from __future__ import annotations

from typing import Any


class StorageError(OSError):
    """Bytes could not be stored or brought back (an I/O error, a closed store, a freed handle).

    Args:
        message: what failed and what the user can do about it.
        errno: the operating system's error number when an ``OSError`` caused it.

    Example:
        >>> import errno
        >>> e = StorageError("reading record 3 failed", errno=errno.EIO)
        >>> e.errno == errno.EIO, isinstance(e, OSError)
        (True, True)
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        if errno is None:
            super().__init__(message)
        else:
            super().__init__(errno, message)
        self.message = message

    def _state(self) -> dict[str, Any]:
        return {"errno": self.errno}

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments do not survive the default exception pickling (multiprocessing).
        return (_rebuild, (type(self), self.message, self._state()))


class ChecksumError(StorageError):
    """Bytes read back do not match the checksum taken when they were written.

    The bytes are never handed back as if they were good; the record stays unreadable.

    Args:
        message: which record and file range failed.
        path: the file (or its description) the bytes came from.
        file_offset: where in the file the bad chunk starts.
        nbytes: the length of the bad chunk.

    Example:
        >>> e = ChecksumError("chunk 0 differs", path="/nvme/x", file_offset=4096, nbytes=4096)
        >>> e.file_offset
        4096
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        file_offset: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.file_offset = file_offset
        self.nbytes = nbytes

    def _state(self) -> dict[str, Any]:
        return {"path": self.path, "file_offset": self.file_offset, "nbytes": self.nbytes}


class StorageFullError(StorageError):
    """A tier has no room for a record: its byte cap is reached or the disk is full.

    Callers fall back to the next tier; with none left the error reaches the user.

    Args:
        message: what did not fit and how to make room.
        directory: the directory that is full (``None`` for host memory).
        bytes_needed: the size of the record that did not fit.
        errno: ``ENOSPC``/``EDQUOT``/``EFBIG`` when the operating system said so.

    Example:
        >>> e = StorageFullError("no room", directory="/nvme", bytes_needed=1 << 20)
        >>> (e.directory, e.bytes_needed)
        ('/nvme', 1048576)
    """

    def __init__(
        self,
        message: str,
        *,
        directory: str | None = None,
        bytes_needed: int | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, errno=errno)
        self.directory = directory
        self.bytes_needed = bytes_needed

    def _state(self) -> dict[str, Any]:
        return {"errno": self.errno, "directory": self.directory, "bytes_needed": self.bytes_needed}


def _rebuild(cls: type[StorageError], message: str, state: dict[str, Any]) -> StorageError:
    return cls(message, **state)
