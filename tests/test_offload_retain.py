"""Graphs that outlive their backward: ``retain_graph=True`` and ``create_graph=True`` (a
gradient penalty) keep saved tensors until the graph dies, not until their last use. The profile
sees it (``Trace.retained_steps`` / ``create_graph_steps``) and the plan counts it, so that what
a planned step holds stays within its predicted peak and its budget (CPU tensors as the device;
held bytes counted exactly by ``SavedBytes``)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn

import offload
from offload._live import SavedBytes
from offload.lifecycle import HardwareModel, Trace

FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)
STEPS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1 = nn.LayerNorm(64), nn.Linear(64, 256)
        self.act, self.fc2 = nn.GELU(), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Model(nn.Module):
    """4 pre-norm blocks of width 64 and hidden 256, and a head: 674,048 saved bytes at 64 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(step))


def _batch_256(step: int) -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(step))


def _retain_step(model: nn.Module, x: torch.Tensor, mgr=None, meter=None) -> tuple[int, int]:
    """Forward (in ``mgr``'s step), then two backwards of one graph; the peak planned saved bytes
    ``meter`` saw during each backward (forward included in the first)."""
    model.zero_grad(set_to_none=True)
    if mgr is None:
        loss = model(x).pow(2).mean()
    else:
        with mgr:
            loss = model(x).pow(2).mean()
    loss.backward(retain_graph=True)
    first = meter.peak_planned if meter is not None else 0
    if meter is not None:
        meter.peak_planned = meter.live_planned
    loss.backward()
    del loss
    second = meter.peak_planned if meter is not None else 0
    return first, second


def _penalty_step(model: nn.Module, x: torch.Tensor, mgr=None) -> None:
    """Forward (in ``mgr``'s step), a gradient penalty on the input, and its backward."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if mgr is None:
        loss = model(x).pow(2).mean()
    else:
        with mgr:
            loss = model(x).pow(2).mean()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + g.pow(2).sum()).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _assert_bitwise(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_the_trace_says_which_steps_kept_their_graph(tmp_path) -> None:
    """The recorder watches one packed object per backward: alive at the backward's end means
    the graph outlived it; grad mode on at its unpack means ``create_graph=True``."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    x = torch.randn(4, 8)

    def plain() -> None:
        model(x).sum().backward()

    def retain() -> None:
        loss = model(x).sum()
        loss.backward(retain_graph=True)  # the graph dies with ``loss``, at the step's end

    def penalty() -> None:
        xx = x.clone().requires_grad_(True)
        loss = model(xx).sum()
        (g,) = torch.autograd.grad(loss, xx, create_graph=True)
        g.pow(2).sum().backward()

    def partial() -> None:
        # A backward that does not reach every node frees what it runs: not retained.
        h = model[0](x)
        (loss,) = (model[2](model[1](h)).sum(),)
        torch.autograd.grad(loss, h)

    got = {}
    for fn in (plain, retain, penalty, partial):
        t = offload.profile(fn, model, warmup_steps=1, steps=2)
        got[fn.__name__] = (t.retained_steps, t.create_graph_steps)
    assert got == {
        "plain": ((), ()),
        "retain": ((0, 1), ()),
        "penalty": ((0, 1), (0, 1)),
        "partial": ((), ()),
    }
    t = offload.profile(penalty, model, warmup_steps=0)
    # Kept to the step's end: the trace's own live bytes peak at every family at once.
    assert t.peak_saved_bytes == t.saved_bytes
    t.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert (back.retained_steps, back.create_graph_steps) == ((0,), (0,))
    # A trace written before the fields existed loads with none.
    data = json.loads((tmp_path / "t.json").read_text())
    del data["retained_steps"], data["create_graph_steps"]
    old = Trace.from_dict(data)
    assert (old.retained_steps, old.create_graph_steps) == ((), ())
    for bad in ([5], [0, 0], "0", [True]):
        with pytest.raises(ValueError, match="retained_steps"):
            Trace.from_dict({**data, "retained_steps": bad})


def test_retain_graph_planned_steps_hold_what_the_plan_predicts() -> None:
    """Budget mode, half the 674,048 saved bytes, forward then two backwards of one graph. The
    plan freed each kept tensor at its last use, but the graph kept them all: the first backward
    held 377,600 saved bytes against the 312,064 predicted. Now the profile sees the graph kept
    and the plan counts kept tensors to the step's end: each backward holds at most the
    prediction, which is within the budget; gradients bitwise."""
    model = _model()
    want = []
    for s in range(STEPS):
        _retain_step(model, _batch(s))
        want.append(_grads(model))
    budget = 674_048 // 2
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    got, held = [], []
    try:
        for s in range(STEPS):
            with SavedBytes.on(mgr) as meter:
                first, second = _retain_step(model, _batch(s), mgr, meter)
            got.append(_grads(model))
            held.append((first, second, mgr.stats.last.predicted_peak_bytes))
        assert mgr.stats.last.unplanned_records == 0
        for first, second, predicted in held[1:]:  # from the second step: planned
            assert 0 < first <= predicted <= budget, held
            assert second <= predicted, held
        trace = mgr._budget._profiler.trace()
        assert trace.retained_steps and not trace.create_graph_steps
    finally:
        mgr.close()
    _assert_bitwise(got, want)


