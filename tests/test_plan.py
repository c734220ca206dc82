"""The planner: every plan checked against the simulator and against facts read off the trace.

Oracles, not snapshots: a plan's peak is replayed by :func:`lifecycle.simulate` and must fit the
target; budgets are swept from the smallest feasible one to the keep-all peak and the predicted
step may never grow with the budget; reload triggers, recomputed calls and expected keys are
checked event by event against the trace they were planned from.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re

import numpy as np
import pytest
import torch
from models import ALL_MODELS, Block

import offload
from offload import lifecycle
from offload.lifecycle import (
    BudgetInfeasibleError,
    EventKind,
    HardwareModel,
    Placement,
    Plan,
    Trace,
    plan,
    simulate,
    transformer_trace,
)
from offload.lifecycle._units import format_bytes

CPU, NVME, KEEP, RECOMPUTE = Placement.CPU, Placement.NVME, Placement.KEEP, Placement.RECOMPUTE
REBUILD = Placement.REBUILD


def _hw(rate: float, *, disk: float = 2e9, duplex: float | None = None) -> HardwareModel:
    return HardwareModel(
        h2d_bytes_per_s=rate,
        d2h_bytes_per_s=rate,
        duplex_bytes_per_s=2 * rate if duplex is None else duplex,
        disk_write_bytes_per_s=disk,
        disk_read_bytes_per_s=disk,
    )


H200 = HardwareModel.h200()
SLOW = _hw(5e9, duplex=8e9)  # a link that hides little at these sizes, duplex shared
CPU_ONLY = HardwareModel.cpu_only(
    copy_bytes_per_s=10e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9
)
IDEAL = _hw(math.inf, disk=math.inf)
FAST_DISK = _hw(55e9, disk=40e9, duplex=85e9)  # NVMe nearly as fast as the link: spilling is cheap
GLACIAL = _hw(1e6, disk=1e6)  # 1 MB/s: no transfer hides behind compute
HARDWARE = {"h200": H200, "slow": SLOW, "cpu_only": CPU_ONLY}

# -- traces -----------------------------------------------------------------------------------


def _synthetic(layers: int, hidden: int, tokens: int = 2048, mlp: str = "gelu") -> Trace:
    return transformer_trace(
        layers=layers, hidden=hidden, tokens=tokens, mlp=mlp, base_bytes=1 << 30
    )


SYNTHETIC = {
    "gpt2x1024": lambda: _synthetic(2, 1024),
    "gpt4x4096": lambda: _synthetic(4, 4096),
    "gpt6x8192": lambda: _synthetic(6, 8192, tokens=4096),
    "llama4x4096": lambda: _synthetic(4, 4096, mlp="swiglu"),
}


def _stack_trace() -> Trace:
    """Three transformer blocks in a Sequential, profiled as the brief's users would."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64, 4) for _ in range(3)])
    x = torch.randn(4, 32, 64)
    return offload.profile(lambda: model(x).sum().backward(), model)


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    out = {name: make() for name, make in SYNTHETIC.items()}
    out["block_stack"] = _stack_trace()
    for name, factory in ALL_MODELS.items():
        case = factory(seed=0)
        out[name] = offload.profile(case.step, case.model)
    return out


TRACE_NAMES = [*SYNTHETIC, "block_stack", *ALL_MODELS]


def _plan(trace: Trace, budget: int, hw: HardwareModel, **kw) -> Plan:
    kw.setdefault("margin", 0)
    kw.setdefault("min_offload_bytes", 0)
    return plan(trace, budget, hw, **kw)


def _floor(trace: Trace, hw: HardwareModel, **kw) -> int:
    """The smallest feasible budget, as the planner reports it."""
    with pytest.raises(BudgetInfeasibleError) as info:
        _plan(trace, 0, hw, **kw)
    return info.value.min_feasible_bytes


def _ladder(trace: Trace, hw: HardwareModel, n: int, **kw) -> list[int]:
    """``n`` budgets from the smallest feasible one to just above the keep-all peak, on an
    uneven grid (so they are not the planner's own ladder of anything)."""
    lo = _floor(trace, hw, **kw)
    hi = simulate(trace, hw).peak_bytes + 1
    steps = np.linspace(0.0, 1.0, n) ** 1.5
    return sorted({int(lo + (hi - lo) * s) for s in steps})


def _activation_families(trace: Trace) -> dict[int, object]:
    """Families a plan places: not parameters, not packed while a backward ran."""
    records = trace.records
    return {
        f.family: f
        for f in trace.families()
        if not f.is_parameter and not any(records[s].in_backward for s in f.records)
    }


# -- every plan fits, as the simulator sees it --------------------------------------------------


@pytest.mark.parametrize("hw_name", list(HARDWARE))
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_plans_fit_their_target_in_simulation(
    traces: dict[str, Trace], name: str, hw_name: str
) -> None:
    trace, hw = traces[name], HARDWARE[hw_name]
    for budget in _ladder(trace, hw, 5):
        p = _plan(trace, budget, hw)
        assert p.prediction_source == "simulator"
        sim = simulate(trace, hw, p.decisions())
        assert sim.peak_bytes <= p.target_bytes == budget
        assert sim.peak_bytes == p.predicted_peak_bytes
        assert p.metadata["simulated_step_s"] == sim.step_s
        # The planner's own model never promises less memory than the simulator finds.
        assert p.metadata["model_peak_bytes"] >= sim.peak_bytes
        # Without the simulator's check the plan still fits (the model bounds the peak).
        q = _plan(trace, budget, hw, simulate_records=0)
        assert q.prediction_source == "planner model"
        assert simulate(trace, hw, q.decisions()).peak_bytes <= q.predicted_peak_bytes <= budget
        assert q.entries == p.entries and q.predicted_step_s == p.predicted_step_s


