"""Shared test setup: GPU tests skip cleanly without CUDA; tests run with one intra-op thread."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Callable, Iterator

import pytest
import torch
from simulate_util import traces  # noqa: F401  (fixtures)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # 2-core CI: intra-op threads fighting the test process's own threads only add noise.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_hardware_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hardware probes of the suite (one thread, small buffers) go to a cache of its own, never
    the user's ``~/.cache/offload`` (subprocesses inherit it), unless one is named already."""
    if os.environ.get("OFFLOAD_CACHE_DIR"):
        yield
        return
    os.environ["OFFLOAD_CACHE_DIR"] = str(tmp_path_factory.mktemp("offload-cache"))
    try:
        yield
    finally:
        del os.environ["OFFLOAD_CACHE_DIR"]


@pytest.fixture
def fused_rms_norm() -> Iterator[None]:
    """``nn.RMSNorm`` on CPU as on CUDA: one ``_fused_rms_norm`` call whose autograd node
    (``FusedRmsNormBackward0``) saves the input. ATen has that op's kernels for CUDA only, and
    on CPU the op decomposes into elementwise nodes; this registers torch's own decompositions as
    its CPU kernels for the test, so the real autograd node runs, and removes them after."""
    from torch._decomp import decompositions

    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU"):
        yield  # a torch with a CPU kernel of its own
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_fused_rms_norm", decompositions._fused_rms_norm, "CPU")
        lib.impl("_fused_rms_norm_backward", decompositions._fused_rms_norm_backward, "CPU")
        probe = torch.nn.RMSNorm(4)(torch.ones(2, 4, requires_grad=True))
        assert type(probe.grad_fn).__name__ == "FusedRmsNormBackward0", probe.grad_fn
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def limit_file_size(nbytes: int) -> None:
    """For ``subprocess.run(preexec_fn=...)``: a write past ``nbytes`` in any file fails."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an ignored signal stays ignored across exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))


@pytest.fixture
def file_size_limit() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """``with file_size_limit(n):`` a write that would make a file of this process longer than
    ``n`` bytes fails with ``OSError(EFBIG)`` from the kernel: an honest failed write (as on a
    full disk), for tests of what a failure leaves behind. (Tests run as root: a directory
    without write permission fails nothing.)"""
    return _file_size_limit
