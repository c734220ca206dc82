"""Tensor parallel: DTensor saved tensors offload their local shard and come back with
their global shape, bitwise."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from offload_util import ENGINES, Saver, assert_bitwise, assert_nothing_live, local_grads, manager
from torch import nn


@pytest.fixture
def cpu_mesh(tmp_path) -> Iterator[Any]:
    """A one-rank gloo group and its CPU mesh (DTensors without a second process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.barrier()
        dist.destroy_process_group()


class TPBlock(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, hidden)
        # A ReLU, whose output is stored (a GELU's sharded output is rebuilt, and the LayerNorm
        # output that w1 saves too: tests/test_parallel_tp_fsdp.py), so DTensors reach the
        # executor.
        self.act = nn.ReLU()
        self.w2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(self.act(self.w1(self.ln(x))))


def tp_model(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(TPBlock(), TPBlock())
    for block in model:
        parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_parallel_dtensors_bitwise(cpu_mesh, engine: str) -> None:
    from torch.distributed.tensor import DTensor

    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    ref = tp_model(cpu_mesh)
    ref(x).pow(2).sum().backward()
    want = local_grads(ref)
    assert any(isinstance(p.grad, DTensor) for p in ref.parameters())

    model = tp_model(cpu_mesh)
    with manager(model, engine) as mgr:
        wrapped = []
        with mgr:
            ex = mgr._executor
            original = ex.offload

            def spy(t: torch.Tensor, module: str, dtensor: Any, *args: Any) -> Any:
                wrapped.append(dtensor is not None)
                return original(t, module, dtensor, *args)

            ex.offload = spy
            loss = model(x).pow(2).sum()
        loss.backward()
        del ex.offload
        assert any(wrapped), "no DTensor reached the executor"
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(local_grads(model), want)
        del loss
        gc.collect()
        assert_nothing_live(mgr)


def test_uneven_dtensor_shard_comes_back_with_its_global_shape(cpu_mesh) -> None:
    """One rank cannot shard unevenly, so the DTensor states a global shape its local tensor does
    not have (what rank 1 of 5 rows over 2 ranks sees); unpack must rebuild that shape, which
    ``from_local`` without ``shape=``/``stride=`` would not."""
    from torch.distributed.tensor import DTensor, Shard

    local = torch.randn(4, 3, requires_grad=True)
    seen: list = []
    model = nn.Identity()
    with manager(model) as mgr:
        with mgr:
            dt = DTensor.from_local(
                local * 2, cpu_mesh, [Shard(0)], run_check=False, shape=(5, 3), stride=(3, 1)
            )
            assert dt.shape == (5, 3)
            out = Saver.apply(seen, dt.to_local(), dt)
        assert mgr.stats.last.records_offloaded_cpu == 1  # the local bytes, stored once
        out.backward()
        ((_, plain), (_, rebuilt)) = seen[0]
        assert isinstance(rebuilt, DTensor)
        assert rebuilt.shape == (5, 3) and rebuilt.stride() == (3, 1)
        assert torch.equal(rebuilt.to_local(), local.detach() * 2)
        assert torch.equal(plain, local.detach() * 2)
