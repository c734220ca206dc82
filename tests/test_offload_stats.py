"""The stats: fields and as_dict, host allocations, bounded totals, reloads ahead of their
unpack, and step times given to the step whose backward ended."""

from __future__ import annotations

import time

import torch
from models import gpt_block
from runtime_util import step
from torch import nn

import offload
from offload import storage


def test_stats_fields_and_as_dict() -> None:
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        step(case, mgr, 1)
        st = mgr.stats
        d = st.as_dict()
        assert set(d) == {"last", "total"}
        for key in (
            "bytes_offloaded_cpu",
            "bytes_offloaded_nvme",
            "bytes_recomputed",
            "records_deduplicated",
            "stalls",
            "stall_s",
            "prefetch_lead_s_p50",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "predicted_peak_bytes",
            "step_s",
            "predicted_step_s",
            "unplanned_records",
            "min_memory_steps",
            "fallbacks",
            "host_allocations",
            "prefetches_skipped",
        ):
            assert key in d["last"]
        assert st.total.steps == 2 and st.last.steps == 1
        assert st.total.bytes_offloaded_cpu == 2 * st.last.bytes_offloaded_cpu
        assert st.last.reloads > 0 and st.last.step_s > 0
        # Every family came back: prefetched or stalled.
        assert st.last.reloads == st.last.records_offloaded_cpu
        mgr.close()
        # close() folds the last step into the total: the totals stay what they were.
        assert mgr.stats.total.as_dict() == st.total.as_dict()
    finally:
        mgr.close()


def test_host_allocations_count_the_slabs_a_step_made(monkeypatch) -> None:
    """The first step of a new pool allocates its slab; later steps reuse it (the GPU test
    asserts 0 in steady state on pinned memory, so the count must be real)."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        first = mgr.stats.last.host_allocations
        step(case, mgr, 1)
        assert first >= 1 and mgr.stats.last.host_allocations == 0
        assert mgr.stats.total.host_allocations == first == mgr._executor.pool.host_allocations
    finally:
        mgr.close()


def test_total_stats_keep_a_bounded_window_of_lead_times() -> None:
    """A long run's totals must not grow with it (docs/design.md: no leaks): the lead-time median of
    the total is over the last LEAD_WINDOW prefetches."""
    from offload._stats import LEAD_WINDOW, StepStats

    total = StepStats()
    for i in range(5):
        step_stats = StepStats(steps=1, _leads=[float(i)] * (LEAD_WINDOW // 2))
        total.add(step_stats)
    assert len(total._leads) == LEAD_WINDOW and total.steps == 5
    # The last two steps (3.0 s and 4.0 s) only; over all five it would be 2.0 s.
    assert total.prefetch_lead_s_p50 == 3.5


def test_prefetch_runs_ahead_of_unpack() -> None:
    """A deep stack: most reloads start from backward pre-hooks before their unpack."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    x = torch.randn(128, 256)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, max_inflight_bytes=1 << 20)
    try:
        with mgr:
            loss = model(x).sum()
        loss.backward()
        last = mgr.stats.last
        assert last.reloads == last.records_offloaded_cpu > 0
        assert last.stalls <= 1  # at most the first unpack, before any module's pre-hook
    finally:
        mgr.close()


def test_step_time_goes_to_the_step_whose_backward_ended() -> None:
    """Two forwards before their backwards (accumulation, pipelining): each step's ``step_s``
    runs from its own start to the end of its own backward, and the total holds both."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    x = torch.randn(16, 32)
    t_a = time.perf_counter()
    with mgr:
        loss_a = model(x).sum()
    t_b = time.perf_counter()
    with mgr:
        loss_b = model(x).pow(2).sum()
    loss_a.backward()
    t_a_end = time.perf_counter()
    loss_b.backward()
    t_b_end = time.perf_counter()
    last, total = mgr.stats.last, mgr.stats.total
    mgr.close()
    # B's time: from B's start to the end of B's backward, not of A's.
    assert t_a_end - t_b < last.step_s <= t_b_end - t_b
    a = total.step_s - last.step_s  # A's time, credited after A was folded into the total
    assert t_a_end - t_b < a <= t_a_end - t_a
