"""The profiling step of budget mode: forwards before their backwards, backwards that
raise, forwards without grad, other threads, graph captures, and the refinement of a plan
from its first planned step."""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import warnings
from typing import Any

import pytest
import torch
from budget_util import FAST, Blocks, assert_bitwise, keep_all_peak, run
from models import fail_backward_at
from torch import nn

import offload


def _mlp_and_batches(n: int) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Tanh())
    return model, [
        torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(n)
    ]


def _accumulated(model: nn.Module, batches: list[torch.Tensor], mgr: Any) -> list[torch.Tensor]:
    """Gradients of two microbatches whose forwards both run before their backwards."""
    model.zero_grad(set_to_none=True)
    losses = []
    for x in batches:
        with mgr:
            losses.append(model(x).pow(2).sum())
    for loss in losses:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("microbatches", [2, 3])
def test_forwards_before_their_backwards_never_leave_the_profiler_recording(
    microbatches: int,
) -> None:
    """docs/design.md names two forwards before their backwards (accumulation). A profile the next step
    cuts short cannot describe one step: it is dropped, and the GC the recorder holds off during
    a profiled step comes back. After two such profiles the signature runs in min-memory mode
    (said once) instead of recording again and again; gradients stay bitwise. No step is
    profiled while an older one's backward is still to run (it would be recorded as its own)."""
    model, batches = _mlp_and_batches(microbatches)
    want = _accumulated(model, batches, contextlib.nullcontext())
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    try:
        with pytest.warns(RuntimeWarning, match="began before the backward") as caught:
            for _ in range(4):
                got = _accumulated(model, batches, mgr)
                assert gc.isenabled()
                assert not mgr._budget._profiler.recorder.recording
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g, w)
        assert len([w for w in caught if "began before" in str(w.message)]) == 1
        assert mgr.plans == {} and mgr._budget._profiler.recorder.steps_recorded == 0
        assert mgr.stats.last.bytes_offloaded_cpu > 0  # min-memory mode
    finally:
        mgr.close()


def test_a_graph_kept_alive_after_a_cut_profile_ends_in_min_memory_mode_said_once() -> None:
    """A profile cut short, then an old graph kept alive (its loss held, no backward): no step
    could be profiled again. After 8 such steps the signature runs in min-memory mode with a
    warning, instead of ignoring gpu_budget silently."""
    model, batches = _mlp_and_batches(2)
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    try:
        with mgr:
            held = model(batches[0]).pow(2).sum()  # never run backward: its graph lives on
        with pytest.warns(RuntimeWarning, match="not profiled in 8 steps in a row") as caught:
            for _ in range(10):
                with mgr:
                    loss = model(batches[1]).pow(2).sum()
                loss.backward()
        assert len([w for w in caught if "not profiled" in str(w.message)]) == 1
        assert mgr.plans == {} and not mgr._budget._profiler.recorder.recording
        del held
    finally:
        mgr.close()


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_profiled_backwards_that_raise_leave_the_signature_to_be_profiled_again(fault) -> None:
    """The backwards of the first two profiled steps raise midway (a gradient check, Ctrl-C),
    after unpacks; the user drops the loss and trains on. Each such profile is dropped, and the
    next step is profiled again: a fault, not forwards run before their backwards. They counted
    as two unfinished profiles, so the signature ran in min-memory mode for good (no plan after
    8 steps, a warning telling the user to run each backward before the next forward), while
    the same faults raised inside `with mgr:` cost nothing. Gradients of the other steps stay
    bitwise and nothing of the failed steps stays held."""
    model, batches = _mlp_and_batches(8)
    # On the middle Linear's output: its gradient comes after the last layers' unpacks.
    failing = fail_backward_at(model[2], fault)
    want = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        want.append([p.grad.clone() for p in model.parameters()])
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    profiled: list[bool] = []
    planned: list[bool] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "runs in min-memory mode" warning
            for s, x in enumerate(batches):
                model.zero_grad(set_to_none=True)
                with mgr:
                    loss = model(x).pow(2).sum()
                    profiled.append(mgr._budget._profiling is not None)
                    planned.append(mgr._step.active is not None)
                # The first two profiled steps fail.
                failing[:] = [1] if profiled[-1] and sum(profiled) <= 2 else []
                if failing:
                    with pytest.raises(fault):
                        loss.backward()
                    del loss
                    gc.collect()
                    assert mgr._executor.live_families() == 0
                    assert mgr._executor.cpu_bytes == 0
                    continue
                loss.backward()
                for g, w in zip((p.grad for p in model.parameters()), want[s], strict=True):
                    assert torch.equal(g, w)
        # Each step after a failed one is profiled (none is lost waiting), then the plan runs.
        assert profiled[:3] == [True, True, True] and planned == [False] * 3 + [True] * 5
        assert list(mgr.plans) == ["float32[32,64]"]
        assert mgr.stats.total.min_memory_steps == 0
        assert mgr._step.active is not None  # the last step ran the plan
    finally:
        mgr.close()


