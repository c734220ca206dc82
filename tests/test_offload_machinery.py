"""Offloading where it meets other PyTorch machinery: ``nn.Module.compile()``, each against the
same run without offloading (gradients bitwise) and dynamo's own counters."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from models import seeded_steps
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.lifecycle import HardwareModel

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
    want = seeded_steps(compiled_blocks(where), n=4)
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
        got = seeded_steps(model, mgr, n=4)
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


@pytest.mark.parametrize("again_before", [1, 4], ids=["before_step_1", "before_step_4"])
@pytest.mark.parametrize("budget", [False, True], ids=["min_memory", "budget"])
@pytest.mark.parametrize("where", ["root", "submodule"])
def test_a_module_compiled_again_keeps_its_hooks(
    where: str, budget: bool, again_before: int
) -> None:
    """``mod.compile()`` again, after the manager was made, replaces the compiled call its hooks
    ran around (NOTE [ Hooks of a compiled call ]): the manager's and the recorder's hooks of
    that module stopped running, silently. Compiled again before step 4, a submodule's packs
    took its parent's keys: 3 unplanned records a step, 81920 saved bytes held against a plan
    of 40960 under a 48 KiB budget; at the root no step had a signature, and every step ran in
    min-memory mode (131072 bytes offloaded instead of the plan's 49152). Each step now puts
    the hooks back around the new compiled call; gradients bitwise, no graph break."""
    from offload._live import SavedBytes

    name = "" if where == "root" else "blocks.1"

    def run(make: Any) -> tuple[list[dict[str, torch.Tensor]], list[Any]]:
        model = compiled_blocks(where)
        target = model.get_submodule(name)
        mgr = make(model) if make is not None else None
        grads, seen, compiled_call = [], [], None
        for s in range(6):
            if s + 1 == again_before:
                target.compile(backend="eager", fullgraph=True)
                compiled_call = target.__dict__["_compiled_call_impl"]
            with SavedBytes.on(mgr) if mgr is not None else contextlib.nullcontext() as saved:
                grads += seeded_steps(model, mgr, n=1, first=s)
            if mgr is not None:
                seen.append(
                    (mgr.stats.last, saved.peak_planned, mgr._step.calls.counts.get(name, 0))
                )
        if mgr is not None:
            mgr.close()
        # close() leaves the module compiled the second time, without the manager.
        assert target._compiled_call_impl is compiled_call
        return grads, seen

    torch._dynamo.reset()
    want, _ = run(None)
    torch._dynamo.reset()
    kw: dict[str, Any] = dict(gpu_budget=48 << 10, hardware=SLOW) if budget else {}
    counters = torch._dynamo.utils.counters
    counters.clear()
    got, seen = run(lambda m: offload.ActivationOffloader(m, min_offload_bytes=0, **kw))
    assert sum(counters["graph_break"].values()) == 0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k
    assert all(stats.records_offloaded_cpu > 0 for stats, _, _ in seen)
    if budget:
        for stats, peak, _ in seen[1:]:  # planned from step 2 on
            assert stats.unplanned_records == 0 and stats.min_memory_steps == 0
            assert 0 < peak <= stats.predicted_peak_bytes <= 48 << 10
    # The module's hooks ran in every step: one call of it each.
    assert [calls for _, _, calls in seen] == [1] * 6


def test_a_module_whose_compiled_call_is_gone_warns_once() -> None:
    """A ``.compile()``d module whose ``_compiled_call_impl`` is set back to None runs its
    eager call, without the manager's hooks (they ran around the compiled call, and its
    submodules have none): nothing is left to put them back around. That went unsaid; now one
    RuntimeWarning names the module, and gradients stay bitwise."""
    want = seeded_steps(compiled_blocks("submodule"), n=3)
    model = compiled_blocks("submodule")
    with contextlib.closing(offload.ActivationOffloader(model, min_offload_bytes=0)) as mgr:
        got = seeded_steps(model, mgr, n=1)
        model.blocks[1]._compiled_call_impl = None
        with pytest.warns(RuntimeWarning, match="'blocks.1' no longer has the compiled") as record:
            got += seeded_steps(model, mgr, n=2, first=1)
        assert mgr.stats.last.records_offloaded_cpu > 0
    # The user's line: the with statement, in seeded_steps.
    assert len(record) == 1 and record[0].filename == seeded_steps.__code__.co_filename
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.equal(g[k], w[k]), k


def _identity_hooks() -> Any:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)], ids=["cpu", "nvme"])
@pytest.mark.parametrize("foreign", ["identity", "save_on_cpu"])
def test_foreign_saved_tensor_hooks_inside_the_step_warn_once(
    foreign: str, tiers: tuple[str, ...], tmp_path: Any
) -> None:
    """Saved-tensor hooks entered inside ``with mgr:`` (a library's own pair, or torch's
    ``save_on_cpu``) take every pack under them (only the innermost pair fires): the step
    offloaded 0 bytes, silently (docs/design.md: warn once). Now the first module call under them
    warns, naming it; gradients stay bitwise and torch.utils.checkpoint's own pair does not
    warn."""
    torch.manual_seed(0)
    want = seeded_steps(Blocks(), n=2)
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
            mgr._warn.warned.clear()
            with mgr:
                x = torch.randn(32, 64)
                loss = checkpoint(model, x, use_reentrant=False).pow(2).sum()
            loss.backward()
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.equal(g[k], w[k]), k