def test_frames_keep_the_peak_bound_on_a_long_step() -> None:
    # 150 layers: 9000 events, more than the model's 8192 memory frames.
    trace = _synthetic(150, 256, tokens=1024)
    assert len(trace.events) > 8192
    keep = simulate(trace, H200).peak_bytes
    floor = _floor(trace, H200)
    for share in (0.0, 0.5):
        budget = int(floor + share * (keep - floor))
        p = _plan(trace, budget, H200, simulate_records=0)
        assert simulate(trace, H200, p.decisions()).peak_bytes <= p.predicted_peak_bytes <= budget


# -- a larger budget never predicts a slower step -----------------------------------------------


@pytest.mark.parametrize("hw_name", [*HARDWARE, "glacial"])
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_larger_budget_never_predicts_a_slower_step(
    traces: dict[str, Trace], name: str, hw_name: str
) -> None:
    trace = traces[name]
    hw = GLACIAL if hw_name == "glacial" else HARDWARE[hw_name]
    budgets = _ladder(trace, hw, 16)
    steps = [_plan(trace, b, hw, simulate_records=0).predicted_step_s for b in budgets]
    for i in range(1, len(budgets)):
        assert steps[i] <= steps[i - 1], (
            f"budget {budgets[i - 1]} -> {steps[i - 1]} s, larger budget {budgets[i]} -> {steps[i]} s"
        )
    # At the keep-all peak nothing needs to move: the step is the trace's.
    assert steps[-1] == _plan(trace, budgets[-1], hw).trace_step_s


@pytest.mark.parametrize(("layers", "hidden", "hw_name"), [(8, 8192, "slow"), (16, 1024, "h200")])
def test_larger_budget_never_predicts_a_slower_step_when_simulated(
    layers: int, hidden: int, hw_name: str
) -> None:
    # Traces and links on which choosing by one model and reporting another's time broke the
    # order; here the simulator checks every plan.
    trace = _synthetic(layers, hidden, tokens=4096)
    hw = HARDWARE[hw_name]
    budgets = _ladder(trace, hw, 24)
    plans = [_plan(trace, b, hw) for b in budgets]
    assert {p.prediction_source for p in plans} == {"simulator"}
    steps = [p.predicted_step_s for p in plans]
    assert steps == sorted(steps, reverse=True)


@pytest.mark.parametrize("name", ["gpt4x4096", "block_stack"])
def test_larger_budget_never_predicts_a_slower_step_with_nvme_spill(
    traces: dict[str, Trace], name: str
) -> None:
    trace = traces[name]
    kw = {"tiers": ("cpu", "nvme"), "cpu_budget": trace.peak_saved_bytes // 4}
    budgets = _ladder(trace, H200, 16, **kw)
    steps = [_plan(trace, b, H200, simulate_records=0, **kw).predicted_step_s for b in budgets]
    assert steps == sorted(steps, reverse=True)


@pytest.mark.parametrize("name", ["gpt4x4096", "block_stack"])
def test_without_recompute_the_plan_only_keeps_and_offloads(
    traces: dict[str, Trace], name: str
) -> None:
    trace = traces[name]
    floor = _floor(trace, H200, recompute=False)
    assert floor >= _floor(trace, H200)  # fewer choices, no lower floor
    budgets = _ladder(trace, H200, 10, recompute=False)
    plans = [_plan(trace, b, H200, recompute=False) for b in budgets]
    for p in plans:
        assert not p.recompute_calls and p.bytes_by_placement()["recompute"] == 0
        assert simulate(trace, H200, p.decisions()).peak_bytes <= p.target_bytes
    steps = [p.predicted_step_s for p in plans]
    assert steps == sorted(steps, reverse=True)


# -- infeasible budgets -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt4x4096", "block_stack", "conv_net", "lstm"])
def test_infeasible_budget_names_the_smallest_feasible_one(
    traces: dict[str, Trace], name: str
) -> None:
    trace = traces[name]
    for margin in (
        0,
        12345,
        None,
    ):  # None: the default, a share of the budget (and 256 MiB on CUDA)
        with pytest.raises(BudgetInfeasibleError) as info:
            plan(trace, 1000, H200, margin=margin, min_offload_bytes=0)
        err = info.value
        assert err.budget_bytes == 1000
        assert err.min_feasible_bytes > 1000
        assert format_bytes(1000) in str(err)
        floor = err.min_feasible_bytes
        p = plan(trace, floor, H200, margin=margin, min_offload_bytes=0)
        assert p.gpu_budget_bytes == floor
        assert simulate(trace, H200, p.decisions()).peak_bytes <= p.target_bytes
        # ... and it is the smallest: one byte less is refused again.
        with pytest.raises(BudgetInfeasibleError) as again:
            plan(trace, floor - 1, H200, margin=margin, min_offload_bytes=0)
        assert again.value.min_feasible_bytes == floor


def test_infeasible_error_survives_pickling() -> None:
    trace = _synthetic(2, 1024)
    with pytest.raises(BudgetInfeasibleError) as info:
        plan(trace, 1, H200)
    err = pickle.loads(pickle.dumps(info.value))
    assert isinstance(err, BudgetInfeasibleError)
    assert (err.budget_bytes, err.min_feasible_bytes) == (1, info.value.min_feasible_bytes)


# -- recompute where the link cannot hide copies, offload where it can ----------------------------


@pytest.mark.parametrize("name", ["gpt4x4096", "gpt6x8192", "block_stack"])
def test_slow_link_recomputes_and_ideal_link_offloads(traces: dict[str, Trace], name: str) -> None:
    trace = traces[name]
    checkpoint = _plan(trace, 10**15, GLACIAL).anchors["checkpoint_blocks"]
    keep = simulate(trace, GLACIAL).peak_bytes
    assert checkpoint.peak_bytes < keep
    budget = (checkpoint.peak_bytes + keep) // 2

    slow = _plan(trace, budget, GLACIAL)
    by = slow.bytes_by_placement()
    assert slow.recompute_calls and by["recompute"] > 0
    assert by["cpu"] == by["nvme"] == 0  # a copy at 1 MB/s costs more than any recompute
    assert slow.predicted_step_s > slow.trace_step_s

    ideal = _plan(trace, budget, IDEAL)
    by = ideal.bytes_by_placement()
    assert not ideal.recompute_calls and by["recompute"] == 0 and by["cpu"] > 0
    assert ideal.predicted_step_s == ideal.trace_step_s  # no slowdown at all
    assert ideal.metadata["simulated_step_s"] == pytest.approx(ideal.trace_step_s, rel=1e-9)
    # Even the smallest feasible budget needs no recompute on an ideal link.
    floor = _plan(trace, _floor(trace, IDEAL), IDEAL)
    assert not floor.recompute_calls and floor.predicted_step_s == floor.trace_step_s


@pytest.mark.parametrize("name", ["gpt4x4096", "block_stack"])
def test_blocks_holding_running_statistics_are_never_recomputed(
    traces: dict[str, Trace], name: str
) -> None:
    """A trace names the modules whose forward updated running statistics (BatchNorm in
    training); recomputing a block holding one would update them twice, so no plan does."""
    trace = traces[name]
    checkpoint = _plan(trace, 10**15, GLACIAL).anchors["checkpoint_blocks"]
    budget = (checkpoint.peak_bytes + simulate(trace, GLACIAL).peak_bytes) // 2
    free = [m for m, _ in _plan(trace, budget, GLACIAL).recompute_calls]
    assert len(free) >= 2
    stateful = f"{free[-1]}.bn"  # a module inside the block the plan recomputed last
    marked = dataclasses.replace(trace, metadata={**trace.metadata, "stateful_modules": [stateful]})
    p = _plan(marked, budget, GLACIAL)
    recomputed = [m for m, _ in p.recompute_calls]
    assert free[-1] not in recomputed and recomputed  # the others still are
    assert p.predicted_peak_bytes <= budget
    assert all(e.recompute_module != free[-1] for e in p.entries)


# -- host room and NVMe -------------------------------------------------------------------------


def _host_peak(trace: Trace, p: Plan, placement: Placement) -> int:
    """Peak bytes the plan's ``placement`` families hold off the device (pack to last use)."""
    families = {f.family: f for f in trace.families()}
    delta: dict[int, int] = {}
    for e in p.entries:
        if e.placement is placement:
            f = families[e.family]
            delta[f.first_pack_event] = delta.get(f.first_pack_event, 0) + e.nbytes
            delta[f.last_use_event + 1] = delta.get(f.last_use_event + 1, 0) - e.nbytes
    live, peak = 0, 0
    for i in sorted(delta):
        live += delta[i]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["gpt4x4096", "gpt6x8192", "block_stack"])
