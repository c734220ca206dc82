"""One op saving one tensor twice (NOTE [ Packed again ] in offload/_pack.py): the second pack
takes the first one's decision, and only when it is the same op, the same tensor and the same
version. Each case against a run without offloading, bitwise, and with the counters the full
path gives."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from offload_util import ENGINES, assert_nothing_live, manager, nvme_kw
from torch import nn

import offload


class SavesTwice(torch.autograd.Function):
    """``save_for_backward(a, a)``: one node, two packs of one tensor."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, a)
        return a * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        a, b = ctx.saved_tensors
        assert a.data_ptr() != 0 and torch.equal(a, b)
        return g * a * b


def _squares(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    for _ in range(n):
        x = x * x  # saves x twice
    return x


def _run(mgr: Any, x0: torch.Tensor, body: Any) -> torch.Tensor:
    x = x0.clone().requires_grad_()
    ctx = mgr if mgr is not None else contextlib.nullcontext()
    with ctx:
        loss = body(x).sum()
    loss.backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_squared_is_stored_once_per_op(
    engine: str, tiers: tuple[str, ...], dtype: torch.dtype, tmp_path: Any
) -> None:
    x0 = (torch.rand(64, 32, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    want = _run(None, x0, _squares)
    with manager(nn.Identity(), engine, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        got = _run(mgr, x0, _squares)
        assert torch.equal(got, want)
        last = mgr.stats.last
        assert last.records == 12
        # Each mul stores its input once; its second pack joins that family.
        moved = last.records_offloaded_cpu + last.records_offloaded_nvme
        assert moved == 6 and last.records_deduplicated == 6
        assert last.bytes_offloaded_cpu + last.bytes_offloaded_nvme == 6 * x0.numel() * x0.itemsize
        assert_nothing_live(mgr)


def test_save_for_backward_of_one_tensor_twice() -> None:
    x0 = torch.randn(32, 32, generator=torch.Generator().manual_seed(2))

    def body(x: torch.Tensor) -> torch.Tensor:
        return SavesTwice.apply(torch.tanh(x))

    want = _run(None, x0, body)
    with manager(nn.Identity()) as mgr:
        assert torch.equal(_run(mgr, x0, body), want)
        assert mgr.stats.last.records_deduplicated == 2  # tanh's output: by tanh, then twice
        assert_nothing_live(mgr)


def test_data_reassigned_between_two_ops_is_stored_anew() -> None:
    """``x.data = ...`` keeps x's id and version: only the op's sequence number tells the next
    op's pack from the same op's second one. The second op must store the new bytes. (Against
    hooks that copy at pack, as offload does: without hooks autograd keeps x itself for the
    first op, and reads the new bytes there too; so does ``save_on_cpu`` on a CPU tensor,
    whose ``.cpu()`` is no copy.)"""
    x0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    other = torch.randn(16, 16, generator=torch.Generator().manual_seed(4))

    def run(mgr: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a = x0.clone().requires_grad_()
        b = other.clone().requires_grad_()
        copied = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
        ctx = mgr if mgr is not None else copied
        with ctx:
            x = a * 1.0
            y = x * x  # packs x twice
            with torch.no_grad():
                x.data = b.detach() * 3.0  # same tensor object, same version, other bytes
            z = x * x  # must save the new bytes
            loss = (y + z).sum()
        loss.backward()
        assert a.grad is not None
        return a.grad, z.detach()

    want_grad, want_z = run(None)
    with manager(nn.Identity()) as mgr:
        got_grad, got_z = run(mgr)
        assert torch.equal(got_z, want_z)
        assert torch.equal(got_grad, want_grad)
        assert_nothing_live(mgr)


def test_in_place_change_between_two_ops_is_a_new_family() -> None:
    x0 = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))

    def body(x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        y = h * h
        h2 = h.detach()
        h2.add_(1.0)  # a new version of h's bytes: y's saved h is now stale
        return y

    with manager(nn.Identity()) as mgr:
        x = x0.clone().requires_grad_()
        with mgr:
            loss = body(x).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_planned_budget_with_squares_matches_no_offloading() -> None:
    """Under a plan the second pack's record key gets its own decision."""
    torch.manual_seed(0)

    class Squares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _squares(torch.sigmoid(self.lin(x)), 4)

    model = Squares()
    x0 = torch.rand(16, 32)

    def grads(mgr: Any) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        ctx = mgr if mgr is not None else contextlib.nullcontext()
        with ctx:
            loss = model(x0).sum()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    want = grads(None)
    mgr = offload.ActivationOffloader(
        model, tiers=("cpu",), min_offload_bytes=0, gpu_budget=16 * 32 * 4 * 3
    )
    try:
        for _ in range(4):  # profile, plan, refine, planned
            got = grads(mgr)
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), k
        last = mgr.stats.last
        assert last.min_memory_steps == 0
        assert last.records_deduplicated >= 1
        assert last.records_kept + last.records_offloaded_cpu + last.records_deduplicated == (
            last.records
        )
    finally:
        mgr.close()


def test_one_handle_for_both_saves_is_released_for_both() -> None:
    """In a min-memory step the second pack returns the first one's member (two saved variables
    hold it): dropping the graph unused, or running it twice, releases the family once both are
    gone, and not before."""
    x0 = torch.rand(32, 16, generator=torch.Generator().manual_seed(6)) + 0.5
    with manager(nn.Identity()) as mgr:
        x = x0.clone().requires_grad_()
        with mgr:
            y = _squares(x, 3)
        ex = mgr._executor
        members = [f.members for f in ex.step.families]
        assert members == [2, 2, 2]
        del y  # the graph dies unused
        assert_nothing_live(mgr)

        want = _run(None, x0, lambda t: _squares(t, 3))
        x = x0.clone().requires_grad_()
        with mgr:
            loss = _squares(x, 3).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        assert ex.live_families() == 3  # the retained graph still holds them
        x.grad = None
        loss.backward()  # every family reloads again; this backward frees the graph
        assert torch.equal(first, want) and torch.equal(x.grad, want)
        assert_nothing_live(mgr)
