"""The look-ahead window of min-memory mode and of planned steps, and the anchors'
predictions of what each alternative holds, against the running manager."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import pytest
import torch
from budget_util import FAST, assert_bitwise
from models import ALL_MODELS
from torch import nn

import offload
from offload import lifecycle


def test_min_memory_and_profiling_steps_bring_back_a_window_not_the_whole_step() -> None:
    """Min-memory mode (and so a budget's profiling step) reloads ahead within a look-ahead
    window. Its default was the automatic in-flight bound, at least 256 MiB: a step storing less
    got every family back when its backward began and held as many saved bytes as keeping
    everything (this stack of 8 blocks: the profiling step 4,292,608 of 4,292,608 saved bytes,
    min-memory mode 2,785,280; a 4-block GPT-2-style script's profiling step 76,669,892 of
    76,669,892). The default now scales with the step (a quarter of its stored bytes, at least
    twice its largest family): 1,189,888 and 926,720 here, no stall added, gradients bitwise."""
    from models import block_stack

    from offload._live import SavedBytes

    def meter_steps(**kw) -> tuple[list[int], list[offload.StepStats], list]:
        case = block_stack(seed=0)
        mgr = offload.ActivationOffloader(case.model, hardware=FAST, **kw)
        peaks, stats, grads = [], [], []
        for s in range(2):
            case.model.zero_grad(set_to_none=True)
            with SavedBytes.on(mgr) as meter, mgr:
                case.loss(case.batch(s)).backward()
            peaks.append(meter.peak_planned)
            stats.append(mgr.stats.last)
            grads.append(case.grads())
        mgr.close()
        return peaks, stats, grads

    want = block_stack(seed=0)
    want_grads = []
    for s in range(2):
        want.model.zero_grad(set_to_none=True)
        want.step(s)
        want_grads.append(want.grads())
    everything = meter_steps(min_offload_bytes=1 << 40)[0][0]
    assert everything > 8 * 4 * (4 * 32 * 64 * 4)  # more than 4 (4, 32, 64) floats a block
    minimal, mstats, mgrads = meter_steps(min_offload_bytes=0)
    budget, bstats, bgrads = meter_steps(min_offload_bytes=0, gpu_budget=2 * everything)
    assert_bitwise(mgrads, want_grads)
    assert_bitwise(bgrads, want_grads)
    # No stall added: as many as with a window holding the whole step (the loss's input, packed
    # outside every module, is needed before any module's backward starts a reload).
    _, wide, _ = meter_steps(min_offload_bytes=0, max_inflight_bytes=1 << 30)
    assert [s.stalls for s in mstats + bstats[:1]] == [wide[0].stalls] * 3
    assert max(minimal) <= everything // 2, (minimal, everything)
    assert budget[0] <= everything // 2, (budget, everything)  # the profiling step


def _anchor_case(name: str) -> tuple[nn.Module, Any]:
    """A model and its forward (returning the output or the loss) for the anchor tests."""
    import models

    if name == "linear_gelu":
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
        x = torch.randn(256, 256)
        return model, lambda: model(x)
    case = models.block_stack(seed=0, n_layer=2) if name == "block_stack" else ALL_MODELS[name]()
    batch = case.batch(0)
    return case.model, lambda: case.loss(batch)


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("name", ["linear_gelu", "mlp", "gpt_block", "block_stack"])
def test_offload_all_anchor_predicts_min_memory_mode(name: str, backwards: int) -> None:
    """lifecycle.predict_anchors' offload_all predicts the saved bytes the manager holds in
    min-memory mode (no gpu_budget, min_offload_bytes=0), measured (SavedBytes.peak_planned),
    with one backward and with two of one graph. The anchor moved every family, where the
    manager rebuilds GELU / LayerNorm outputs from their inputs (NOTE [ Activation recipes ]),
    and the simulator's window took families in the order backward needs them, where the
    executor walks them last packed first: 4 x (Linear(256) + GELU) at 256 rows predicted
    786,432 B against 1,048,576 measured, the MLP 98,304 against 81,920, the GPT block 363,520
    against 462,848 (1,189,888 against 926,720 for 8 blocks). Now equal, in both cases."""
    from offload._live import SavedBytes

    model, forward = _anchor_case(name)

    def step(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            y = forward()
            losses = [y.pow(2).mean(), y.sum()] if backwards == 2 else [y.sum()]
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=i < len(losses) - 1)
        return [p.grad.clone() for p in model.parameters()]

    trace = offload.profile(lambda: step(None), model)
    anchors = lifecycle.predict_anchors(trace, FAST)
    want = step(None)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, hardware=FAST)
    try:
        for _ in range(2):
            with SavedBytes.on(mgr) as saved:
                got = step(mgr)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert saved.peak_planned == anchors["offload_all"].peak_bytes
    finally:
        mgr.close()


def test_the_window_does_not_take_back_a_family_backward_just_used() -> None:
    """Min-memory mode, two backwards of one graph: the first unpack of the first backward
    (the last packed family, the loss's input) reloads its family and drops it once unpacked;
    the look-ahead walk that followed still pointed at that family, found its buffer alive
    (autograd was using it) and took it back as prefetched: 262,144 B held to the second
    backward, and counted against the window all through the first. Now none is held between
    the two backwards."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())], nn.Linear(256, 256)
    )
    x = torch.randn(256, 256)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, hardware=FAST)
    try:
        for _ in range(2):
            with SavedBytes.on(mgr) as saved:
                with mgr:
                    y = model(x)
                    first, second = y.pow(2).mean(), y.sum()
                first.backward(retain_graph=True)
                between = saved.live_planned
                second.backward()
            assert between == 0
    finally:
        mgr.close()