def test_a_forward_without_grad_at_a_new_signature_is_not_profiled() -> None:
    """A validation forward (no_grad) saves nothing to plan: the signature's first training
    step is the one profiled, and the one after it runs the plan."""
    model, batches = _mlp_and_batches(3)
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    try:
        with mgr, torch.no_grad():
            model(batches[0])
        assert gc.isenabled() and not mgr._budget._profiler.recorder.recording
        unplanned = []
        for x in batches:
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
            unplanned.append(mgr.stats.last.unplanned_records)
        assert list(mgr.plans) == ["float32[32,64]"]
        assert (
            mgr.stats.last.predicted_peak_bytes == mgr.plans["float32[32,64]"].predicted_peak_bytes
        )
        assert unplanned[1:] == [0, 0]
    finally:
        mgr.close()


def test_a_forward_without_grad_before_the_training_forward_leaves_the_step_planned() -> None:
    """Each step first runs the model under no_grad (a teacher's or an EMA target's forward
    through the same model), then trains on another batch. The step's signature is the training
    forward's: it is profiled, planned and executed with every key matched, held bytes within
    the budget, gradients bitwise. Before, the no_grad call (the root's first of the step) gave
    the signature: no step was ever profiled, every one ran in min-memory mode."""
    from offload._live import SavedBytes

    model, batches = _mlp_and_batches(4)
    teacher_in = [
        torch.randn(8, 64, generator=torch.Generator().manual_seed(9 + i)) for i in range(4)
    ]

    def step(mgr: offload.ActivationOffloader | None, i: int) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            with torch.no_grad():
                target = model(teacher_in[i]).mean()
            loss = (model(batches[i]) - target).pow(2).sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    mgr = offload.ActivationOffloader(model, gpu_budget="24KiB", hardware=FAST, min_offload_bytes=0)
    try:
        for i in range(4):
            with SavedBytes.on(mgr) as saved:
                got = step(mgr, i)
            for g, w in zip(got, step(None, i), strict=True):
                assert torch.equal(g, w)
        plan = mgr.plan
        assert list(mgr.plans) == ["float32[32,64]"] and plan is not None
        last = mgr.stats.last
        assert last.predicted_peak_bytes == plan.predicted_peak_bytes > 0
        assert last.unplanned_records == 0
        assert 0 < saved.peak_planned <= plan.predicted_peak_bytes <= 24 << 10
    finally:
        mgr.close()