def test_nvme_takes_the_longest_lived_families_when_the_host_is_short(
    traces: dict[str, Trace], name: str
) -> None:
    trace = traces[name]
    families = {f.family: f for f in trace.families()}
    floor = _floor(trace, FAST_DISK)
    budget = floor + (simulate(trace, FAST_DISK).peak_bytes - floor) // 2
    roomy = _plan(trace, budget, FAST_DISK)
    on_host = _host_peak(trace, roomy, CPU)
    assert on_host > 0

    # Half the host room, or less: with half, gpt4x4096's plan rebuilds its GELU outputs
    # instead of spilling (the roomy plan stores them on the host; a recomputed block's input
    # stays on the device, so the roomy plans differ from those made before that was so).
    for cap in (on_host // 2, on_host // 4, on_host // 8):
        p = _plan(trace, budget, FAST_DISK, tiers=("cpu", "nvme"), cpu_budget=cap)
        if p.bytes_by_placement()["nvme"]:
            break
    nvme = [families[e.family] for e in p.entries if e.placement is NVME]
    cpu = [families[e.family] for e in p.entries if e.placement is CPU]
    assert nvme and cpu
    assert _host_peak(trace, p, CPU) <= cap
    # The NVMe families are the earliest packed, hence the longest lived.
    assert max(f.first_pack_event for f in nvme) < min(f.first_pack_event for f in cpu)

    def life(f: object) -> int:
        return f.last_use_event - f.first_pack_event  # type: ignore[attr-defined]

    assert min(life(f) for f in nvme) >= max(life(f) for f in cpu)
    assert simulate(trace, FAST_DISK, p.decisions()).peak_bytes <= p.target_bytes

    # Host only, and less host room than anything that fits needs: no plan.
    tight = _plan(trace, floor, FAST_DISK).bytes_by_placement()["cpu"]
    assert tight > 0
    with pytest.raises(BudgetInfeasibleError):
        _plan(trace, floor, FAST_DISK, tiers=("cpu",), cpu_budget=0)
    # NVMe alone is a tier too.
    only = _plan(trace, budget, FAST_DISK, tiers=("nvme",))
    assert {e.placement for e in only.entries} <= {KEEP, NVME, RECOMPUTE, REBUILD}
    assert only.bytes_by_placement()["nvme"] > 0


# -- the plan as data -------------------------------------------------------------------------


def _mixed_plan(trace: Trace) -> Plan:
    """A plan that keeps, offloads to both tiers and (on a layered trace) recomputes."""
    floor = _floor(trace, FAST_DISK)
    budget = floor + (simulate(trace, FAST_DISK).peak_bytes - floor) // 5
    roomy = _plan(trace, budget, FAST_DISK)
    p = _plan(
        trace,
        budget,
        FAST_DISK,
        tiers=("cpu", "nvme"),
        cpu_budget=_host_peak(trace, roomy, CPU) // 2,
        signature="x: (4, 32, 64) float32",
    )
    by = p.bytes_by_placement()
    assert by["keep"] > 0 and by["cpu"] > 0 and by["nvme"] > 0
    return p


def _unlinked(trace: Trace) -> Trace:
    """``trace`` as if no saved tensor could be rebuilt from another."""
    records = tuple(dataclasses.replace(r, rebuild_from=-1) for r in trace.records)
    return dataclasses.replace(trace, records=records)


@pytest.mark.parametrize("name", ["gpt6x8192", "block_stack"])
def test_json_round_trip(traces: dict[str, Trace], name: str, tmp_path) -> None:
    plans = [_mixed_plan(traces[name])]
    if name == "gpt6x8192":
        # Every placement: recomputation where no GELU output can be rebuilt, and rebuilds.
        plans = [_mixed_plan(_unlinked(traces[name]))]
        assert plans[0].recompute_calls and plans[0].bytes_by_placement()["recompute"] > 0
        floor = _floor(traces[name], FAST_DISK)
        plans.append(_plan(traces[name], floor, FAST_DISK))
        assert plans[1].bytes_by_placement()["rebuild"] > 0
    for i, p in enumerate(plans):
        path = tmp_path / f"plan{i}.json"
        p.save(path)
        q = Plan.load(path)
        assert q == p
        assert dataclasses.replace(q, metadata={}) == dataclasses.replace(p, metadata={})
        assert q.decisions() == p.decisions()
        assert pickle.loads(pickle.dumps(p)) == p  # entries and triggers are slotted dataclasses
    # A trace is not a plan; the message says which format was expected.
    trace_path = tmp_path / "trace.json"
    traces[name].save(trace_path)
    with pytest.raises(ValueError, match=r"offload\.plan"):
        Plan.load(trace_path)


def test_planning_is_pure_and_deterministic(traces: dict[str, Trace]) -> None:
    trace = traces["gpt4x4096"]
    budget = _ladder(trace, SLOW, 3)[1]
    a, b = _plan(trace, budget, SLOW), _plan(trace, budget, SLOW)
    assert dataclasses.replace(a, metadata={}) == dataclasses.replace(b, metadata={})


@pytest.mark.parametrize("hw_name", ["h200", "slow"])
def test_the_links_free_pass_matches_one_pass_in_pack_order(
    traces: dict[str, Trace], hw_name: str
) -> None:
    """The offload order's first group (the families the D2H link takes without falling behind
    by more than their slack) is computed by one vectorised FIFO where the link takes them all:
    it must decide exactly as the plain in-order pass does, on every suffix the planner resumes
    from, where the link keeps up and where it refuses some."""
    from offload.lifecycle._plan_model import _Model, _Step

    hw = HARDWARE[hw_name]
    model = _Model(_Step(traces["gpt6x8192"], 0, 0), hw, ("cpu",), math.inf, math.inf, None)
    order = model.pack_order
    dur = model.d2h_s[order]
    packed = model.v.t[model.v.fp[order]]
    latest = packed + model.order_slacks[0][order] - dur

    def in_order(lo: int, done: float) -> tuple[list[bool], list[float]]:
        taken, busy = [], []
        for i in range(lo, len(order)):
            taken.append(done <= latest[i])
            if taken[-1]:
                done = max(done, packed[i]) + dur[i]
            busy.append(done)
        return taken, busy

    outcomes = set()
    for lo in range(len(order)):
        for done in (0.0, float(packed[lo]), float(latest[lo]), float(latest[lo]) + 1e-3):
            taken, busy = model._free_pass(order[lo:], done, 0)
            want_taken, want_busy = in_order(lo, done)
            assert taken.tolist() == want_taken, (lo, done)
            np.testing.assert_allclose(busy, want_busy, rtol=1e-12, atol=1e-15)
            outcomes.add(all(want_taken))
    assert outcomes == {True, False}  # both paths ran


@pytest.mark.parametrize("name", ["gpt6x8192", "block_stack", "checkpointed", "gpt_block"])
def test_expected_keys_drop_the_packs_of_recomputed_calls(
    traces: dict[str, Trace], name: str
) -> None:
    trace = traces[name]
    checkpoint = _plan(trace, 10**15, GLACIAL).anchors["checkpoint_blocks"].peak_bytes
    p = _plan(trace, (checkpoint + simulate(trace, GLACIAL).peak_bytes) // 2, GLACIAL)
    spans = [
        s
        for s in trace.module_spans()
        if s.phase == "forward" and (s.module, s.call_index) in set(p.recompute_calls)
    ]
    assert len(spans) == len(p.recompute_calls)
    inside = {
        r.key
        for r in trace.records
        if any(s.start_event <= r.pack_event <= s.end_event for s in spans)
    }
    rest = {r.key for r in trace.records if not r.in_backward} - inside
    assert set(p.expected_keys) == rest
    assert len(p.expected_keys) == len(rest)
    assert not inside & set(p.expected_keys)
    if name in ("gpt6x8192", "block_stack"):
        assert inside  # something was recomputed


@pytest.mark.parametrize("hw_name", ["h200", "slow"])
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_entries_cover_each_family_once_with_triggers_inside_its_life(
    traces: dict[str, Trace], name: str, hw_name: str
) -> None:
    trace, hw = traces[name], HARDWARE[hw_name]
    families = _activation_families(trace)
    records, events = trace.records, trace.events
    for budget in _ladder(trace, hw, 4)[:3]:
        p = _plan(trace, budget, hw)
        assert sorted(e.family for e in p.entries) == sorted(families)
        calls = set(p.recompute_calls)
        by_family = {e.family: e for e in p.entries}
        spans = {(s.module, s.call_index): s for s in trace.module_spans() if s.phase == "forward"}
        for e in p.entries:
            f = families[e.family]
            members = [records[s] for s in f.records]  # type: ignore[attr-defined]
            assert e.keys == tuple(r.key for r in members)
            assert e.nbytes == f.span_bytes and e.module == members[0].module  # type: ignore[attr-defined]
            if e.placement is RECOMPUTE:
                assert any(
                    s.start_event <= f.first_pack_event <= s.end_event  # type: ignore[attr-defined]
                    for c, s in spans.items()
                    if c in calls and c[0] == e.recompute_module
                )
            if e.placement is REBUILD:
                # Rebuilt from one family that is there (kept or reloaded) at its first unpack.
                (parent,) = {records[r.rebuild_from].family for r in members}
                source = by_family[parent]
                assert source.placement in (KEEP, CPU, NVME)
                needed = min(u for r in members for u in r.unpack_events)
                assert source.reload is None or source.reload_event <= needed
            if e.reload is None:
                assert e.reload_event == -1
                continue
            assert e.placement in (CPU, NVME)
            event = events[e.reload_event]
            first_unpack = min(u for r in members for u in r.unpack_events)
            assert f.first_pack_event < e.reload_event <= first_unpack  # type: ignore[attr-defined]
            assert event.step == members[0].step
            if e.reload.kind == "unpack":
                assert event.kind is EventKind.UNPACK
                assert records[event.record].key == (
                    e.reload.module,
                    e.reload.call_index,
                    e.reload.ordinal,
                )
            else:
                assert event.kind is EventKind.BACKWARD_START
                assert (event.module, event.call_index) == (e.reload.module, e.reload.call_index)


def test_activation_and_norm_outputs_are_rebuilt_where_memory_is_short(
    traces: dict[str, Trace],
) -> None:
    """NOTE [ Rebuilt outputs ]: on the synthetic GPT (H200 figures) at half its saved bytes the
    plan rebuilds every layer's GELU and LayerNorm outputs (saved by mlp.fc2, attn.qkv and
    mlp.fc1), which is faster than the best plan without that option and fits in simulation;
    with room for everything, or a rebuild that costs more than it saves, nothing is rebuilt."""
    trace = traces["gpt4x4096"]
    unlinked = _unlinked(trace)
    keep_all = simulate(trace, H200).peak_bytes
    base = trace.events[0].memory_bytes
    budget = base + (keep_all - base) // 2
    p, without = _plan(trace, budget, H200), _plan(unlinked, budget, H200)
    rebuilt = [e for e in p.entries if e.placement is REBUILD]
    savers = ("mlp.fc2", "attn.qkv", "mlp.fc1")
    linked = {r.family for r in trace.records if r.module.endswith(savers)}
    assert {e.family for e in rebuilt} == linked and p.metadata["rebuilt_families"] == 12
    assert {r.family for r in trace.records if r.rebuild_from >= 0} == linked
    assert p.prediction_source == "simulator" and p.predicted_peak_bytes <= p.target_bytes
    assert p.predicted.step_s < without.predicted.step_s
    # Here rebuilding takes the place of recomputing blocks.
    assert not p.recompute_calls and without.recompute_calls
    # The rebuild time is in the prediction: the same plan with rebuilds 1000x slower is slower.
    slow = dataclasses.replace(H200, pointwise_bytes_per_s=H200.pointwise_bytes_per_s / 1000)
    q = _plan(trace, budget, slow)
    assert not any(e.placement is REBUILD for e in q.entries)
    assert q.predicted.step_s == without.predicted.step_s
    roomy = _plan(trace, keep_all, H200)
    assert {e.placement for e in roomy.entries} == {KEEP}


@pytest.mark.parametrize("name", ["gpt4x4096", "block_stack"])
def test_anchors_without_a_simulation_are_those_the_model_predicts_as_defined(
    traces: dict[str, Trace], name: str
) -> None:
    """Above ``simulate_records`` the planner model gives the anchors it can predict as
    lifecycle.predict_anchors defines them (NOTE [ Anchors ]): keep_all, and checkpoint_blocks
    while it may recompute every block, each bounding the simulated peak. offload_all, the
    manager's min-memory mode, reloads through the executor's window, which the model lacks:
    it is left out, and the summary says so. The model's offload_all was a planned
    move-everything with early reloads (gpt4x4096: 1,745,354,752 B, min-memory mode simulated
    1,375,993,856)."""
    trace = traces[name]
    simulated = lifecycle.predict_anchors(trace, H200)
    p = _plan(trace, 10**15, H200, simulate_records=0)
    assert p.prediction_source == "planner model"
    assert list(p.anchors) == ["keep_all", "checkpoint_blocks"]
    for k, a in p.anchors.items():
        assert a.peak_bytes >= simulated[k].peak_bytes, k
        assert a.step_s == pytest.approx(simulated[k].step_s, rel=1e-9), k
    assert "offload_all: not predicted" in p.summary()
    # A block the planner may not recompute (it holds running statistics): the model's
    # checkpoint column is no longer every block.
    block = sorted({d.recompute_module for d in lifecycle.checkpoint_blocks(trace).values()})[1]
    marked = dataclasses.replace(trace, metadata={**trace.metadata, "stateful_modules": [block]})
    q = _plan(marked, 10**15, H200, simulate_records=0)
    assert list(q.anchors) == ["keep_all"]
    assert "offload_all, checkpoint_blocks: not predicted" in q.summary()


@pytest.mark.parametrize("name", ["gpt6x8192", "block_stack"])
def test_summary_names_the_budget_the_anchors_and_the_placements(
    traces: dict[str, Trace], name: str
) -> None:
    p = _mixed_plan(traces[name])
    text = p.summary()
    assert format_bytes(p.gpu_budget_bytes) in text
    assert format_bytes(p.target_bytes) in text
    for anchor in ("keep_all", "offload_all", "checkpoint_blocks"):
        assert anchor in text
    for placement, nbytes in p.bytes_by_placement().items():
        if nbytes:
            assert f"{placement} {format_bytes(nbytes)}" in text
    for module, call in p.recompute_calls[:8]:
        assert f"{module}[{call}]" in text
    # The module table says when it shows only the top ones.
    modules = len({e.module for e in p.entries})
    assert (f"top 3 of {modules} modules" if modules > 3 else f"{modules} modules:") in p.summary(3)


def test_repr_counts_rather_than_lists(traces: dict[str, Trace]) -> None:
    p = _mixed_plan(traces["block_stack"])
    text = repr(p)
    assert text.startswith(f"Plan(gpu_budget_bytes={p.gpu_budget_bytes}, tiers={p.tiers}, ")
    assert f"entries={len(p.entries)}, recompute_calls={len(p.recompute_calls)}" in text
    assert f"predicted_peak_bytes={p.predicted_peak_bytes}" in text
    assert len(text) < 300 and len(p.entries) > 10


# -- arguments --------------------------------------------------------------------------------


def test_bad_arguments_name_the_argument(traces: dict[str, Trace]) -> None:
    trace = traces["gpt2x1024"]
    cases = [
        ({"gpu_budget": -1}, ValueError, "gpu_budget"),
        ({"gpu_budget": "lots"}, ValueError, "gpu_budget"),
        ({"gpu_budget": 1.5}, TypeError, "gpu_budget"),
        ({"tiers": ("gpu",)}, ValueError, "tiers"),
        ({"tiers": ()}, ValueError, "tiers"),
        ({"tiers": ("cpu", "cpu")}, ValueError, "tiers"),
        ({"tiers": 3}, TypeError, "tiers"),
        ({"cpu_budget": -1}, ValueError, "cpu_budget"),
        ({"nvme_bytes": "x"}, ValueError, "nvme_bytes"),
        ({"min_offload_bytes": -5}, ValueError, "min_offload_bytes"),
        ({"margin": -1}, ValueError, "margin"),
        ({"max_inflight_bytes": -1}, ValueError, "max_inflight_bytes"),
        ({"step": 3}, ValueError, "step"),
        ({"simulate_records": "all"}, TypeError, "simulate_records"),
        ({"trace": "trace.json"}, TypeError, "trace"),
        ({"hardware": None}, TypeError, "hardware"),
        ({"hardware": {"h2d_bytes_per_s": 1e9}}, TypeError, "hardware"),
    ]
    for change, error, name in cases:
        kwargs = {"trace": trace, "gpu_budget": 10**12, "hardware": H200, **change}
        with pytest.raises(error, match=name):
            plan(**kwargs)


def test_nvme_bytes_without_nvme_in_tiers_is_refused_like_the_cli() -> None:
    """``offload plan --nvme-bytes`` without nvme in ``--tiers`` is a usage error, but
    ``plan(..., tiers=("cpu",), nvme_bytes=...)`` planned as if it were not given. Now both
    Python functions raise a ValueError naming both arguments; with nvme in tiers it is taken."""
    trace = transformer_trace(layers=1, hidden=64, tokens=64)
    for fn in (plan, offload.plan):
        for tiers in (("cpu",), "cpu"):
            with pytest.raises(ValueError, match=r"nvme_bytes.*only with 'nvme' in tiers.*'cpu'"):
                fn(trace, 10**12, H200, tiers=tiers, nvme_bytes="1GiB")
        assert fn(trace, 10**12, H200, tiers=("cpu", "nvme"), nvme_bytes="1GiB").tiers == (
            "cpu",
            "nvme",
        )


@pytest.mark.parametrize("fn", [plan, offload.plan])
def test_simulate_records_is_a_count(fn) -> None:
    """``simulate_records=-1`` was taken (and meant the same as 0, never simulate)."""
    trace = transformer_trace(layers=1, hidden=64, tokens=64)
    with pytest.raises(ValueError, match=r"simulate_records must be an int >= 0; got -1"):
        fn(trace, 10**12, H200, simulate_records=-1)
    with pytest.raises(TypeError, match=r"simulate_records must be an int >= 0; got float"):
        fn(trace, 10**12, H200, simulate_records=2.0)
    assert fn(trace, 10**12, H200, simulate_records=0).gpu_budget_bytes == 10**12


def test_offload_plan_names_a_trace_that_is_not_one() -> None:
    """``offload.plan`` reads the trace's device before anything else: a path is refused by the
    argument's name, not with an ``AttributeError`` from inside."""
    with pytest.raises(TypeError, match=r"trace must be a lifecycle\.Trace .*got str"):
        offload.plan("trace.json", 10**9, H200)


def test_size_errors_offer_only_what_the_argument_takes() -> None:
    """Only a GPU budget given to ``offload`` may be a percentage (of a CUDA device's memory);
    the messages for every other size say bytes."""
    trace = transformer_trace(layers=1, hidden=64, tokens=64)
    with pytest.raises(TypeError, match="cpu_budget must be an int") as info:
        plan(trace, 10**12, H200, cpu_budget=1.5)
    assert "%" not in str(info.value)
    with pytest.raises(ValueError, match="cpu_budget takes bytes, not a percentage"):
        plan(trace, 10**12, H200, cpu_budget="50%")
    with pytest.raises(TypeError, match=r"gpu_budget must be .*'85%'"):
        offload.plan(trace, 1.5, H200)


def test_sizes_are_whole_bytes_computed_exactly() -> None:
    from offload.lifecycle._units import parse_bytes

    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes(".5KiB") == 512
    assert parse_bytes("9007199254740993") == 2**53 + 1  # through a float it was 2**53
    assert parse_bytes(str(2**63 - 1)) == 2**63 - 1
    # A fraction of a byte is refused, not rounded down ('0.5' was 0: no host room at all);
    # with a larger unit it is rounded down, so that offload plan's own figures parse.
    for text, figure in (("0.5", "0.5 bytes"), ("1.5B", "1.5 bytes")):
        with pytest.raises(ValueError, match=f"cpu_budget='{text}' is {figure}.*not a whole"):
            parse_bytes(text, name="cpu_budget")
    assert parse_bytes("1.1GiB") == 1181116006 and parse_bytes("1.44MiB") == 1509949
    # Too large is a ValueError naming the value (an OverflowError, or an int64 overflow later).
    for value in (str(2**63), "9" * 400, "9" * 5000, 2**64):
        with pytest.raises(ValueError, match=r"cpu_budget=.*is too large; at most 922"):
            parse_bytes(value, name="cpu_budget")


def test_negative_sizes_are_out_of_range_and_decimal_units_say_so() -> None:
    """'-5GiB' said "is not a size"; it is one, below the range taken. KB, MB, GB, TB are
    decimal and K, M, G, T binary: the errors say which a value was read as."""
    from offload.lifecycle._units import parse_bytes

    assert (
        parse_bytes("12GB") == 12 * 10**9 and parse_bytes("12G") == parse_bytes("12GiB") == 12 << 30
    )
    with pytest.raises(ValueError, match=r"^cpu_budget must be >= 0 bytes; got '-5GiB' \(-5,368,"):
        parse_bytes("-5GiB", name="cpu_budget")
    with pytest.raises(ValueError, match=r"^x must be >= 0 bytes; got '-0.1KiB' \(-103 bytes\)"):
        parse_bytes("-0.1KiB", name="x")  # not rounded to 0 bytes
    with pytest.raises(ValueError, match=r"more than 0 bytes; got '-1' \(-1 bytes\)$"):
        parse_bytes("-1", name="x", positive=True)
    decimal = r"got '0GB' \(0 bytes: decimal; use GiB for binary\)$"
    with pytest.raises(ValueError, match=decimal):
        parse_bytes("0GB", name="x", positive=True)
    with pytest.raises(ValueError, match=r"'1e9' is not a size;.*binary.*decimal: 1 GB = 10\*\*9"):
        parse_bytes("1e9", name="x")


def _small_plan() -> Plan:
    trace = transformer_trace(layers=4, hidden=64, tokens=64)
    return plan(trace, trace.peak_memory_bytes // 2, H200, min_offload_bytes=0, margin=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tiers", "cpu"),
        ("tiers", ["gpu"]),
        ("tiers", []),
        ("tiers", ["cpu", "cpu"]),
        ("anchors", []),
    ],
)
def test_plan_file_with_a_malformed_field(field: str, value: object) -> None:
    d = _small_plan().to_dict()
    assert Plan.from_dict(d).tiers == ("cpu",)
    d[field] = value
    with pytest.raises(
        ValueError, match=f"plan field '{field}' must be .*got {re.escape(repr(value))}"
    ):
        Plan.from_dict(d)


def _entry0(d: dict, **fields: object) -> dict:
    d["entries"][0].update(fields)
    return d


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(gpu_budget_bytes="8GiB"), r"'gpu_budget_bytes' must be an int"),
        (lambda d: d.update(gpu_budget_bytes=0), r"'gpu_budget_bytes' must be an int in \[1,"),
        (lambda d: d.update(gpu_budget_bytes=1e300), r"'gpu_budget_bytes' must be an int"),
        (lambda d: d.update(margin_bytes=d["gpu_budget_bytes"] + 1), r"'margin_bytes' must be"),
        (lambda d: d.update(trace_step_s=float("nan")), r"'trace_step_s' must be a finite"),
        (lambda d: d.update(metadata="x"), r"'metadata' must be a JSON object"),
        (lambda d: d.update(entries={}), r"'entries' must be a list"),
        (lambda d: d["predicted"].update(peak_bytes=-1), r"'predicted.peak_bytes' must be"),
        (lambda d: _entry0(d, nbytes=-1), r"'entries\[0\].nbytes' must be an int in \[0,"),
        (lambda d: _entry0(d, keys=[["a", 0]]), r"'entries\[0\].keys' must be \[module, call"),
        (lambda d: _entry0(d, placement="gpu"), r"'entries\[0\].placement' must be one of"),
        (lambda d: d["entries"].append(d["entries"][0]), r"another entry has this family"),
        (lambda d: _entry0(d, placement="nvme"), r"not among the plan's tiers"),
        (lambda d: _entry0(d, placement="recompute"), r"which recompute_calls does not list"),
        (lambda d: d.pop("base_bytes"), r"missing the field 'base_bytes'"),
    ],
    ids=[
        "budget-str",
        "budget-zero",
        "budget-float",
        "margin-as-budget",
        "time-nan",
        "metadata-str",
        "entries-object",
        "peak-negative",
        "nbytes-negative",
        "key-short",
        "placement-unknown",
        "family-twice",
        "tier-not-planned",
        "recompute-unlisted",
        "field-missing",
    ],
)
def test_a_plan_file_that_is_not_one_the_planner_makes_is_refused(change, message) -> None:
    """Each of these loaded (a few raised an error that named neither field nor value: int() of
    '8GiB', unpacking a short key, OverflowError) and ran, the budget unenforced."""
    d = _small_plan().to_dict()
    change(d)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(d)


