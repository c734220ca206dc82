"""Several managers and the process-wide host pool: each manager's cpu_budget, the pool's
padding and slabs, a claim given back, and a full pool."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from models import gpt_block, mlp
from offload_util import (
    ENGINES,
    assert_bitwise,
    assert_nothing_live,
    local_grads,
    manager,
    offloaded_step,
    reference_grads,
)
from torch import nn

import offload
from offload import storage


@pytest.mark.parametrize("engine", ENGINES)
def test_two_managers_share_the_pool_and_stay_exact(engine: str) -> None:
    want_a = [reference_grads("gpt_block", s) for s in range(2)]
    want_b = [reference_grads("mlp", s) for s in range(2)]
    a, b = gpt_block(seed=0), mlp(seed=0)
    with manager(a.model, engine) as ma, manager(b.model, engine) as mb:
        for s in range(2):
            a.model.zero_grad(set_to_none=True)
            b.model.zero_grad(set_to_none=True)
            with ma:
                la = a.loss(a.batch(s))
            with mb:
                lb = b.loss(b.batch(s))
            lb.backward()
            la.backward()
            assert_bitwise(a.grads(), want_a[s])
            assert_bitwise(b.grads(), want_b[s])
        assert ma._executor.pool is mb._executor.pool
        assert ma.stats.total.bytes_offloaded_cpu > 0 and mb.stats.total.bytes_offloaded_cpu > 0
        del la, lb
        assert_nothing_live(ma)
        assert_nothing_live(mb)


def test_each_manager_gets_its_own_cpu_budget_from_the_shared_pool(monkeypatch) -> None:
    """Two managers on one rank (two pipeline stages, say), each with cpu_budget=4MiB, each
    holding 2.5 MiB at once: the shared pool has room for both (its cap used to be the larger
    budget, not the sum). When both have closed, its slabs are back with the host."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)) for _ in "ab"]
    x = torch.randn(512, 256)
    managers = [
        offload.ActivationOffloader(m, cpu_budget="4MiB", min_offload_bytes=0) for m in models
    ]
    losses = []
    for m, mgr in zip(models, managers, strict=True):
        with mgr:
            losses.append(m(x).sum())
    held = [mgr._executor.cpu_bytes for mgr in managers]
    assert held[0] == held[1] > 2 << 20
    pool = managers[0]._executor.pool
    assert managers[1]._executor.pool is pool and pool.capacity_bytes >= 8 << 20
    for loss in losses:
        loss.backward()
    for mgr in managers:
        mgr.close()
    assert pool.reserved_bytes == 0


