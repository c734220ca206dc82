"""Planned rebuilds (``Placement.REBUILD``): a GELU / SiLU / LayerNorm output saved by the next
Linear is not stored but run again at unpack from its input, which the plan kept or moved (NOTE
[ Activation recipes ] in offload/_recipe.py, NOTE [ Budget mode ] in offload/_planned.py).
Gradients are bitwise equal to a run without offloading (CPU tensors as the device, real files
for NVMe)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload._live import SavedBytes
from offload._planned import REBUILD, ActivePlan, retimed
from offload.lifecycle import HardwareModel, Placement, Plan, TensorRecord, Trace, Trigger, simulate

FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)
STEPS = 3
Grads = dict[str, torch.Tensor]


def _mlp(*acts: nn.Module, width: int = 64) -> nn.Module:
    """``Linear -> act -> Linear`` per activation, each activation's output saved by the next
    Linear (and its input by the activation)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for act in acts:
        layers += [nn.Linear(width, 2 * width), act, nn.Linear(2 * width, width)]
    return nn.Sequential(*layers)


def _act_mlp(norm: type[nn.Module] = nn.LayerNorm) -> nn.Module:
    # A norm with its own eps: its output is rebuilt with it (the node does not save it).
    return _mlp(nn.GELU(), nn.SiLU(), nn.GELU(approximate="tanh"), norm(128, eps=1e-3))


REBUILDS = 4  # _act_mlp's rebuildable outputs (and their inputs)


def _input() -> torch.Tensor:
    # 3-D: each Linear saves a 2-D view of its input (the recipe rebuilds the view).
    return torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, x: torch.Tensor, mgr: Any = None, *, twice: bool = False) -> Grads:
    model.zero_grad(set_to_none=True)
    with mgr if mgr is not None else contextlib.nullcontext():
        loss = model(x).pow(2).sum()
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()  # the graph's saved tensors are unpacked (rebuilt) a second time
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(got: Grads, want: Grads) -> None:
    assert got.keys() == want.keys() and want
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _profile(model: nn.Module, x: torch.Tensor) -> Trace:
    """The profiling step of a budget-mode manager, as its trace (links included)."""
    mgr = offload.ActivationOffloader(model, gpu_budget="1GiB", hardware=FAST, min_offload_bytes=0)
    try:
        _step(model, x, mgr)
        assert mgr._budget._profiler is not None
        return mgr._budget._profiler.trace()
    finally:
        mgr.close()
        model.zero_grad(set_to_none=True)


def _links(trace: Trace, step: int = 0) -> dict[int, tuple[TensorRecord, TensorRecord]]:
    """``{family of a rebuildable record: (that record, the record it is rebuilt from)}``."""
    by_seq = {r.seq: r for r in trace.records}
    return {
        r.family: (r, by_seq[r.rebuild_from])
        for r in trace.records
        if r.step == step and r.rebuild_from >= 0
    }


def _forced(trace: Trace, *, child: Placement, parent: Placement) -> Plan:
    """The planner's plan of ``trace`` with every family kept, except the rebuildable ones (at
    ``child``) and their inputs (at ``parent``; moved ones reload at their child's unpack)."""
    plan = offload.plan(trace, 4 * trace.peak_saved_bytes, FAST, min_offload_bytes=0, margin=0)
    links = _links(trace)
    assert links, "the trace links no activation output to its input"
    parents = {p.family: c for c, p in links.values()}
    entries = []
    for e in plan.entries:
        placement, reload, event = Placement.KEEP, None, -1
        if e.family in links:
            placement = child
        elif e.family in parents:
            placement = parent
            if parent.moves:
                c = parents[e.family]
                reload = Trigger(kind="unpack", module=c.module, call_index=c.call_index,
                                 ordinal=c.ordinal)  # fmt: skip
                event = c.unpack_events[0]
        entries.append(dataclasses.replace(e, placement=placement, reload=reload,
                                           reload_event=event))  # fmt: skip
    return dataclasses.replace(plan, entries=tuple(entries))


def _bytes(plan: Plan, placement: Placement) -> int:
    return plan.bytes_by_placement()[placement.value]


