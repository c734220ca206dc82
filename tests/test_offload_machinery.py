"""Offloading where it meets other PyTorch machinery: ``nn.Module.compile()``, each against the
same run without offloading (gradients bitwise) and dynamo's own counters."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from lifecycle import HardwareModel

SLOW = HardwareModel.cpu_only(
    copy_bytes_per_s=1e6, disk_write_bytes_per_s=1e6, disk_read_bytes_per_s=1e6
)


class Block(nn.Module):
    # Not an nn.Sequential: torch 2.13 cannot compile torch's own module classes' _call_impl
    # with fullgraph=True (their frames are in dynamo's skip list), offload or not.
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Blocks(nn.Module):
    def __init__(self, n: int = 3, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def compiled_blocks(where: str) -> Blocks:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Blocks()
    (model if where == "root" else model.blocks[1]).compile(backend="eager", fullgraph=True)
    return model


def steps(model: nn.Module, mgr: Any = None, n: int = 3) -> list[dict[str, torch.Tensor]]:
    out = []
    for s in range(n):
        model.zero_grad(set_to_none=True)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s))
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("budget", [False, True], ids=["min_memory", "budget"])
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)], ids=["cpu", "nvme"])
@pytest.mark.parametrize("where", ["root", "submodule"])
def test_module_compile_fullgraph_runs_its_hooks_outside_dynamo(
    where: str, tiers: tuple[str, ...], budget: bool, tmp_path: Any
) -> None:
    """``mod.compile()`` compiles the call that runs ``mod``'s hooks, so dynamo traced the
    manager's (and in budget mode the recorder's) hooks of that module: 2 graph breaks per
    compiled module and step at compilation (a lock), recompilations of the manager's own
    methods at steps 2-4 in budget mode (guards on its plans), and under ``fullgraph=True``
    every step raised ``Unsupported`` with a note blaming compilation after the manager. The
    hooks of a ``.compile()``d module now run around its compiled call, outside dynamo."""
    torch._dynamo.reset()
    want = steps(compiled_blocks(where), n=4)
    torch._dynamo.reset()
    model = compiled_blocks(where)
    target = model if where == "root" else model.blocks[1]
    compiled_call = target._compiled_call_impl
    kw: dict[str, Any] = {"nvme_dir": tmp_path} if "nvme" in tiers else {}
    if budget:
        kw.update(gpu_budget=48 << 10, hardware=SLOW)
    mgr = offload.ActivationOffloader(model, tiers=tiers, min_offload_bytes=0, **kw)
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        got = steps(model, mgr, n=4)
        stats = mgr.stats.last
    finally:
        mgr.close()
    assert sum(counters["graph_break"].values()) == 0
    assert stats.bytes_offloaded_cpu + stats.bytes_offloaded_nvme > 0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k
    # close() leaves the module compiled as it was, without the manager.
    assert target._compiled_call_impl is compiled_call


def _identity_hooks() -> Any:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)], ids=["cpu", "nvme"])
@pytest.mark.parametrize("foreign", ["identity", "save_on_cpu"])
def test_foreign_saved_tensor_hooks_inside_the_step_warn_once(
    foreign: str, tiers: tuple[str, ...], tmp_path: Any
) -> None:
    """Saved-tensor hooks entered inside ``with mgr:`` (a library's own pair, or torch's
    ``save_on_cpu``) take every pack under them (only the innermost pair fires): the step
    offloaded 0 bytes, silently (DESIGN.md: warn once). Now the first module call under them
    warns, naming it; gradients stay bitwise and torch.utils.checkpoint's own pair does not
    warn."""
    torch.manual_seed(0)
    want = steps(Blocks(), n=2)
    torch.manual_seed(0)
    model = Blocks()
    kw: dict[str, Any] = {"nvme_dir": tmp_path} if "nvme" in tiers else {}
    hooks = _identity_hooks if foreign == "identity" else torch.autograd.graph.save_on_cpu
    with contextlib.closing(
        offload.ActivationOffloader(model, tiers=tiers, min_offload_bytes=0, **kw)
    ) as mgr:
        got = []
        with pytest.warns(RuntimeWarning, match="entered inside this step") as record:
            for s in range(2):
                model.zero_grad(set_to_none=True)
                x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s))
                with mgr, hooks():
                    loss = model(x).pow(2).sum()
                loss.backward()
                got.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert mgr.stats.last.bytes_offloaded_cpu + mgr.stats.last.bytes_offloaded_nvme == 0
        assert len([r for r in record if "entered inside this step" in str(r.message)]) == 1
        assert "blocks" in str(record[0].message) or "''" in str(record[0].message)
        warned = [r for r in record if "entered inside this step" in str(r.message)]
        assert warned[0].filename == __file__  # the user's line, not torch's Module.__call__
        # Checkpoint's pair, pushed during its forward, is not foreign.
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            mgr._warned.clear()
            with mgr:
                x = torch.randn(32, 64)
                loss = checkpoint(model, x, use_reentrant=False).pow(2).sum()
            loss.backward()
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.equal(g[k], w[k]), k
