"""Helpers shared by the tests of budget mode (profile, plan, execute)."""

from __future__ import annotations

import torch
from models import ModelCase
from torch import nn

import offload
from offload.lifecycle import HardwareModel

# Copies as fast as this CPU's memcpy roughly; the planner then prefers offloading.
FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)


# A link so slow that moving bytes costs more than recomputing them: recompute is chosen,
# whatever this machine's compute times (at 1e6 B/s, 10 tests chose otherwise once the profiled
# times were scaled 100x, as on a machine that much slower; at 1e4 none did, 0.01x to 100x).
SLOW = HardwareModel.cpu_only(
    copy_bytes_per_s=1e4, disk_write_bytes_per_s=1e4, disk_read_bytes_per_s=1e4
)


STEPS = 4


def keep_all_peak(case: ModelCase) -> int:
    trace = offload.profile(lambda: case.step(0), case.model, warmup_steps=0)
    case.model.zero_grad(set_to_none=True)
    return trace.peak_saved_bytes


def run(
    case: ModelCase, mgr: offload.ActivationOffloader, steps: int = STEPS, first: int = 0
) -> tuple[list[dict[str, torch.Tensor]], list[offload.StepStats]]:
    grads, stats = [], []
    for s in range(first, first + steps):
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(s))
        loss.backward()
        grads.append(case.grads())
        stats.append(mgr.stats.last)
    return grads, stats


def assert_bitwise(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k


class Blocks(nn.Module):
    def __init__(self, n: int = 6, width: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, 2 * width),
                nn.GELU(),
                nn.Linear(2 * width, width),
                nn.LayerNorm(width),
            )
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _blocks_case() -> tuple[nn.Module, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return model, x, want