def test_a_given_plan_that_recomputes_modules_the_model_lacks_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    d = _small_plan().to_dict()
    for name in ("layers.0", ""):
        d["recompute_calls"] = [[name, 0]]
        for e in d["entries"]:
            if e["placement"] == "recompute":
                e["recompute_module"] = name
        with pytest.raises(ValueError, match=r"plan: recompute_calls name \[" + repr(name)):
            offload.ActivationOffloader(model, plan=Plan.from_dict(d))


def test_plan_summary_lists_top_modules_or_none() -> None:
    p = _small_plan()
    header = "  module "
    table = p.summary(top=100).split(header)[1].splitlines()[1:]
    assert len(table) == len({e.module for e in p.entries}) >= 2
    assert p.summary(top=1).split(header)[1].splitlines()[1:] == table[:1]
    assert header not in p.summary(top=0)
    with pytest.raises(ValueError, match="top must be >= 0"):
        p.summary(top=-1)
    with pytest.raises(TypeError, match="top must be an int"):
        p.summary(top=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"flops_per_s": 0}, "flops_per_s"),
        ({"flops_per_s": -1e12}, "flops_per_s"),
        ({"flops_per_s": math.nan}, "flops_per_s"),
        ({"memory_bytes_per_s": 0}, "memory_bytes_per_s"),
        ({"memory_bytes_per_s": "fast"}, "memory_bytes_per_s"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
        ({"seq_len": 0}, "seq_len"),
        ({"base_bytes": -1}, "base_bytes"),
    ],
)
def test_transformer_trace_names_a_bad_argument(change: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} must be"):
        transformer_trace(layers=1, hidden=8, tokens=4, **change)