class _SavedOutsideManager:
    """Saved-tensor bytes of a step run without the manager, counted as SavedBytes counts a
    manager's: each storage autograd saves (parameters' and buffers' excepted), from its pack
    until it is freed, and each one a ``torch.utils.checkpoint`` recomputation leaves saved
    (those :meth:`checkpoint` wraps), from the recomputation's end until freed."""

    def __init__(self, model: nn.Module) -> None:
        from offload._live import SavedBytes

        self.saved = SavedBytes()
        self._params = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata not in self._params:
            self.saved.watch(storage)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t.untyped_storage())
        return t

    @contextlib.contextmanager
    def counting(self) -> Any:
        # Early stop off: the recomputation runs to the block's end and returns, so what it left
        # alive is known at its end (early stop changes when it stops, not what it saves).
        with (
            torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t),
            torch.utils.checkpoint.set_checkpoint_early_stop(False),
        ):
            yield self.saved

    def checkpoint(self, model: nn.Module, names: list[str]) -> None:
        """Run each of the modules ``names`` under non-reentrant ``torch.utils.checkpoint``."""
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self

        class Outputs(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.storages: list[weakref.ref] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.storages.append(weakref.ref(t.untyped_storage()))
                return out

        def recorded(forward: Any) -> Any:
            def run(*args: Any) -> Any:
                if torch._C._current_graph_task_id() == -1:  # the forward
                    return forward(*args)
                with Outputs() as made:  # the recomputation: what outlives it is saved
                    out = forward(*args)
                returned = {t.untyped_storage()._cdata for t in tree_flatten(out)[0]}
                for ref in made.storages:
                    st = ref()
                    if st is not None and st._cdata not in returned:
                        meter._count(st)
                return out

            return run

        modules = dict(model.named_modules())
        for name in names:
            run = recorded(modules[name].forward)
            modules[name].forward = functools.partial(
                torch.utils.checkpoint.checkpoint, run, use_reentrant=False
            )


def _alternative_case(name: str) -> tuple[nn.Module, Any, list[str]]:
    """A model (the same weights at every call), its loss (nothing the caller holds is saved,
    so a kept tensor is freed at its last use, as predicted), and the modules a user would
    checkpoint as "every block": a transformer's layers, the blocks of a stack."""
    import models

    torch.manual_seed(0)
    if name == "linear_gelu":  # no module calls modules: nothing to checkpoint
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
        x, blocks = torch.randn(256, 256), []
    elif name == "nested":
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(4)]
        )
        x, blocks = torch.randn(256, 256), ["0", "1", "2", "3"]
    elif name == "gpt_block":
        case = ALL_MODELS[name]()
        model, x, blocks = case.model, case.batch(0)[0], ["attn", "mlp"]
    else:  # the blocks sit in one Sequential: a lone wrapper, not the block
        case = models.block_stack(seed=0, n_layer=4)
        model, x, blocks = case.model, case.batch(0)[0], [f"blocks.{i}" for i in range(4)]
    return model, lambda: model(x).pow(2).mean(), blocks


