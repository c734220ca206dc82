"""One private, unlinked, preallocated spill file, and the mapping of OS errors to ours."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import tempfile
import threading
import weakref

import numpy as np

from offload.storage._errors import StorageError, StorageFullError
from offload.storage._transfer import abandoned_at_exit
from offload.storage._units import ALIGNMENT_BYTES, format_bytes

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NO_FALLOCATE_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def private_prefix() -> str:
    """``offload-rank{RANK}-local{LOCAL_RANK}-pid{pid}-``, with the rank parts only when set."""
    parts = ["offload"]
    for env, tag in (("RANK", "rank"), ("LOCAL_RANK", "local")):
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            parts.append(f"{tag}{value}")
    parts.append(f"pid{os.getpid()}")
    return "-".join(parts) + "-"


# NOTE [ Directories left by a killed process ]
# A process killed before its tier closed (SIGKILL, OOM killer) leaves its private directory
# behind (the spill file inside was unlinked at once, so no bytes). The next tier made in that
# nvme_dir removes such directories: only real directories (lstat; a symlink is never followed)
# owned by this user, whose name is exactly one private_prefix() makes plus mkdtemp's suffix,
# and whose pid is not a live process here (a live one, or one this process cannot signal, is
# kept). Inside, only a regular file named spill.bin is removed (a process killed between
# creating and unlinking it); anything else leaves the directory in place (rmdir fails).
_PRIVATE_NAME = re.compile(r"offload-(?:rank\d+-)?(?:local\d+-)?pid(\d+)-[A-Za-z0-9_]+")


def remove_stale_private_dirs(parent: str) -> list[str]:
    """Remove private directories in ``parent`` left by processes that no longer run (see NOTE
    [ Directories left by a killed process ]); returns the paths removed. Best effort: errors
    leave a directory where it is."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _PRIVATE_NAME.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            spill = os.path.join(path, "spill.bin")
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(spill).st_mode):
                    os.unlink(spill)
            os.rmdir(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def buffer_of(array: np.ndarray) -> memoryview:
    """A memoryview of a contiguous numpy array (no copy), for ``os.pwrite``/``preadv``/``crc32``."""
    # numpy's stubs declare the buffer protocol only for Python >= 3.12; it exists at runtime.
    return memoryview(array)  # type: ignore[arg-type]


def storage_error(
    error: OSError, *, action: str, directory: str, bytes_needed: int | None
) -> StorageError:
    """The :class:`StorageError` for an ``OSError`` raised while ``action``: ENOSPC, EDQUOT and EFBIG
    become :class:`StorageFullError` naming the directory and the bytes needed; anything else (EIO,
    ...) a plain :class:`StorageError`. The caller raises it ``from error``."""
    if isinstance(error, StorageError):
        return error
    reason = os.strerror(error.errno) if error.errno else str(error)
    if error.errno in _FULL_ERRNOS:
        need = f" {format_bytes(bytes_needed)}" if bytes_needed is not None else ""
        return StorageFullError(
            f"{directory} is full: {action} needed{need} more ({reason}). Free space there, "
            "point nvme_dir at a larger disk, or lower the NVMe share of the plan.",
            directory=directory,
            bytes_needed=bytes_needed,
            errno=error.errno,
        )
    return StorageError(
        f"{action} in {directory} failed: {reason}. The record was released; check the disk "
        "(dmesg) or use another nvme_dir.",
        errno=error.errno,
    )


class SpillFile:
    """A file only this process can reach: in a fresh 0700 subdirectory of ``directory``, created
    0600 and unlinked at once (its fds are the only way in), grown in preallocated chunks.

    Reads and writes whose buffer address, length and offset are 4 KiB multiples go through an
    ``O_DIRECT`` descriptor when the file system supports it (tested with one real write at
    creation); everything else, and every file system without it, uses buffered I/O.

    Args:
        directory: an existing directory (the user's ``nvme_dir``).
        direct_io: try ``O_DIRECT``.
        preallocate: reserve growth with ``posix_fallocate`` (else ``ftruncate``, sparse).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, direct_io: bool = True, preallocate: bool = True
    ) -> None:
        parent = os.fspath(directory)
        if not os.path.isdir(parent):
            raise ValueError(f"nvme directory {parent!r} does not exist or is not a directory")
        self.directory = tempfile.mkdtemp(prefix=private_prefix(), dir=parent)
        os.chmod(self.directory, 0o700)
        path = os.path.join(self.directory, "spill.bin")
        fds: list[int] = []
        self._fds = fds
        self._finalizer = weakref.finalize(self, _cleanup, fds, self.directory, path)
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            self.fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)
            fds.append(self.fd)
            os.fchmod(self.fd, 0o600)  # the umask may only narrow it; make it exact
            self.direct_fd = self._open_direct(path) if direct_io else None
            if self.direct_fd is not None:
                fds.append(self.direct_fd)
            os.unlink(path)
        except BaseException:
            self._finalizer()
            raise
        self.size = 0
        self._preallocate = preallocate
        self._grow_lock = threading.Lock()

    @property
    def direct_io(self) -> bool:
        """Whether aligned I/O bypasses the page cache (O_DIRECT works here)."""
        return self.direct_fd is not None

    def grow(self, new_size: int) -> None:
        """Extend the file to ``new_size`` bytes, reserving the blocks now when possible.

        Raises:
            OSError: ENOSPC and the like, unmapped (the caller knows the record it was for).
        """
        with self._grow_lock:
            if new_size <= self.size:
                return
            if self._preallocate and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(self.fd, self.size, new_size - self.size)
                except OSError as e:
                    if e.errno not in _NO_FALLOCATE_ERRNOS:
                        raise
                    self._preallocate = False  # this file system cannot; go sparse from now on
                    os.ftruncate(self.fd, new_size)
            else:
                os.ftruncate(self.fd, new_size)
            self.size = new_size

    def write(self, buffer: np.ndarray, offset: int) -> None:
        """Write all of ``buffer`` (1-D uint8) at ``offset``, resuming after short writes."""
        view = buffer.reshape(-1)
        done = 0
        while done < view.size:
            part = view[done:]
            n = os.pwrite(self._fd_for(part, offset + done), buffer_of(part), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "pwrite wrote nothing")
            done += n

    def read_into(self, buffer: np.ndarray, offset: int) -> None:
        """Fill all of ``buffer`` (1-D uint8) from ``offset``; reading past the end is an EIO."""
        view = buffer.reshape(-1)
        done = 0
        while done < view.size:
            part = view[done:]
            n = os.preadv(self._fd_for(part, offset + done), [buffer_of(part)], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"the file ended at {offset + done} (short read)")
            done += n

    def close(self) -> None:
        """Close the descriptors and remove the private directory. Idempotent."""
        self._finalizer()

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors (the parent's stay open) and leave
        the directory, which is the parent's. See NOTE [ Forked children ]."""
        if self._finalizer.detach() is not None:
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()

    def _fd_for(self, part: np.ndarray, offset: int) -> int:
        if (
            self.direct_fd is not None
            and offset % ALIGNMENT_BYTES == 0
            and part.size % ALIGNMENT_BYTES == 0
            and part.ctypes.data % ALIGNMENT_BYTES == 0
        ):
            return self.direct_fd
        return self.fd

    def _open_direct(self, path: str) -> int | None:
        if not _O_DIRECT:
            return None
        try:
            fd = os.open(path, os.O_RDWR | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # EINVAL: this file system has no O_DIRECT
        # Some file systems accept the flag at open and fail the I/O; find out with one page.
        probe = mmap.mmap(-1, ALIGNMENT_BYTES)
        try:
            os.pwrite(fd, probe, 0)
            os.preadv(fd, [probe], 0)
        except OSError:
            os.close(fd)
            return None
        finally:
            probe.close()
            os.ftruncate(self.fd, 0)
        return fd


def _cleanup(fds: list[int], directory: str, path: str) -> None:
    # A thread abandoned at exit may still write through them; see NOTE [ Exiting with I/O in
    # flight ]. The process's end closes them.
    if not abandoned_at_exit():
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    fds.clear()
    # Best effort (this also runs at exit): the file was unlinked at creation, so no bytes leak.
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(directory)
