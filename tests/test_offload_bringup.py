"""GPU bring-up fixes whose logic runs on CPU: when the hardware is probed, the device set on
storage's I/O threads, and the warning about a compiled leaf that holds most of a step."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
from models import ALL_MODELS
from torch import nn

import offload
from offload import storage
from offload.storage._transfer import IoThreads


def _probe_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "offload::probe_hardware" in r.getMessage()]


def test_a_budgeted_manager_probes_the_hardware_when_made_not_mid_training(
    tmp_path, monkeypatch, caplog
) -> None:
    """With a budget and no hardware=, the link is measured when the manager is made (on CUDA
    the probe allocates and empties the allocators' caches), never at a later step. Before, it
    ran at the second step's entry, when the first plan was made: no probe at construction,
    one at step 2."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    case = ALL_MODELS["mlp"](seed=0)
    with caplog.at_level(logging.INFO, logger="offload"):
        mgr = offload.ActivationOffloader(case.model, gpu_budget=1 << 30, min_offload_bytes=0)
        try:
            assert len(_probe_lines(caplog)) == 1
            assert list(tmp_path.glob("hardware-*.json"))
            caplog.clear()
            for s in range(3):
                case.model.zero_grad(set_to_none=True)
                with mgr:
                    loss = case.loss(case.batch(s))
                loss.backward()
            assert mgr.plan is not None
            assert mgr.plan.hardware.source.startswith("measured")
            assert _probe_lines(caplog) == []
        finally:
            mgr.close()


def test_a_manager_without_a_budget_does_not_probe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model)
    mgr.close()
    assert not list(tmp_path.glob("hardware-*.json"))


def test_io_threads_run_their_initializer_on_each_thread_before_its_tasks() -> None:
    """The hook NvmeTier sets each I/O thread's CUDA device with runs first on every thread."""
    started: set[int] = set()
    lock = threading.Lock()

    def initializer() -> None:
        with lock:
            started.add(threading.get_ident())

    io = IoThreads(3, "storage-test", "a test", initializer=initializer)
    try:
        barrier = threading.Barrier(3)

        def task() -> bool:
            barrier.wait(timeout=30)  # one task on each of the three threads
            return threading.get_ident() in started

        assert all(f.result(timeout=30) for f in [io.submit(task) for _ in range(3)])
        assert len(started) == 3
    finally:
        io.shutdown()


def test_nvme_tier_sets_its_io_threads_cuda_device(tmp_path, caplog) -> None:
    """``cuda_device=N``: each I/O thread makes cuda:N current before its first task, so waiting
    on the manager's events creates no context on device 0. Without CUDA the attempt fails (it is
    logged) and the tier works as before."""
    for bad in (-1, True, "0"):
        with pytest.raises(ValueError, match="cuda_device"):
            storage.NvmeTier(tmp_path, capacity_bytes=1 << 20, cuda_device=bad)  # type: ignore[arg-type]
    pool = storage.HostPool(1 << 20, slab_bytes=1 << 20)
    tier = storage.NvmeTier(
        tmp_path, capacity_bytes=1 << 20, pool=pool, cuda_device=0, io_threads=1
    )
    try:
        with caplog.at_level(logging.ERROR, logger="offload.storage"):
            x = torch.arange(1024, dtype=torch.float32)
            h = tier.write(x)
            y = torch.empty_like(x)
            tier.read(h, y).wait()
            assert torch.equal(x, y)
            tier.free(h)
        if not torch.cuda.is_available():
            assert any("initializer of an I/O thread" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()
        pool.close()


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Blocks(nn.Module):
    def __init__(self, n: int = 3, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _compiled_share_warnings(where: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(16, 32)
    torch._dynamo.reset()
    if where == "model":
        model.compile(backend="aot_eager")
    else:
        for b in model.blocks:
            b.compile(backend="aot_eager")
    model(x).pow(2).sum().backward()  # the compiled model without offload: the reference
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                with mgr:
                    loss = model(x).pow(2).sum()
                loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
    finally:
        mgr.close()
        torch._dynamo.reset()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    return [str(w.message) for w in caught if "compiled" in str(w.message)], got


def test_a_whole_compiled_model_holding_the_step_warns_once_naming_it() -> None:
    """NOTE [ One compiled leaf holding the step ]: with the whole model compiled (AOTAutograd,
    as inductor uses), every saved tensor is packed at the model's end and reloaded together at
    its backward's start; the manager says so once and points at per-block compilation. Before,
    nothing was said."""
    said, _ = _compiled_share_warnings("model")
    assert len(said) == 1, said
    assert "the whole model" in said[0] and "b.compile()" in said[0]


def test_per_block_compilation_does_not_warn() -> None:
    said, _ = _compiled_share_warnings("blocks")
    assert said == []