@pytest.mark.parametrize("name", ["linear_gelu", "nested", "gpt_block", "block_stack"])
def test_anchors_predict_what_running_each_alternative_holds(name: str) -> None:
    """The three anchors, as lifecycle.predict_anchors and lifecycle.plan (the CLI's summary)
    give them, predict the saved bytes that running each alternative holds, measured:
    keep_all a plain step, offload_all the manager in min-memory mode, checkpoint_blocks the
    modules a user checkpoints as "every block" under non-reentrant torch.utils.checkpoint
    (each block's input kept by it, the rest recomputed at the block's backward). The plan's
    offload_all was a planned move-everything, not min-memory mode (4 x (Linear(256)+GELU):
    262,144 B against 1,048,576 measured; the GPT block 131,072 against 462,848; block_stack
    131,072 against 594,944), and predict_anchors took the Sequential holding block_stack's
    blocks as its one block (2,113,536 B of keep_all's 2,146,304: checkpointing the wrapper
    frees almost nothing; the 4 blocks measured 626,688, as the planner's blocks predicted).
    Gradients bitwise in each run."""
    from offload._live import SavedBytes

    model, loss_fn, blocks = _alternative_case(name)

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss_fn().backward()
        return [p.grad.clone() for p in model.parameters()]

    trace = offload.profile(step, model)
    simulated = lifecycle.predict_anchors(trace, FAST)
    planned = lifecycle.plan(trace, 10**15, FAST, min_offload_bytes=0, margin=0).anchors
    chosen = lifecycle.checkpoint_blocks(trace)
    want = step()

    plain = _SavedOutsideManager(model)
    with plain.counting() as keep_all:
        assert all(torch.equal(g, w) for g, w in zip(step(), want, strict=True))

    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, hardware=FAST)
    try:
        for _ in range(2):  # the profiling step, then one of min-memory mode's own
            with SavedBytes.on(mgr) as offload_all:
                model.zero_grad(set_to_none=True)
                with mgr:
                    loss = loss_fn()
                loss.backward()
            assert all(
                torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True)
            )
    finally:
        mgr.close()

    model, loss_fn, _ = _alternative_case(name)  # the same weights, unwrapped
    ckpt = _SavedOutsideManager(model)
    ckpt.checkpoint(model, blocks)
    with ckpt.counting() as checkpointed:
        assert all(torch.equal(g, w) for g, w in zip(step(), want, strict=True))

    measured = {
        "keep_all": keep_all.peak,
        "offload_all": offload_all.peak_planned,
        "checkpoint_blocks": checkpointed.peak,
    }
    assert {k: s.peak_bytes for k, s in simulated.items()} == measured
    assert {k: p.peak_bytes for k, p in planned.items()} == measured
    assert sorted({d.recompute_module for d in chosen.values()} - {""}) == blocks
    # The plan's anchors are the simulator's, step times included.
    assert planned == {
        k: lifecycle.Prediction(peak_bytes=s.peak_bytes, step_s=s.step_s)
        for k, s in simulated.items()
    }