def test_an_offline_plan_of_a_retained_step_holds_what_it_predicts() -> None:
    """``offload.profile`` of a step whose one backward keeps its graph (it dies with the step),
    ``offload.plan`` at half the saved bytes, and the plan run by a manager for a step with two
    backwards: both hold at most the prediction (before: 377,600 held, 312,064 predicted)."""
    model = _model()
    want = []
    for s in range(2):
        _retain_step(model, _batch(s))
        want.append(_grads(model))

    def step() -> None:
        model(_batch(0)).pow(2).mean().backward(retain_graph=True)

    trace = offload.profile(step, model, warmup_steps=0)
    assert trace.retained_steps == (0,) and trace.peak_saved_bytes == 674_048
    budget = trace.peak_saved_bytes // 2
    plan = offload.plan(trace, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    mgr = offload.ActivationOffloader(model, plan=plan, hardware=FAST, min_offload_bytes=0)
    got = []
    try:
        for s in range(2):
            with SavedBytes.on(mgr) as meter:
                first, second = _retain_step(model, _batch(s), mgr, meter)
            got.append(_grads(model))
            assert mgr.stats.last.unplanned_records == 0
            assert 0 < first <= plan.predicted_peak_bytes <= budget, (first, plan)
            assert second <= plan.predicted_peak_bytes, (second, plan)
    finally:
        mgr.close()
    _assert_bitwise(got, want)


def test_a_gradient_penalty_is_planned_with_what_its_graph_keeps() -> None:
    """``torch.autograd.grad(..., create_graph=True)`` keeps the graph, and the graph it builds
    saves again what it unpacked (reloaded buffers too). At a budget of 673,152 B the plan
    predicted 575,232 and the steps held 592,128 saved bytes. Now the profile sees the penalty
    and the plan counts every saved tensor to the step's end: that budget is refused with the
    smallest feasible one, at which the steps hold at most the prediction; gradients bitwise."""
    model = _model()
    want = []
    for s in range(STEPS):
        _penalty_step(model, _batch(s))
        want.append(_grads(model))
    mgr = offload.ActivationOffloader(model, gpu_budget=673_152, hardware=FAST, min_offload_bytes=0)
    try:
        _penalty_step(model, _batch(0), mgr)  # profiled
        with pytest.raises(offload.BudgetInfeasibleError) as info:
            _penalty_step(model, _batch(1), mgr)
    finally:
        mgr.close()
    budget = info.value.min_feasible_bytes
    assert budget > 673_152
    model = _model()
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    got, held = [], []
    try:
        for s in range(STEPS):
            with SavedBytes.on(mgr) as meter:
                _penalty_step(model, _batch(s), mgr)
            got.append(_grads(model))
            held.append((meter.peak_planned, mgr.stats.last.predicted_peak_bytes))
        trace = mgr._budget._profiler.trace()
        assert trace.create_graph_steps and trace.retained_steps
        total = mgr.stats.total
        assert total.bytes_offloaded_cpu + total.bytes_recomputed > 0
    finally:
        mgr.close()
    _assert_bitwise(got, want)
    for got_bytes, predicted in held[1:]:
        assert 0 < got_bytes <= predicted <= budget, (held, budget)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])


def _two_backwards(model: nn.Module, x: torch.Tensor, mgr=None) -> None:
    """One step: forward and two backwards of one graph, inside ``mgr``'s step when given."""
    model.zero_grad(set_to_none=True)
    with mgr if mgr is not None else contextlib.nullcontext():
        y = model(x)
        y.pow(2).mean().backward(retain_graph=True)
        y.sum().backward()


def test_two_backwards_in_a_step_are_planned_per_backward() -> None:
    """``offload.profile`` of a step with two backwards of one graph (4 x (Linear(256, 256) +
    GELU) at 64 rows, 9 saved families of 65,536 B, 589,824 kept). A reload lives for one
    backward and the next reloads it; the plan held it from its first reload to its last use
    in the second backward, so half that raised BudgetInfeasibleError (minimum 524,288). Now a
    plan at half fits, the manager running it holds at most its prediction in every step, and a
    manager given only ``gpu_budget`` (its profile sees the first backward) holds at most its
    own; gradients bitwise equal to no offloading."""
    model = _stack()
    want = []
    for s in range(STEPS):
        _two_backwards(model, _batch_256(s))
        want.append(_grads(model))
    trace = offload.profile(lambda: _two_backwards(model, _batch_256(0)), model, warmup_steps=0)
    assert trace.peak_saved_bytes == 589_824
    budget = trace.peak_saved_bytes // 2
    plan = offload.plan(trace, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    assert plan.predicted_peak_bytes <= budget
    given = offload.ActivationOffloader(model, plan=plan, hardware=FAST, min_offload_bytes=0)
    budgeted = offload.ActivationOffloader(
        model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0
    )
    # From the first step under a given plan; from the second under a budget (the first is its
    # profile).
    for mgr, planned_from in ((given, 0), (budgeted, 1)):
        got, held = [], []
        try:
            for s in range(STEPS):
                with SavedBytes.on(mgr) as meter:
                    _two_backwards(model, _batch_256(s), mgr)
                got.append(_grads(model))
                held.append((meter.peak_planned, mgr.stats.last.predicted_peak_bytes))
                assert mgr.stats.last.unplanned_records == 0
        finally:
            mgr.close()
        _assert_bitwise(got, want)
        for got_bytes, predicted in held[planned_from:]:
            assert 0 < got_bytes <= predicted <= budget, held