def _kept_alive(mgr: offload.ActivationOffloader) -> int:
    gc.collect()
    return sum(1 for ref in mgr._step.kept_refs.values() if ref() is not None)


def test_active_plan_rebuilds_its_keys_without_a_reload_trigger() -> None:
    model, x = _act_mlp(), _input()
    plan = _forced(_profile(model, x), child=Placement.REBUILD, parent=Placement.CPU)
    active = ActivePlan(plan)
    assert active.rebuilds
    rebuilt = [e for e in plan.entries if e.placement is Placement.REBUILD]
    assert len(rebuilt) == REBUILDS
    for e in rebuilt:
        assert all(active.action[k] == REBUILD for k in e.keys)
        assert all(active.limit[k] == e.nbytes for k in e.keys)
        assert e.keys[0] not in active.trigger
    moved = [e for e in plan.entries if e.placement is Placement.CPU]
    assert len(moved) == REBUILDS and all(active.action[e.keys[0]] == "cpu" for e in moved)
    assert not ActivePlan(dataclasses.replace(plan, entries=tuple(moved))).rebuilds


@pytest.mark.parametrize(
    "parent",
    ["keep", "cpu", "nvme", "cpu-deferred", "cpu-retain_graph", "keep-rms_norm", "cpu-rms_norm"],
    ids=lambda s: s,
)
def test_rebuilt_outputs_are_bitwise_with_their_input_kept_or_moved(
    parent: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """Each output is rebuilt from its input at unpack: kept by the plan (the recipe holds the
    kept tensor) or moved (one reload serves the rebuild and the activation's own backward,
    started by the plan's trigger at the rebuilt record's unpack: no stall). Nothing leaks.
    (``rms_norm``: an ``nn.RMSNorm`` in place of the LayerNorm, run as on CUDA.)"""
    from offload.storage import CopyEngine

    norm: type[nn.Module] = nn.LayerNorm
    if parent.endswith("rms_norm"):
        request.getfixturevalue("fused_rms_norm")
        norm = nn.RMSNorm
    model, x = _act_mlp(norm), _input()
    twice = parent.endswith("retain_graph")
    want = _step(model, x, twice=twice)
    trace = _profile(model, x)
    where = {"keep": Placement.KEEP, "nvme": Placement.NVME}.get(
        parent.split("-")[0], Placement.CPU
    )
    plan = _forced(trace, child=Placement.REBUILD, parent=where)
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if where is Placement.NVME:
        kw.update(tiers=("nvme",), nvme_dir=tmp_path)
    engine = CopyEngine(deferred=True, max_delay_s=0.002, seed=3) if "deferred" in parent else None
    mgr = offload.ActivationOffloader(model, plan=plan, _copy_engine=engine, **kw)
    rebuilt = _bytes(plan, Placement.REBUILD)
    assert rebuilt == sum(c.storage_nbytes for c, _ in _links(trace).values()) > 0
    try:
        for _ in range(STEPS):
            _assert_bitwise(_step(model, x, mgr, twice=twice), want)
            last = mgr.stats.last
            assert (last.records_rebuilt, last.bytes_rebuilt) == (REBUILDS, rebuilt)
            assert last.unplanned_records == 0 and last.fallbacks == 0
            moved = last.bytes_offloaded_cpu + last.bytes_offloaded_nvme
            if where is Placement.KEEP:
                assert moved == 0 and last.reloads == 0
            else:
                assert moved == _bytes(plan, where) > 0
                assert getattr(last, f"bytes_offloaded_{where.value}") == moved
                # One reload per input and backward, serving both of its unpacks (none where
                # the copy out had not completed, a file write or a deferred copy: the source
                # serves them).
                reloads = REBUILDS * (2 if twice else 1)
                if engine is None and where is Placement.CPU:
                    assert last.reloads == reloads
                assert last.reloads <= reloads
                assert last.stalls == 0, last
            assert mgr._executor is not None and mgr._executor.live_families() == 0
            assert mgr._executor.cpu_bytes == 0
            assert _kept_alive(mgr) == 0  # no kept input outlives the graph
    finally:
        mgr.close()
        if engine is not None:
            engine.close()


def test_a_rebuilt_output_holds_no_bytes_until_its_unpack() -> None:
    """Counted as budget mode counts (SavedBytes: what the step holds on the device, rebuilt
    outputs from their rebuild on), the step that rebuilds the outputs peaks lower than the one
    keeping them, exactly where the simulator replays that plan."""
    model, x = _act_mlp(), _input()
    want = _step(model, x)
    trace = _profile(model, x)
    peaks = {}
    for child in (Placement.KEEP, Placement.REBUILD):
        plan = _forced(trace, child=child, parent=Placement.KEEP)
        mgr = offload.ActivationOffloader(model, plan=plan, min_offload_bytes=0)
        try:
            _assert_bitwise(_step(model, x, mgr), want)
            with SavedBytes.on(mgr) as saved:
                _assert_bitwise(_step(model, x, mgr), want)
            rebuilds = REBUILDS if child is Placement.REBUILD else 0
            assert mgr.stats.last.records_rebuilt == rebuilds
            assert mgr.stats.last.unplanned_records == 0
        finally:
            mgr.close()
        peaks[child] = saved.peak
    assert peaks[Placement.KEEP] == trace.peak_saved_bytes
    # Rebuilt at its unpack, an output is held again until its Linear's backward is done.
    assert peaks[Placement.REBUILD] < peaks[Placement.KEEP]
    plan = _forced(trace, child=Placement.REBUILD, parent=Placement.KEEP)
    hw = HardwareModel.cpu_only(
        copy_bytes_per_s=1e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    sim = simulate(trace, hw, plan.decisions())
    assert peaks[Placement.REBUILD] == sim.peak_bytes, (peaks, sim.peak_bytes)


class _ForeignGelu(nn.Module):
    """A GELU run under someone else's saved-tensor hooks: its input's pack is not ours, and
    returns other bytes of the same shape and dtype (the negated input; unpack negates back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().neg(), torch.neg):
            return nn.functional.gelu(x)


def _with_rebuild_at(plan: Plan, keys: set[tuple[str, int, int]]) -> Plan:
    entries = tuple(
        dataclasses.replace(e, placement=Placement.REBUILD, reload=None, reload_event=-1)
        if e.keys[0] in keys
        else e
        for e in plan.entries
    )
    return dataclasses.replace(plan, entries=entries)


class _Strided(nn.Module):
    """GELU of every other column: its input is not dense, its output is (other strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(h[..., ::2])


def _failing_case(
    why: str,
) -> tuple[nn.Module, set[tuple[str, int, int]], set[tuple[str, int, int]]]:
    """``(model, keys the plan rebuilds whose recipe fails, keys the plan moves besides)``."""
    if why == "not_an_activation":
        return _mlp(nn.SiLU(), nn.GELU()), {("0", 0, 0)}, set()  # the first Linear's input: x
    if why == "input_not_ours":
        # The Linear after the foreign GELU saves its output.
        return _mlp(nn.SiLU(), _ForeignGelu()), {("5", 0, 0)}, set()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), _Strided(), nn.Linear(64, 64), nn.SiLU(),
                          nn.Linear(64, 64))  # fmt: skip
    moved = {("1.act", 0, 0)} if why == "strided_input_moved" else set()
    return model, {("2", 0, 0)}, moved


@pytest.mark.parametrize(
    "why",
    ["not_an_activation", "input_not_ours", "strided_input_kept", "strided_input_moved"],
    ids=lambda s: s,
)
def test_a_failed_recipe_is_stored_as_an_unplanned_record(why: str) -> None:
    """A key the plan rebuilds whose recipe cannot be built (a Linear's input that is no
    activation output; an output whose input another pair of hooks packed; an output whose
    input, kept or moved, is laid out otherwise) goes to the first tier with room, counted as
    unplanned; the other rebuilds go on and gradients stay bitwise."""
    model, failing, moved = _failing_case(why)
    x = _input()
    want = _step(model, x)
    trace = _profile(model, x)
    assert all(c.key not in failing for c, _ in _links(trace).values())  # no link recorded
    plan = _with_rebuild_at(_forced(trace, child=Placement.REBUILD, parent=Placement.KEEP), failing)
    entries = tuple(
        dataclasses.replace(e, placement=Placement.CPU) if e.keys[0] in moved else e
        for e in plan.entries
    )
    plan = dataclasses.replace(plan, entries=entries)
    failed = sum(e.nbytes for e in plan.entries if e.keys[0] in failing)
    mgr = offload.ActivationOffloader(model, plan=plan, min_offload_bytes=0)
    try:
        for _ in range(2):
            _assert_bitwise(_step(model, x, mgr), want)
            last = mgr.stats.last
            assert last.unplanned_records == 1
            # Stored: the failed record, and the moved input (its whole storage: a strided view
            # spans a few bytes less).
            assert last.records_offloaded_cpu == 1 + len(moved)
            assert last.bytes_offloaded_cpu >= failed + _bytes(plan, Placement.CPU) > 0
            # The other (linked) outputs are still rebuilt.
            assert last.records_rebuilt == len(_links(trace)) > 0
            assert mgr._executor is not None and mgr._executor.live_families() == 0
            assert _kept_alive(mgr) == 0
    finally:
        mgr.close()


class _HoldsInput(nn.Module):
    """A GELU that keeps a reference to its input (for the test to change it in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.input: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.input = h
        return nn.functional.gelu(h)


def test_a_kept_input_changed_in_place_raises_instead_of_rebuilding_another_output() -> None:
    """Without offload autograd refuses such a backward too; a rebuild from the changed input
    would be another output, so unpack raises instead."""
    act = _HoldsInput()
    model, x = _mlp(act), _input()
    trace = _profile(model, x)
    plan = _forced(trace, child=Placement.REBUILD, parent=Placement.KEEP)
    mgr = offload.ActivationOffloader(model, plan=plan, min_offload_bytes=0)
    try:
        with mgr:
            loss = model(x).pow(2).sum()
        assert mgr.stats.last.records_rebuilt == 1
        held = act.input
        assert held is not None
        with torch.no_grad():
            held.add_(1.0)
        with pytest.raises(offload.OffloadError, match="changed in place"):
            loss.backward()
    finally:
        act.input = None
        mgr.close()


class _ClampedAfter(nn.Module):
    """A GELU or SiLU whose output is then changed in place under no_grad (its node stays the
    activation's, its version moves) before the next Linear saves it."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.act(h)
        with torch.no_grad():
            out.clamp_(max=0.1)
        return out


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_an_activation_output_changed_under_no_grad_is_stored_not_rebuilt(
    act: str, tier: str, tmp_path
) -> None:
    """Its input's function is no longer what it holds: rebuilt, it came back unclamped (and
    the gradients off by up to 2.0). Min-memory mode stores it instead, and the recorder links
    it to nothing, so no plan rebuilds it either."""
    fn = nn.GELU() if act == "gelu" else nn.SiLU()
    model, x = _mlp(_ClampedAfter(fn)), _input()
    want = _step(model, x)
    trace = _profile(model, x)
    assert [r.rebuild_from for r in trace.records if r.rebuild_from >= 0] == []
    disk = {"nvme_dir": tmp_path} if tier == "nvme" else {}  # ignored, with a warning, on cpu
    mgr = offload.ActivationOffloader(model, tiers=(tier,), min_offload_bytes=0, **disk)
    try:
        got = _step(model, x, mgr)
        assert mgr.stats.last.records_rebuilt == 0
        assert getattr(mgr.stats.last, f"records_offloaded_{tier}") > 0  # stored instead
    finally:
        mgr.close()
    _assert_bitwise(got, want)


class _Offset(nn.Module):
    """GELU of a contiguous slice at a storage offset: the recipe may run it, but no link is
    recorded for it (as lifecycle.Recorder, which links whole inputs only)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(h[1:])


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "layer_norm", "rms_norm"])
def test_the_profiling_step_of_budget_mode_records_rebuild_links(
    act: str, request: pytest.FixtureRequest
) -> None:
    """The manager's profiling step rebuilds activation outputs from their stored inputs, as
    min-memory mode does, and links each to its input's record, as the observe-only recorder
    does; an activation of a slice (``_Offset``: its input is no whole storage) has its output
    stored and unlinked. (``rms_norm``: through ``_fused_rms_norm``, as on CUDA: the
    ``fused_rms_norm`` fixture.)"""
    if act == "rms_norm":
        request.getfixturevalue("fused_rms_norm")
    makers: dict[str, Callable[[int], nn.Module]] = {
        "gelu": lambda width: nn.GELU(),
        "gelu_tanh": lambda width: nn.GELU(approximate="tanh"),
        "silu": lambda width: nn.SiLU(),
        "layer_norm": nn.LayerNorm,
        "rms_norm": nn.RMSNorm,
    }
    make = makers[act]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), make(128), nn.Linear(128, 128), _Offset(), nn.Linear(128, 64),
        make(64), nn.Linear(64, 8),
    )  # fmt: skip
    x = torch.randn(2, 8, 64)  # 3-D: the Linears save 2-D views of the outputs
    want = _step(model, x)
    observed = offload.profile(lambda: _step(model, x), model, warmup_steps=0)
    mgr = offload.ActivationOffloader(model, gpu_budget="1GiB", hardware=FAST, min_offload_bytes=0)
    try:
        _assert_bitwise(_step(model, x, mgr), want)
        first = mgr.stats.last
        assert first.predicted_peak_bytes == 0 and first.records_rebuilt == 2  # profiled
        assert mgr._budget._profiler is not None
        trace = mgr._budget._profiler.trace()
    finally:
        mgr.close()

    def links(t: Trace) -> dict[tuple[str, int, int], tuple[str, int, int]]:
        by_seq = {r.seq: r for r in t.records}
        return {c.key: by_seq[c.rebuild_from].key for c in t.records if c.rebuild_from >= 0}

    # The first and the last activation's outputs, from the activations' own packs of their
    # inputs (LayerNorm's node packs its weight first).
    i = 1 if act == "layer_norm" else 0
    assert links(trace) == {("2", 0, 0): ("1", 0, i), ("6", 0, 0): ("5", 0, i)}
    assert links(observed) == links(trace)
    for r in trace.records:
        if r.rebuild_from >= 0:
            parent = trace.records[r.rebuild_from]
            assert parent.seq == r.rebuild_from and parent.step == r.step
            # The output, saved as a 2-D view: as many bytes as its input, of its dtype.
            assert (parent.dtype, parent.nbytes) == (r.dtype, r.nbytes)
    # Stored: every saved activation's family but the linked outputs, parameters aside.
    sizes = {r.family: r.storage_nbytes for r in trace.records if not r.is_parameter}
    rebuilt = {r.family for r in trace.records if r.rebuild_from >= 0}
    assert first.bytes_rebuilt == sum(sizes[f] for f in rebuilt)
    assert first.bytes_offloaded_cpu == sum(sizes.values()) - first.bytes_rebuilt


def _rebuilding(mgr: offload.ActivationOffloader) -> Callable[..., Plan]:
    """``mgr._budget._make_plan`` with every family its trace links rebuilt (until the planner
    chooses REBUILD itself)."""
    make = mgr._budget._make_plan

    def make_plan(trace: Trace, step: int, signature: str) -> Plan:
        plan = make(trace, step, signature)
        families = set(_links(trace, step))
        keys = {e.keys[0] for e in plan.entries if e.family in families}
        return _with_rebuild_at(plan, keys)

    return make_plan


def test_a_plan_that_rebuilds_is_refined_from_its_recorded_first_step() -> None:
    """NOTE [ Refinement ]: the first planned step records its rebuilt records too (pack,
    unpack, link), retimed() maps it onto the profile with the links unchanged, and the refined
    plan rebuilds and runs bitwise with no unplanned record."""
    model, x = _act_mlp(), _input()
    want = _step(model, x)
    trace = _profile(model, x)
    budget = trace.peak_saved_bytes // 2
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    mgr._budget._make_plan = _rebuilding(mgr)  # type: ignore[method-assign]
    try:
        _assert_bitwise(_step(model, x, mgr), want)  # profiled
        first = mgr.plan
        assert first is not None and _bytes(first, Placement.REBUILD) > 0
        _assert_bitwise(_step(model, x, mgr), want)  # runs the first plan, recorded
        assert mgr.stats.last.records_rebuilt == REBUILDS
        assert mgr._budget._profiler is not None
        recorded = mgr._budget._profiler.trace()
        refined = mgr.plan
        for _ in range(2):
            _assert_bitwise(_step(model, x, mgr), want)  # runs the refined plan
            last = mgr.stats.last
            assert last.records_rebuilt == REBUILDS and last.unplanned_records == 0
            assert refined is not None and last.predicted_step_s == refined.predicted_step_s
            assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()
    assert refined is not None and refined is not first and refined.metadata["refined"]
    assert _bytes(refined, Placement.REBUILD) == _bytes(first, Placement.REBUILD)
    # The recorded planned step: its rebuilt records, packed and unpacked once each, linked to
    # their inputs' records of the same step, as in the profile.
    profiled, timed = _links(recorded, 0), _links(recorded, 1)
    assert len(profiled) == len(timed) == REBUILDS
    pairs = sorted((c.key, p.key) for c, p in timed.values())
    assert pairs == sorted((c.key, p.key) for c, p in profiled.values())
    for c, p in timed.values():
        assert p.step == c.step == 1 and len(c.unpack_events) == 1
        assert c.pack_time_s <= c.unpack_times_s[0]
    out = retimed(recorded, 0, 1)
    assert [r.rebuild_from for r in out.records] == [r.rebuild_from for r in recorded.records]
    times = {e.index: e.time_s for e in out.events}
    for c, _ in _links(out, 0).values():
        assert c.pack_time_s == times[c.pack_event]
        assert c.unpack_times_s == tuple(times[i] for i in c.unpack_events)

    # On a device clock the rebuild kernels are inside the timed step: rebuild_s cuts that long
    # after each rebuilt unpack, as the plan adds the rebuilds itself.
    def span(t: Trace) -> float:
        own = [e.time_s for e in t.events if e.step == 0]
        return max(own) - min(own)

    took = 1e-6
    shorter = retimed(recorded, 0, 1, {c.key: took for c, _ in timed.values()})
    assert span(out) - span(shorter) == pytest.approx(REBUILDS * took, abs=1e-12)


def test_the_planner_s_rebuilds_are_carried_out_within_its_predicted_peak() -> None:
    """Budget mode end to end: over a link this slow the planner rebuilds the outputs (from the
    links the profiling step recorded); the manager rebuilds exactly those, bitwise, with no
    stall or unplanned record, and holds no more than the plan predicted."""
    slow = HardwareModel.cpu_only(
        copy_bytes_per_s=1e6, disk_write_bytes_per_s=1e6, disk_read_bytes_per_s=1e6
    )
    model, x = _act_mlp(), _input()
    want = _step(model, x)
    budget = _profile(model, x).peak_saved_bytes // 2
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=slow, min_offload_bytes=0)
    try:
        for _ in range(STEPS):  # profiled, planned (recorded), refined
            _assert_bitwise(_step(model, x, mgr), want)
        with SavedBytes.on(mgr) as saved:
            _assert_bitwise(_step(model, x, mgr), want)
        plan, last = mgr.plan, mgr.stats.last
        assert plan is not None and plan.metadata.get("refined")
        rebuilt = [e for e in plan.entries if e.placement is Placement.REBUILD]
        assert rebuilt, plan.summary()
        assert last.records_rebuilt == sum(len(e.keys) for e in rebuilt)
        assert last.bytes_rebuilt == _bytes(plan, Placement.REBUILD)
        assert last.unplanned_records == 0 and last.stalls == 0
        assert 0 < saved.peak_planned <= plan.predicted_peak_bytes <= budget
        assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()