class _SinChain(nn.Module):
    """``k`` sines in a row: each saves its input, a record of the input's bytes."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w
        for _ in range(self.k):
            x = torch.sin(x)
        return x


def test_cpu_budget_counts_the_host_regions_padding(tmp_path) -> None:
    """181 records of 5,000 bytes with cpu_budget=1MiB: the budget was checked against the
    records' bytes (905,000), while each took an 8 KiB region of the pool: the manager held
    1.41 MiB of host memory, and on a shared pool that was room another manager had claimed for
    its own budget (it then failed under its budget). Now the regions are what is counted: 128
    records stay in host memory (1 MiB), the rest go to NVMe; gradients are exact."""
    torch.manual_seed(0)
    model, x = _SinChain(180), torch.randn(1250)
    model(x).sum().backward()
    want = model.w.grad.clone()
    model.zero_grad(set_to_none=True)
    with manager(model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget="1MiB") as mgr:
        with mgr:
            loss = model(x).sum()
        host = mgr._tiers[0]
        assert mgr._executor.cpu_bytes == host.used_bytes <= 1 << 20
        assert mgr.stats.last.records_offloaded_cpu == 128
        assert mgr.stats.last.records_offloaded_nvme == 181 - 128
        loss.backward()
        assert torch.equal(model.w.grad, want)
        assert mgr._executor.cpu_bytes == host.used_bytes == 0


class _TwoSins(nn.Module):
    """Saves ``a + w`` then ``b + w`` (one record each, of ``a``'s and ``b``'s bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sin(a + self.w).sum() + torch.sin(b + self.w).sum()


def test_a_cpu_budget_of_no_power_of_two_holds_a_small_then_a_large_record(monkeypatch) -> None:
    """cpu_budget=3MiB, host tier only, a step saving 1 MiB then 2 MiB: the budget has room for
    both, but the pool (slabs are powers of two: 2 + 1 MiB) gave the 1 MiB record the 2 MiB slab
    and refused the 2 MiB one, so the step raised StorageFullError with 1 MiB of the budget
    never used. Now both are stored (3 MiB), gradients are exact, and the second step
    allocates nothing."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    model, a, b = _TwoSins(), torch.randn(1 << 18), torch.randn(1 << 19)
    model(a, b).backward()
    want = model.w.grad.clone()
    with manager(model, tiers=("cpu",), cpu_budget="3MiB") as mgr:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mgr:
                loss = model(a, b)
            loss.backward()
            assert torch.equal(model.w.grad, want)
            assert mgr.stats.last.bytes_offloaded_cpu == 3 << 20
            assert mgr.stats.last.records_offloaded_cpu == 2
        assert mgr.stats.last.host_allocations == 0
        assert mgr._executor.cpu_bytes == 0


def test_a_step_whose_nvme_tier_cannot_be_made_gives_its_pool_claim_back(
    tmp_path, monkeypatch
) -> None:
    """nvme_dir removed after the manager was made: each step fails building its tiers. The
    host tier made before it and the claim on the shared pool are given back (each failed step
    raised the pool's cap by its staging room and kept a claim until close()); once the
    directory is back, a step runs and its gradients are exact."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    want = reference_grads("mlp")
    case = mlp(seed=0)
    spill = tmp_path / "spill"
    spill.mkdir()
    # Another user of the pool (a second pipeline stage, say) holds a claim throughout.
    other = storage.claim_shared_host_pool(1 << 20, pin_memory=False)
    pool, claims = other.pool, storage._pool._shared_claims
    cap = pool.capacity_bytes
    with manager(case.model, tiers=("cpu", "nvme"), nvme_dir=spill, cpu_budget="4MiB") as mgr:
        spill.rmdir()
        for _ in range(3):
            with pytest.raises(ValueError, match="does not exist"):
                offloaded_step(case, mgr)
            assert claims[pool] == [other]
            assert pool.capacity_bytes == cap
        assert mgr._executor is None and mgr._resources == []
        spill.mkdir()
        assert_bitwise(offloaded_step(case, mgr), want)
        assert len(claims[pool]) == 2
    assert claims[pool] == [other] and pool.capacity_bytes == cap
    other.close()


def test_spill_to_nvme_when_the_pool_is_as_big_as_cpu_budget(tmp_path, monkeypatch) -> None:
    """The first manager of a process sizes the shared pool at its ``cpu_budget``."""
    budget = 64 << 10
    pools: list[storage.HostPool] = []

    def private_pool(capacity_bytes: int | None = None, **kw: Any) -> storage.HostPool:
        pools.append(storage.HostPool(capacity_bytes or budget, slab_bytes=budget))
        return pools[-1]

    monkeypatch.setattr(storage, "shared_host_pool", private_pool)
    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    try:
        with manager(
            case.model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget=budget
        ) as mgr:
            assert_bitwise(offloaded_step(case, mgr), want)
            assert mgr.stats.last.bytes_offloaded_nvme > 0
    finally:
        for pool in pools:
            pool.close()


def test_a_full_pool_waits_for_the_copies_in_flight_before_it_refuses(
    tmp_path, monkeypatch
) -> None:
    """tiers=("cpu", "nvme"), cpu_budget="2MiB", and another user of the process-wide pool
    holding all but 2 MiB of the staging room the manager claimed: the host tier takes the
    first two 1 MiB records, NVMe staging the next two, and with their copies still in flight
    (the deferred engine held back) the fifth found the pool full and the step raised
    StorageFullError, though the first file write to end gives its staging back. Now the pack
    waits for the oldest copies out (counted in backpressure_waits) and goes on; gradients
    bitwise, every record stored, nothing left held."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(1024, 1024), nn.Tanh())])
    x = torch.randn(256, 1024)  # 1 MiB records: x and each Tanh output
    model(x).sum().backward()
    want = local_grads(model)
    pool = storage.shared_host_pool(pin_memory=False)
    staging_claim = 2 * (256 << 20)  # the least a manager with NVMe claims (_make_executor)
    other = pool.allocate(staging_claim - (2 << 20))  # a slab of 512 MiB, 2 MiB of it free
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.001, seed=5)
    mgr = offload.ActivationOffloader(
        model,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget="2MiB",
        max_inflight_bytes="64MiB",  # back-pressure never waits here: only the full pool does
        min_offload_bytes=0,
        _copy_engine=engine,
    )
    waited, done = threading.Event(), threading.Event()

    def hold_copies_back() -> None:
        # Every copy and file write waits until the manager waits for one, or its step failed
        # (which waits for them too, to release their regions).
        with engine.paused():
            waited.set()
            while not done.is_set():
                step = mgr._executor.step if mgr._executor is not None else None
                if step is not None and (step.stats.backpressure_waits or step.failed):
                    break
                time.sleep(0.001)

    holder = threading.Thread(target=hold_copies_back)
    try:
        holder.start()
        waited.wait()
        model.zero_grad(set_to_none=True)
        try:
            with mgr:
                loss = model(x).sum()
        finally:
            done.set()
            holder.join()
        loss.backward()
        assert_bitwise(local_grads(model), want)
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 2 and last.records_offloaded_nvme == 4
        assert last.backpressure_waits > 0
        del loss
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()
        other.release()
        pool.close()
