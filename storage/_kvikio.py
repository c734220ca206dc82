"""GPU-direct file I/O through kvikio, where it exists (lazily imported, CUDA only).

kvikio imports without a GPU but every read and write needs the CUDA driver, even in compat mode,
so CPU machines always use the plain-file path. kvikio orders its I/O on the CUDA null stream:
callers run it on an I/O thread after the record's event was synchronized, never inside a hook.
"""

from __future__ import annotations

import torch

_EXTRA_HINT = (
    "GPU-direct NVMe I/O needs kvikio: pip install 'offload[gds-cu12]' (CUDA 12) or "
    "'offload[gds-cu13]' (CUDA 13), Python >= 3.11"
)


def kvikio_available() -> bool:
    """Whether GPU-direct I/O can run here: ``import kvikio`` works and a CUDA device is present.

    Example:
        >>> isinstance(kvikio_available(), bool)
        True
    """
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
    except Exception:  # ImportError, or a missing libcufile (DynamicLibNotFoundError)
        return False
    return True


class KvikioFile:
    """kvikio's view of an already open (and unlinked) file, reached through ``/proc/self/fd``.

    Args:
        fd: the descriptor of the spill file.

    Raises:
        ImportError: kvikio is not installed or no CUDA device is present.
    """

    def __init__(self, fd: int) -> None:
        self.check_available()
        import kvikio

        # "r+" opens for reading and writing without truncating (kvikio's "w" would truncate).
        self._file = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")

    @staticmethod
    def check_available() -> None:
        """Raise the ImportError saying what to install when :func:`kvikio_available` is False."""
        if not kvikio_available():
            raise ImportError(_EXTRA_HINT + "; and a CUDA device")

    def pwrite(self, device_bytes: torch.Tensor, file_offset: int) -> int:
        """Write a contiguous CUDA uint8 tensor at ``file_offset``; returns the bytes written."""
        return int(self._file.pwrite(device_bytes, device_bytes.numel(), file_offset).get())

    def pread(self, device_bytes: torch.Tensor, file_offset: int) -> int:
        """Fill a contiguous CUDA uint8 tensor from ``file_offset``; returns the bytes read."""
        return int(self._file.pread(device_bytes, device_bytes.numel(), file_offset).get())

    def close(self) -> None:
        self._file.close()