class Aside(nn.Module):
    """An identity that first runs ``aside`` (when set): work done in the middle of a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.aside: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.aside is not None:
            self.aside()
        return x


def test_another_threads_module_calls_are_not_the_steps() -> None:
    """An evaluation thread calls a submodule of the model while the profiled step runs. Before,
    the manager's hooks and its recorder counted that call as the step's: the profile held two
    calls of the module, the step's own as call 1, and every planned step (where nobody else
    calls it) then had 1 of its 6 packs unplanned. Now the other thread's call is its own."""
    torch.manual_seed(0)
    model = nn.Sequential(Aside(), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Tanh())
    batches = [torch.randn(32, 64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    want = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        want.append([p.grad.clone() for p in model.parameters()])
    seen: list[torch.Tensor] = []

    def evaluate() -> None:
        with torch.no_grad():
            seen.append(model[3](torch.ones(4, 128)))

    def on_another_thread() -> None:
        t = threading.Thread(target=evaluate)
        t.start()
        t.join()

    mgr = offload.ActivationOffloader(model, gpu_budget="40KiB", hardware=FAST, min_offload_bytes=0)
    try:
        for s, x in enumerate(batches):
            model[0].aside = on_another_thread if s == 0 else None  # the profiled step only
            model.zero_grad(set_to_none=True)
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
            assert mgr._step.calls.counts == {name: 1 for name, _ in model.named_modules()}
            assert all(
                torch.equal(p.grad, w) for p, w in zip(model.parameters(), want[s], strict=True)
            )
            if s:
                assert mgr.stats.last.predicted_peak_bytes > 0  # planned
                assert mgr.stats.last.unplanned_records == 0
        trace = mgr._budget._profiler.trace()
        starts = [e.module for e in trace.events if e.kind.name == "FORWARD_START" and not e.step]
        assert starts == ["", "0", "1", "2", "3", "4"]
    finally:
        mgr.close()
    assert len(seen) == 1 and torch.equal(seen[0], model[3](torch.ones(4, 128)))


class _StepClock:
    """A fake clock: each stamp advances by ``per_stamp`` seconds (set per step)."""

    def __init__(self) -> None:
        self.now, self.per_stamp = 0.0, 1.0

    def stamp(self) -> float:
        self.now += self.per_stamp
        return self.now

    def seconds(self, stamps):
        return [float(s) - float(stamps[0]) for s in stamps] if stamps else []


def test_retimed_takes_module_times_from_the_timed_step_less_recomputation() -> None:
    """NOTE [ Refinement ]: the profile's step gets the timed step's module times; a planned
    checkpoint's recomputation in the timed step is cut out of its clock."""
    from offload._planned import retimed
    from offload.lifecycle import EventKind, Recorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    clock = _StepClock()
    rec = Recorder(clock=clock)
    x = torch.randn(4, 8, requires_grad=True)
    with rec.attach(model), rec.hooks():
        rec.begin_step()  # step 0: 1 s per event
        model(x).sum().backward()
        rec.end_step()
        clock.per_stamp = 3.0  # step 1: 3 s per event, and block "1" under checkpoint
        rec.begin_step()
        h = model[0](x)
        torch.utils.checkpoint.checkpoint(model[1], h, use_reentrant=False).sum().backward()
        rec.end_step()
    trace = rec.trace()
    mine = [e for e in trace.events if e.step == 0]
    theirs = [e for e in trace.events if e.step == 1]
    # Step 1 recomputes block "1" in its backward: forward events of calls step 0 lacks.
    calls = {(e.module, e.call_index) for e in mine if e.kind is EventKind.FORWARD_START}
    extra = [
        e
        for e in theirs
        if e.kind is EventKind.FORWARD_START and (e.module, e.call_index) not in calls
    ]
    assert extra, "the checkpoint's recomputation was not recorded"
    # The recomputation stops early (non-reentrant checkpoint), so no end of it is recorded:
    # its span runs to the next event of step 1's own timeline.
    at = theirs.index(extra[0])
    start = extra[0].time_s
    end = next(
        e.time_s
        for e in theirs[at:]
        if e.kind not in (EventKind.FORWARD_START, EventKind.FORWARD_END)
        or (e.module, e.call_index) in calls
    )
    out = retimed(trace, 0, 1)
    new = [e for e in out.events if e.step == 0]
    assert new[0].time_s == mine[0].time_s  # the step keeps its start
    assert [e.kind for e in new] == [e.kind for e in mine]
    assert all(b.time_s >= a.time_s for a, b in itertools.pairwise(new))
    span = theirs[-1].time_s - theirs[0].time_s - (end - start)
    assert new[-1].time_s - new[0].time_s == pytest.approx(span)

    # The first module's forward took step 1's time (3 s per event between its boundaries).
    def fwd(events):
        s = next(e.time_s for e in events if e.kind is EventKind.FORWARD_START and e.module == "0")
        f = next(e.time_s for e in events if e.kind is EventKind.FORWARD_END and e.module == "0")
        return f - s

    assert fwd(new) == pytest.approx(fwd(theirs)) and fwd(theirs) == 3 * fwd(mine)
    r0 = [r for r in out.records if r.step == 0]
    times = {e.index: e.time_s for e in new}
    assert all(r.pack_time_s == times[r.pack_event] for r in r0)


def test_a_profiled_plan_is_refined_once_from_its_first_planned_step(caplog) -> None:
    """docs/design.md "Data flow" 2: the profiling step's timings are not compute times, so the first
    planned step is timed and the signature re-planned once from it; gradients stay bitwise and
    the refined plan runs with no unplanned record, within budget. A given plan is not refined."""
    import logging

    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))

    def grads(mgr: offload.ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads(None)
    trace = offload.profile(lambda: grads(None), model, warmup_steps=0)
    budget = trace.peak_saved_bytes // 2
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    with caplog.at_level(logging.INFO, logger="offload"):
        assert_bitwise([grads(mgr)], [want])  # profiled
        first = mgr.plan  # planned from the profile
        assert first is not None and "refined" not in first.metadata
        assert_bitwise([grads(mgr)], [want])  # runs it, timed
        refined = mgr.plan  # re-planned from the timed step
        assert_bitwise([grads(mgr)], [want])  # runs the refined plan
    assert refined is not None and refined is not first and refined.metadata["refined"]
    assert refined.metadata["first_plan_step_s"] == first.predicted_step_s
    assert "refined the plan of signature" in caplog.text
    assert mgr.stats.last.unplanned_records == 0
    assert mgr.stats.last.predicted_step_s == refined.predicted_step_s
    with SavedBytes.on(mgr) as saved:
        assert_bitwise([grads(mgr)], [want])
    assert saved.peak_planned <= refined.predicted_peak_bytes <= budget
    assert mgr.plan is refined  # once
    given = offload.ActivationOffloader(model, plan=refined, hardware=FAST, min_offload_bytes=0)
    for _ in range(3):
        assert_bitwise([grads(given)], [want])
    assert given.plan is not None and given.plan.metadata == refined.metadata
    mgr.close()
    given.close()


def test_the_profiling_step_stores_no_more_than_min_memory_mode() -> None:
    """Step 1 of a budget runs in min-memory mode, and now as min-memory mode runs: each GELU
    and LayerNorm output its next Linear saves is rebuilt from the input stored for the
    activation's own backward, not stored too (on 4 GPT blocks: 2,179,072 bytes offloaded
    and 727,040 saved bytes peak before, 1,392,640 and 648,192 now), and the trace still links
    each to that input (TensorRecord.rebuild_from). Gradients bitwise, profiled and planned."""
    from models import block_stack

    from offload._live import SavedBytes

    case = block_stack(seed=0, n_layer=4)
    want = []
    for s in range(3):
        case.step(s)
        want.append(case.grads())
    measured = {}
    for budget in (None, int(0.6 * keep_all_peak(case))):
        mgr = offload.ActivationOffloader(
            case.model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0
        )
        try:
            with SavedBytes.on(mgr) as saved:
                grads, stats = run(case, mgr, steps=1)
            measured[budget is None] = (stats[0].as_dict(), saved.peak)
            if budget is not None:
                assert mgr._budget._profiler is not None
                links = [r for r in mgr._budget._profiler.trace().records if r.rebuild_from >= 0]
                more, _ = run(case, mgr, steps=2, first=1)  # planned
                assert_bitwise(grads + more, want)
            else:
                assert_bitwise(grads, want[:1])
        finally:
            mgr.close()
    (plain, plain_peak), (profiled, profiled_peak) = measured[True], measured[False]
    assert profiled["records_rebuilt"] == plain["records_rebuilt"] == len(links) == 12
    for k in ("bytes_offloaded_cpu", "bytes_rebuilt"):
        assert profiled[k] == plain[k], k
    assert profiled_peak == plain_peak


def test_a_step_inside_a_graph_capture_is_neither_profiled_nor_timed() -> None:
    """Inside a CUDA graph capture (simulated on CPU, see NOTE [ No query while capturing ])
    packs pass through, so such a step shows neither the signature's structure nor the plan's
    timings: it is not profiled (the next step is) and not the planned step timed for the
    refinement (the next one is). Profiled inside a capture, its clock's CUDA events would be
    captured too and read with a device synchronization, which the capture forbids."""
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    profiling: list[Any] = []

    def grads(mgr: offload.ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
            if mgr is not None:
                profiling.append(mgr._budget._profiling)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def captured(mgr: offload.ActivationOffloader) -> dict[str, torch.Tensor]:
        with mgr._executor.capture.simulate(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "saved tensors are left in place"
            return grads(mgr)

    want = grads(None)
    trace = offload.profile(lambda: grads(None), model, warmup_steps=0)
    budget = trace.peak_saved_bytes // 2
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    try:
        assert_bitwise([grads(mgr)], [want])  # makes the executor; profiled
        first = mgr.plan
        assert first is not None and profiling[-1] is not None
        assert_bitwise([captured(mgr)], [want])
        assert profiling[-1] is None and mgr.plan is first  # not timed for the refinement
        assert_bitwise([grads(mgr)], [want])
        assert profiling[-1] is not None  # this one is
        refined = mgr.plan
        assert refined is not first and refined is not None and refined.metadata["refined"]
        assert_bitwise([grads(mgr)], [want])
        assert mgr.stats.last.unplanned_records == 0
        x = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))  # a new signature
        want = grads(None)
        assert_bitwise([captured(mgr)], [want])
        assert profiling[-1] is None  # not profiled
        assert_bitwise([grads(mgr)], [want])
        assert profiling[-1] is not None  # this one is
    finally:
        mgr.close()
