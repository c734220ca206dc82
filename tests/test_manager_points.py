"""The manager's lifecycle points (offload/_points.py): a budgeted run names each one as an
``offload::<name>`` range in torch's profiler and in the ``offload`` logger's debug lines."""

from __future__ import annotations

import logging

import torch
from torch import nn

import offload
from offload.lifecycle import HardwareModel

FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)
MANAGER_POINTS = ("step_begin", "profile_end", "plan", "refine", "verify", "step_end")


def test_a_budgeted_run_shows_the_managers_points_in_the_profiler_and_the_log(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    mgr = offload.ActivationOffloader(model, gpu_budget=1 << 30, hardware=FAST, min_offload_bytes=0)
    x = torch.randn(32, 64)
    with caplog.at_level(logging.DEBUG, logger="offload"), torch.profiler.profile() as prof:
        # Profiled, planned (and timed), refined from the timing step.
        for _ in range(3):
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
    mgr.close()
    assert mgr.plan is not None
    keys = {e.key for e in prof.key_averages()}
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "offload")
    for name in MANAGER_POINTS:
        assert f"offload::{name}" in keys, (name, sorted(k for k in keys if "offload" in k))
        assert f"offload::{name}" in logged, name