class _AheadProbe(torch.autograd.Function):
    """Passes gradients through; its backward notes the executor's reloaded-but-unused bytes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mgr: offload.ActivationOffloader, seen: list) -> Any:
        ctx.mgr, ctx.seen = mgr, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.seen.append(ctx.mgr._executor._ahead_bytes)
        return grad, None, None


def test_a_second_backward_gets_the_look_ahead_window_too() -> None:
    """Min-memory mode, two backwards of one graph: the look-ahead walk's pointer only moved
    down, and it reached the first packed family in the first backward, so the second one
    reloaded each family only when its module's backward (or an unpack) asked for it: 8 x
    (Linear(128) + Tanh) at 64 rows with a 4-family window had 131,072 B reloaded ahead of
    need midway through the first backward and 0 in the second. Now the same in both."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(128, 128), nn.Tanh())]
    model = nn.Sequential(*layers)
    x = torch.randn(64, 128)
    mgr = offload.ActivationOffloader(
        model, min_offload_bytes=0, max_inflight_bytes=4 * 64 * 128 * 4, hardware=FAST
    )
    seen: list[int] = []

    def step(manager: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with manager if manager is not None else contextlib.nullcontext():
            h = model[:8](x)
            if manager is not None:  # midway: backward has unpacked before it
                h = _AheadProbe.apply(h, manager, seen)
            y = model[8:](h)
            first, second = y.pow(2).mean(), y.sum()
        first.backward(retain_graph=True)
        second.backward()
        return [p.grad.clone() for p in model.parameters()]

    try:
        want = step(None)
        for _ in range(2):
            seen.clear()
            got = step(mgr)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert seen == [4 * 64 * 128 * 4] * 2
    finally:
        mgr.close()


def test_predict_1f1b_offload_peak_is_min_memory_modes_on_a_stage() -> None:
    """Stage 0 of a 4-stage 1F1B pipeline, 8 microbatches, each forward a min-memory step of
    its own (as benchmarks/bench_pipeline.py runs it): predict_1f1b's offloaded peak above the
    base is the saved bytes the manager holds (SavedBytes.peak_planned). It simulated the stage
    with one microbatch's saved bytes as the look-ahead window, where the executor gives each
    microbatch's step a quarter of what it stores, at least twice its largest family: 2 blocks
    on (4, 32, 64) predicted 1,291,264 B against 462,848 measured (bench_pipeline's cpu-tiny
    stage: 40.4 MiB against 14.8). Now equal: on CPU a copy out completes inside its pack, so
    the copies' timing does not move the peak."""
    import models

    from offload._live import SavedBytes

    stages, microbatches = 4, 8
    case = models.block_stack(seed=0, n_layer=2)
    stage = case.model
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 32, 64, generator=g) for _ in range(microbatches)]
    grads = [torch.randn(4, 32, 64, generator=g) for _ in range(microbatches)]

    def schedule(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        stage.zero_grad(set_to_none=True)
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        inputs: dict[int, torch.Tensor | None] = {}
        for kind, i in lifecycle.schedule_1f1b(stages, microbatches)[0]:
            if kind == "F":
                x = xs[i].clone().requires_grad_()
                with mgr if mgr is not None else contextlib.nullcontext():
                    held[i] = (x, stage(x))
            else:
                x, out = held.pop(i)
                out.backward(grads[i])
                inputs[i] = x.grad
        return [p.grad.clone() for p in stage.parameters()] + [inputs[i] for i in sorted(inputs)]

    def one() -> None:
        x = xs[0].clone().requires_grad_()
        stage(x).backward(grads[0])

    trace = offload.profile(one, stage)
    predicted = lifecycle.predict_1f1b(trace, FAST, stages=stages, microbatches=microbatches)[0]
    want = schedule(None)
    mgr = offload.ActivationOffloader(stage, min_offload_bytes=0, hardware=FAST)
    try:
        for _ in range(2):
            with SavedBytes.on(mgr) as saved:
                got = schedule(mgr)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            assert saved.peak_planned == predicted.offload.peak_bytes - predicted.offload.base_bytes
    finally:
        mgr.close()


class _TanhChain(nn.Module):
    """One module without children: 8 x (matmul, tanh) on 2 MiB activations, so its own ops
    save 9 families of 2 MiB (the input, then each tanh output, which the next matmul saves
    too)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024, 1024) / 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = torch.tanh(x @ self.w)
        return x


@pytest.mark.parametrize("backwards", [1, 2])
def test_a_modules_own_saved_tensors_come_back_under_the_window(backwards: int) -> None:
    """Min-memory mode with max_inflight_bytes="4MiB" (the look-ahead window), one module
    whose own ops save 9 x 2 MiB: its backward trigger brought every one of them back when
    its backward began, ignoring the window: 18 MiB of saved bytes held at once, as many as
    keeping everything. Now they come back last packed first as unpacks make room: the
    window plus the family in use (6 MiB), as lifecycle's offload_all anchor predicts for
    that window; gradients bitwise, no stall. With two backwards of one graph the trigger
    fires again in the second: measured 8 MiB, which the simulator predicted as 18 MiB until
    it also put a later pass's trigger under the window."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    model, x = _TanhChain(), torch.randn(512, 1024)
    family, window = 2 << 20, 4 << 20

    def step(mgr: offload.ActivationOffloader | None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            y = model(x)
            losses = [y.pow(2).mean(), y.sum()] if backwards == 2 else [y.sum()]
        for i, loss in enumerate(losses):
            loss.backward(retain_graph=i < len(losses) - 1)
        return model.w.grad.clone()

    trace = offload.profile(lambda: step(None), model)
    predicted = lifecycle.predict_anchors(
        trace, FAST, max_inflight_bytes=window, prefetch_bytes=window
    )["offload_all"]
    want = step(None)
    mgr = offload.ActivationOffloader(model, max_inflight_bytes="4MiB", hardware=FAST)
    try:
        for _ in range(2):
            with SavedBytes.on(mgr) as saved:
                got = step(mgr)
            assert torch.equal(got, want)
            assert mgr.stats.last.records_offloaded_cpu == 9
            if backwards == 1:
                assert mgr.stats.last.stalls == 0
                assert saved.peak_planned == window + family  # 9 * family before
            assert predicted.peak_bytes == saved.peak_planned
    finally:
        mgr.close()


class _Product(nn.Module):
    """``x + mix(x^T)^T * x``: the multiply saves two activations of one size, and its backward
    holds both at once, however each came back (the fuzzer's 'transpose' block)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mix, self.head = nn.Linear(8, 32), nn.Linear(16, 16), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.mix(h.transpose(-2, -1)).transpose(-2, -1) * h)


def test_a_node_holds_all_it_unpacked_within_the_predicted_peak() -> None:
    """What one backward node unpacks stays together until the node returns (NOTE [ Unpacks of
    one node ]): the simulator and the planner freed the multiply's first factor at the second
    factor's unpack. At the smallest feasible budget (4,311 B) the plan predicted 4,096 B and
    the step held 8,192 B, the two 4,096 B factors; in min-memory mode the offload_all anchor
    predicted 12,288 B against 13,312 held. Now the smallest feasible budget is 8,623 B, the
    plan predicts the 8,192 B held, and the anchor the 13,312."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = _Product()
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))

    def step(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = step(None)
    trace = offload.profile(lambda: step(None), model, warmup_steps=0)
    factor = 2 * 16 * 32 * 4
    anchor = lifecycle.predict_anchors(trace, FAST)["offload_all"].peak_bytes
    with pytest.raises(lifecycle.BudgetInfeasibleError) as info:
        lifecycle.plan(trace, gpu_budget=1, hardware=FAST, min_offload_bytes=0)
    budget = info.value.min_feasible_bytes
    assert min(budget, anchor) >= 2 * factor
    for kw in ({}, {"gpu_budget": budget}):
        mgr = offload.ActivationOffloader(model, min_offload_bytes=0, hardware=FAST, **kw)
        try:
            for _ in range(3):  # profiles, then plans (budget mode) / runs in min-memory mode
                with SavedBytes.on(mgr) as saved:
                    got = step(mgr)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            last = mgr.stats.last
        finally:
            mgr.close()
        assert saved.peak_planned >= 2 * factor  # both factors, together
        if kw:
            assert last.unplanned_records == 0 and last.predicted_peak_bytes > 0
            assert saved.peak_planned <= last.predicted_peak_bytes <= budget
        else:
            assert saved.peak_planned == anchor