@pytest.mark.parametrize(
    "change", [{"layers": 1.5}, {"hidden": 8.0}, {"dtype_bytes": True}, {"base_bytes": 0.0}]
)
def test_transformer_trace_counts_of_another_type_are_type_errors(change: dict) -> None:
    """A float or a bool where a count goes is a TypeError naming it (it was a ValueError)."""
    (named,) = change
    kw = {"layers": 1, "hidden": 8, "tokens": 4, **change}
    with pytest.raises(TypeError, match=f"^{named} must be an int >= [01]; got"):
        transformer_trace(**kw)


def test_swiglu_trace_saves_what_a_llama_layer_saves() -> None:
    """``transformer_trace(mlp="swiglu")``: per layer 15 records in 11 families, 16·h + 8·f
    bytes per token (bf16), the SiLU output linked to the gate output the SiLU saved and both
    norm outputs to the norms' inputs, as the recorder links them."""
    h, tokens, layers = 1024, 512, 3
    trace = transformer_trace(layers=layers, hidden=h, tokens=tokens, mlp="swiglu")
    f = 7 * h // 2
    assert len(trace.records) == 15 * layers and len(trace.families()) == 11 * layers
    lse = tokens * 4 * (h // 128)
    assert trace.saved_bytes == layers * (2 * tokens * (8 * h + 4 * f) + lse)
    by_seq = {r.seq: r for r in trace.records}
    links = {
        (r.module.split(".", 2)[2], r.ordinal): by_seq[r.rebuild_from].module.split(".", 2)[2]
        for r in trace.records
        if r.rebuild_from >= 0 and r.module.startswith("layers.1.")
    }
    assert links == {
        ("attn.qkv", 0): "ln1",
        ("mlp.gate", 0): "ln2",
        ("mlp.up", 0): "ln2",
        ("mlp.mul", 0): "mlp.act",
    }
    gate, up = (r for r in trace.records if r.module in ("layers.1.mlp.gate", "layers.1.mlp.up"))
    assert gate.family == up.family  # both save the ln2 output
    with pytest.raises(ValueError, match="mlp must be"):
        transformer_trace(layers=1, hidden=8, tokens=8, mlp="relu")
    with pytest.raises(ValueError, match="ffn_hidden"):
        transformer_trace(layers=1, hidden=8, tokens=8, ffn_hidden=0)


def test_weight_casts_under_min_offload_bytes_count_as_kept() -> None:
    """NOTE [ Weight casts ] in offload: the manager casts a weight again at unpack only from
    min_offload_bytes up and keeps a smaller cast as it is. A trace recorded without the
    manager marks every cast (TensorRecord.weight_cast), and the plan counts the small ones:
    its keep_all anchor, and the plan that keeps everything, equal the saved bytes measured on
    a run keeping everything (each Linear's 8 KiB bf16 weight cast under a 64 KiB floor)."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    x = torch.randn(4096, 64)
    floor = 64 << 10

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().sum()

    trace = offload.profile(lambda: forward().backward(), model)
    casts = [r for r in trace.records if r.weight_cast]
    # The first Linear's input needs no gradient: its weight cast is not saved.
    assert len(casts) == 3 and all(r.is_parameter and r.nbytes == 64 * 64 * 2 for r in casts)
    assert Trace.from_dict(trace.to_dict()).records == trace.records

    mgr = offload.ActivationOffloader(model, min_offload_bytes=1 << 40)  # keeps everything
    with SavedBytes.on(mgr) as meter:
        with mgr:
            loss = forward()
        loss.backward()
    mgr.close()
    casts_bytes = sum(r.nbytes for r in casts)
    assert meter.peak == simulate(trace, H200).peak_bytes + casts_bytes  # casts free at floor 0

    p = plan(trace, 1 << 40, H200, min_offload_bytes=floor, margin=0)
    assert p.anchors["keep_all"].peak_bytes == p.predicted_peak_bytes == meter.peak
    anchors = lifecycle.predict_anchors(trace, H200, min_offload_bytes=floor)
    assert anchors["keep_all"].peak_bytes == meter.peak
    # From the floor up the manager casts them again: a plan counts nothing for them.
    p0 = plan(trace, 1 << 40, H200, min_offload_bytes=0, margin=0)
    assert p0.anchors["keep_all"].peak_bytes == meter.peak - casts_bytes


def _two_backward_trace() -> Trace:
    """4 x (Linear(256, 256) + GELU) at 64 rows, two backwards of one graph in the step: every
    saved tensor (65,536 B each, 9 families) is unpacked once per backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]
    )
    x = torch.randn(64, 256)

    def step() -> None:
        y = model(x)
        y.pow(2).mean().backward(retain_graph=True)
        y.sum().backward()

    return offload.profile(step, model, warmup_steps=0)


@pytest.mark.parametrize("hw", [H200, CPU_ONLY], ids=["h200", "cpu_only"])
def test_a_step_of_two_backwards_plans_below_keeping_everything(hw: HardwareModel) -> None:
    """A moved family's reload dies after its last unpack in each backward and the next one
    reloads it (NOTE [ Backward passes ]). The planner held it from its first reload to its last
    use in the second backward, so everything was back by the end of the first: 0.75 and 0.5 of
    keeping everything (589,824 B) raised BudgetInfeasibleError, minimum 524,288. Now each pass
    counts on its own and all three fit (predicted 524,288 / 393,216 / 262,144, on both
    hardware models); the simulator's peak of each plan is within its prediction."""
    trace = _two_backward_trace()
    assert {len(r.unpack_events) for r in trace.records if not r.is_parameter} <= {1, 2}
    keep = simulate(trace, hw).peak_bytes
    assert keep == trace.peak_saved_bytes == 9 * 65_536
    for share in (0.9, 0.75, 0.5):
        budget = int(keep * share)
        p = _plan(trace, budget, hw)
        assert simulate(trace, hw, p.decisions()).peak_bytes <= p.predicted_peak_bytes <= budget
