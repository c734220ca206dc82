"""The simulator's event engine: hand-computed timelines on synthetic traces (links,
stalls, back-pressure, duplex, NVMe, recompute, rebuilds), and its argument errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from simulate_util import (
    CPU,
    IDEAL,
    KEEP,
    NVME,
    REBUILD,
    RECOMPUTE,
    _Builder,
    _check_accounting,
    _hw,
    _lifo,
    _pointwise,
    _with_block,
)
from torch import nn

import offload
from offload.lifecycle import (
    Decision,
    EventKind,
    HardwareModel,
    Placement,
    Trace,
    offload_all,
    simulate,
)


def test_keep_all_replays_the_trace() -> None:
    sim = simulate(_lifo(), _hw(1000.0))
    assert sim.step_s == sim.trace_step_s == 10.0
    assert sim.peak_bytes == 2000 and sim.base_bytes == 0
    assert (sim.stall_s, sim.stalls, sim.d2h_busy_s, sim.h2d_busy_s) == (0.0, 0, 0.0, 0.0)
    # Bytes leave at the event after their last use (events 9 and 11).
    assert sim.memory_timeline == ((0.0, 0), (1.0, 1000), (3.0, 2000), (7.0, 1000), (10.0, 0))
    _check_accounting(sim)


def test_slow_link_stalls_by_hand() -> None:
    # 500 B/s: each 1000-byte copy takes 2 s. f0 goes out over [1, 3], f1 over [3, 5]. With no
    # look-ahead, f1's reload starts as b's backward starts (5) and lands at 7, one second after
    # its unpack (6); everything after shifts by 1 s, so f0's reload runs [8, 10] against an
    # unpack at 9: another second.
    sim = simulate(_lifo(), _hw(500.0), offload_all(_lifo()), prefetch_bytes=0)
    assert sim.stall_s == pytest.approx(2.0)
    assert sim.stalls == 0  # both were started ahead of use, just not early enough
    assert sim.step_s == pytest.approx(12.0)
    assert sim.d2h_busy_s == pytest.approx(4.0) and sim.h2d_busy_s == pytest.approx(4.0)
    assert sim.bytes_offloaded_cpu == sim.bytes_reloaded == 2000
    assert sim.peak_bytes == 1000  # f0 left before f1 arrived; f1 left before f0 came back
    _check_accounting(sim)


def test_ideal_link_costs_nothing_and_lowers_the_peak() -> None:
    sim = simulate(_lifo(), IDEAL, offload_all(_lifo()), prefetch_bytes=0)
    assert sim.step_s == sim.trace_step_s == 10.0
    assert sim.stall_s == 0.0 and sim.peak_bytes == 1000


def test_unpack_without_reload_is_a_stall() -> None:
    # Reload only at use: the whole copy back is waited for.
    decisions = {
        fid: Decision(placement=CPU, reload_event=unpack) for fid, unpack in ((0, 10), (1, 8))
    }
    sim = simulate(_lifo(), _hw(1000.0), decisions)
    assert sim.stall_s == pytest.approx(2.0)
    assert sim.step_s == pytest.approx(12.0)


def test_unpack_before_copy_out_uses_the_source() -> None:
    # 100 B/s: f0's copy out ends at 11, after both unpacks; nothing comes back, nothing waits,
    # and the bytes never left.
    sim = simulate(_lifo(), _hw(100.0), offload_all(_lifo()))
    assert sim.bytes_reloaded == 0 and sim.h2d_busy_s == 0.0
    assert sim.step_s == 10.0 and sim.stall_s == 0.0
    assert sim.peak_bytes == 2000
    _check_accounting(sim)


def test_backpressure_waits_for_the_oldest_copy() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    f0 = b.pack(1.0, 1000, "a")
    f1 = b.pack(1.5, 1000, "a")
    b.fwd_end(2.0, "a")
    b.bwd_start(5.0, "a")
    b.unpack(6.0, f1)
    b.unpack(6.0, f0)
    trace = b.build(8.0)
    tight = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes=1000)
    assert tight.backpressure_s == pytest.approx(0.5)  # f0's copy [1, 2] blocks f1's pack at 1.5
    loose = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes="2KB")
    assert loose.backpressure_s == 0.0
    # One copy larger than the bound still goes (it waits only for what is in flight).
    alone = simulate(trace, _hw(1000.0), offload_all(trace), max_inflight_bytes=1)
    assert alone.backpressure_s == pytest.approx(0.5)
    for sim in (tight, loose, alone):
        _check_accounting(sim)


def test_duplex_cap_applies_only_when_both_directions_are_busy() -> None:
    trace = _lifo()
    # f0's reload starts at f1's pack (event 5, t=3), while f1 goes out: both busy over [3, ...].
    overlap = {0: Decision(placement=CPU, reload_event=5), 1: Decision(placement=CPU)}
    free = simulate(trace, _hw(1000.0, duplex=2000.0), overlap)
    capped = simulate(trace, _hw(1000.0, duplex=1000.0), overlap)
    # Uncapped both copies take 1 s; capped each gets half of 1000 B/s and takes 2 s.
    assert free.d2h_busy_s == pytest.approx(2.0) and free.h2d_busy_s == pytest.approx(2.0)
    assert capped.d2h_busy_s == pytest.approx(3.0) and capped.h2d_busy_s == pytest.approx(3.0)
    # Without overlap the cap changes nothing at all.
    apart = offload_all(trace)
    assert simulate(trace, _hw(1000.0, duplex=2000.0), apart) == simulate(
        trace, _hw(1000.0, duplex=1000.0), apart
    )


def test_nvme_is_slower_than_cpu_and_frees_the_device_at_pcie_speed() -> None:
    trace = _lifo()
    hw = _hw(1000.0, disk_write=250.0, disk_read=250.0)
    cpu = simulate(trace, hw, offload_all(trace, tier=CPU), prefetch_bytes=0)
    nvme = simulate(trace, hw, offload_all(trace, tier="nvme"), prefetch_bytes=0)
    assert nvme.step_s > cpu.step_s and nvme.stall_s > cpu.stall_s
    assert nvme.disk_write_busy_s == pytest.approx(8.0)
    assert nvme.disk_read_busy_s == pytest.approx(8.0)
    assert nvme.bytes_offloaded_nvme == 2000 and nvme.bytes_offloaded_cpu == 0
    # Device bytes go when D2H completes (pinned staging), not when the disk finishes.
    assert nvme.memory_timeline[:4] == ((0.0, 0), (1.0, 1000), (2.0, 0), (3.0, 1000))
    _check_accounting(nvme)


def test_copies_on_the_compute_thread_add_their_time() -> None:
    hw = HardwareModel.cpu_only(
        copy_bytes_per_s=1000.0, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    sim = simulate(_lifo(), hw, offload_all(_lifo()), prefetch_bytes=0)
    assert sim.sync_copy_s == pytest.approx(4.0)  # two copies out, two back, 1 s each
    assert sim.step_s == pytest.approx(14.0) and sim.stall_s == 0.0
    _check_accounting(sim)


def test_recompute_costs_the_module_forward_and_frees_its_bytes() -> None:
    trace = _with_block()
    keep = simulate(trace, IDEAL)
    assert keep.peak_bytes == 7000
    own = simulate(trace, IDEAL, {1: RECOMPUTE})
    assert own.recompute_s == pytest.approx(0.7)  # blk.inner's forward
    assert own.step_s == pytest.approx(10.7)
    assert own.bytes_recomputed == 4000
    # f1 is gone in forward (peak 1000 + 2000) and back at its unpack, after f2 left.
    assert own.peak_bytes == 5000
    whole = simulate(
        trace,
        IDEAL,
        {i: Decision(placement=RECOMPUTE, recompute_module="blk") for i in (0, 1)},
    )
    assert whole.recompute_s == pytest.approx(3.0)  # blk's forward, once for both families
    assert whole.peak_bytes == 5000
    for sim in (own, whole):
        _check_accounting(sim)


def _gelu(**pack_kwargs: int) -> Trace:
    """An activation "act" saves its input h (f0); "fc2" saves act's output g (f1), which the
    trace links to h (``rebuild_from``). Backward reaches g (fc2's backward) before h.

    index  0     1     2     3     4     5     6     7      8     9      10    11
    event  start act+  pack0 act-  fc2+  pack1 fc2-  bwd fc2 unp1 bwd act unp0  end
    time   0     0     1     1.5   1.5   2     3     5      6     7      8     10
    """
    b = _Builder()
    b.fwd_start(0.0, "act")
    h = b.pack(1.0, 1000, "act")
    b.fwd_end(1.5, "act")
    b.fwd_start(1.5, "fc2")
    g = b.pack(2.0, 1000, "fc2", rebuild_from=h, **pack_kwargs)
    b.fwd_end(3.0, "fc2")
    b.bwd_start(5.0, "fc2")
    b.unpack(6.0, g)
    b.bwd_start(7.0, "act")
    b.unpack(8.0, h)
    return b.build(10.0)


def test_rebuild_from_a_kept_parent_costs_one_kernel() -> None:
    trace = _gelu()
    hw = _pointwise(IDEAL)
    keep = simulate(trace, hw)
    assert keep.memory_timeline == ((0.0, 0), (1.0, 1000), (2.0, 2000), (7.0, 1000), (10.0, 0))
    sim = simulate(trace, hw, {1: REBUILD})
    assert sim.rebuild_s == pytest.approx(1.0)  # (1000 + 1000) bytes at 2000 B/s
    assert sim.step_s == pytest.approx(11.0)
    assert sim.bytes_rebuilt == 1000 and sim.bytes_recomputed == 0
    assert (sim.stall_s, sim.stalls, sim.bytes_reloaded, sim.h2d_busy_s) == (0.0, 0, 0, 0.0)
    # g is held at its pack (fc2's forward uses it), gone from the next event (t=3), back when
    # its rebuild starts at its unpack (t=6) and freed after its last use (event 9, now at t=8).
    assert sim.memory_timeline == (
        (0.0, 0),
        (1.0, 1000),
        (2.0, 2000),
        (3.0, 1000),
        (6.0, 2000),
        (8.0, 1000),
        (11.0, 0),
    )
    _check_accounting(sim)


@pytest.mark.parametrize("tier", [CPU, NVME])
def test_rebuild_waits_for_its_parents_reload(tier: Placement) -> None:
    trace = _gelu()
    hw = _pointwise(_hw(1000.0))  # 1 s per copy
    # No look-ahead: h's reload starts as the backward of fc2 (which saved its rebuilt child)
    # starts (t=5), not as act's (t=7), and lands at 6, as the rebuild needs it.
    sim = simulate(trace, hw, {0: tier, 1: REBUILD}, prefetch_bytes=0)
    assert sim.stalls == 0 and sim.stall_s == pytest.approx(0.0, abs=1e-6)
    assert sim.rebuild_s == pytest.approx(1.0) and sim.step_s == pytest.approx(11.0)
    assert sim.bytes_reloaded == 1000 and sim.h2d_busy_s == pytest.approx(1.0)
    if tier is CPU:
        # h leaves when its copy out ends (t=2); it is back from its reload's start (t=5) to its
        # own unpack, after g's rebuild (t=6 to event 9, now at t=8).
        assert sim.memory_timeline == (
            (0.0, 0),
            (1.0, 1000),
            (2.0, 0),
            (2.0, 1000),
            (3.0, 0),
            (5.0, 1000),
            (6.0, 2000),
            (8.0, 1000),
            (11.0, 0),
        )
    # A reload planned only for h's own unpack (event 10): the rebuild starts it, a counted stall.
    late = simulate(trace, hw, {0: Decision(placement=tier, reload_event=10), 1: REBUILD})
    assert late.stalls == 1 and late.stall_s == pytest.approx(1.0, abs=1e-6)
    assert late.rebuild_s == pytest.approx(1.0) and late.step_s == pytest.approx(12.0, abs=1e-6)
    assert late.bytes_reloaded == 1000  # h's own unpack finds it there
    # A slow link: h's reload runs [5, 7]; the rebuild waits for it, then runs [7, 8].
    slow = simulate(trace, _pointwise(_hw(500.0)), {0: tier, 1: REBUILD}, prefetch_bytes=0)
    assert slow.stalls == 0 and slow.stall_s == pytest.approx(1.0, abs=1e-6)
    assert slow.step_s == pytest.approx(12.0, abs=1e-6)
    for s in (sim, late, slow):
        _check_accounting(s)


def test_window_walks_last_packed_first_as_the_executor_does() -> None:
    # A dropout between act and fc2 saves a mask m, unpacked between g (rebuilt from h) and h.
    # The executor's window walks its step's families last packed first (it has no trace to
    # know that g's rebuild needs h first), so the simulator does too.
    b = _Builder()
    b.fwd_start(0.0, "act")
    h = b.pack(1.0, 1000, "act")
    b.fwd_end(1.0, "act")
    b.fwd_start(1.0, "drop")
    m = b.pack(1.5, 1000, "drop")
    b.fwd_end(2.0, "drop")
    b.fwd_start(2.0, "fc2")
    g = b.pack(2.5, 1000, "fc2", rebuild_from=h)
    b.fwd_end(3.0, "fc2")
    b.bwd_start(4.0, "")  # backward begins: the window's first walk
    b.bwd_start(6.0, "fc2")
    b.unpack(6.0, g)
    b.bwd_start(7.0, "drop")
    b.unpack(7.0, m)
    b.bwd_start(8.0, "act")
    b.unpack(8.0, h)
    trace = b.build(9.0)
    # A window of one family: at t=4 it takes m (packed last), back over [4, 5], not h. h's
    # reload starts at fc2's backward (the call that saved its rebuilt child), over [6, 7]: the
    # rebuild at t=6 waits 1 s for it (requested, so not a counted stall).
    sim = simulate(
        trace, _pointwise(_hw(1000.0)), {h: CPU, m: CPU, g: REBUILD}, prefetch_bytes=1000
    )
    assert sim.stall_s == pytest.approx(1.0) and sim.stalls == 0
    assert sim.step_s == pytest.approx(11.0)
    _check_accounting(sim)


def test_rebuild_needs_one_kept_or_moved_parent_of_the_step() -> None:
    b = _Builder()
    b.fwd_start(0.0, "m")
    w = b.pack(0.5, 1000, "m", param=True)
    a = b.pack(1.0, 1000, "m")
    child = b.pack(2.0, 1000, "m", rebuild_from=a)
    grandchild = b.pack(3.0, 1000, "m", rebuild_from=child)
    b.pack(4.0, 1000, "m", family=10, rebuild_from=a)
    b.pack(4.5, 1000, "m", family=10, rebuild_from=child)
    of_weight = b.pack(6.0, 1000, "m", rebuild_from=w)
    b.fwd_end(7.0, "m")
    b.bwd_start(8.0, "m")
    for seq in reversed(range(len(b.packs))):
        b.unpack(9.0, seq)
    trace = b.build(10.0)
    bad = {
        "family 1 cannot be rebuilt: its record 1 has no rebuild_from link": {a: REBUILD},
        "family 2 cannot be rebuilt: its parent family 1 is placed 'recompute'": {
            a: RECOMPUTE,
            child: REBUILD,
        },
        "family 3 cannot be rebuilt: its parent family 2 is placed 'rebuild'": {
            child: REBUILD,
            grandchild: REBUILD,
        },
        r"family 10 cannot be rebuilt: its records link to several families \[1, 2\]": {
            10: REBUILD
        },
        "family 6 cannot be rebuilt: its record 6 links to record 0, which is not an activation "
        "record of step 0": {of_weight: REBUILD},
    }
    for message, placements in bad.items():
        with pytest.raises(ValueError, match=message):
            simulate(trace, IDEAL, placements)
    # A rebuilt family's child can be kept, and a rebuild's parent moved.
    ok = simulate(trace, IDEAL, {a: CPU, child: REBUILD, grandchild: KEEP})
    assert ok.bytes_rebuilt == 1000 and ok.bytes_offloaded_cpu == 1000
    _check_accounting(ok)


def test_keep_all_peak_is_the_traced_peak_with_memory_outside_saved_tensors() -> None:
    # A GPU-like probe: base 10_000, plus a transient of 500 while "b" runs, plus saved bytes.
    trace = _lifo()
    live = dict(trace.live_saved_bytes())
    in_b = {4, 5, 6}
    events = tuple(
        dataclasses.replace(
            e, memory_bytes=10_000 + live[e.index] + (500 if e.index in in_b else 0)
        )
        for e in trace.events
    )
    trace = dataclasses.replace(trace, events=events)
    keep = simulate(trace, IDEAL)
    assert keep.base_bytes == 10_000
    assert keep.peak_bytes == trace.peak_memory_bytes == 12_500
    moved = simulate(trace, IDEAL, offload_all(trace), prefetch_bytes=0)
    assert moved.peak_bytes == 11_500  # the transient stays; one family at a time


def test_never_unpacked_family_is_not_reloaded() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    b.pack(1.0, 1000, "a")
    b.fwd_end(2.0, "a")
    trace = b.build(5.0)
    sim = simulate(trace, _hw(1000.0), offload_all(trace))
    assert sim.bytes_reloaded == 0 and sim.h2d_busy_s == 0.0
    assert sim.memory_timeline == ((0.0, 0), (1.0, 1000), (2.0, 0))


def test_alias_family_moves_once_and_is_started_by_any_members_module() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    first = b.pack(1.0, 1000, "a", family=7)
    b.fwd_end(2.0, "a")
    b.fwd_start(2.0, "b")
    second = b.pack(3.0, 1000, "b", family=7)
    b.fwd_end(4.0, "b")
    b.bwd_start(5.0, "b")  # b packed a member: its backward starts the family's reload
    b.unpack(6.0, second)
    b.unpack(8.0, first)
    trace = b.build(10.0)
    sim = simulate(trace, _hw(1000.0), {7: CPU}, prefetch_bytes=0)
    assert sim.bytes_offloaded_cpu == sim.bytes_reloaded == 1000
    assert sim.stalls == 0 and sim.stall_s == 0.0


def test_bandwidth_ladder_on_a_synthetic_trace_is_monotone() -> None:
    trace = _with_block()
    steps = [
        simulate(trace, _hw(bw), offload_all(trace), max_inflight_bytes=0).step_s
        for bw in (1e6, 1e4, 3e3, 1e3, 3e2)
    ]
    assert steps == sorted(steps) and steps[-1] > steps[0]


def test_bad_arguments_name_the_argument() -> None:
    trace = _lifo()
    with pytest.raises(TypeError, match="hardware"):
        simulate(trace, "h200")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trace"):
        simulate(object(), IDEAL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="placements"):
        simulate(trace, IDEAL, [CPU])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="family 99"):
        simulate(trace, IDEAL, {99: CPU})
    with pytest.raises(ValueError, match=r"placements\[0\].*placement must be one of"):
        simulate(trace, IDEAL, {0: "disk"})
    with pytest.raises(ValueError, match="step"):
        simulate(trace, IDEAL, step=1)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        simulate(trace, IDEAL, max_inflight_bytes=-1)
    with pytest.raises(ValueError, match="prefetch_bytes"):
        simulate(trace, IDEAL, prefetch_bytes="lots")
    with pytest.raises(ValueError, match="reload_event=9"):
        simulate(trace, IDEAL, {1: Decision(placement=CPU, reload_event=9)})  # after its unpack
    with pytest.raises(ValueError, match="tier"):
        offload_all(trace, tier="keep")


def test_decisions_reject_fields_that_do_not_apply() -> None:
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=KEEP, reload_event=3)
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=CPU, reload_event=-2)
    with pytest.raises(ValueError, match="recompute_module"):
        Decision(placement=CPU, recompute_module="blk")
    with pytest.raises(ValueError, match="reload_event"):
        Decision(placement=REBUILD, reload_event=3)  # a rebuild is never copied
    assert Decision(placement="nvme").placement is NVME  # type: ignore[arg-type]


def test_parameters_and_backward_packs_can_only_be_kept() -> None:
    b = _Builder()
    b.fwd_start(0.0, "a")
    w = b.pack(1.0, 1000, "a", param=True)
    b.fwd_end(2.0, "a")
    b.bwd_start(3.0, "a")
    again = b.pack(3.5, 1000, "a", in_backward=True)
    b.unpack(4.0, again)
    b.unpack(4.0, w)
    trace = b.build(5.0)
    with pytest.raises(ValueError, match="not an activation family"):
        simulate(trace, IDEAL, {w: CPU})
    with pytest.raises(ValueError, match="backward"):
        simulate(trace, IDEAL, {again: CPU})
    assert offload_all(trace) == {}
    assert simulate(trace, IDEAL).peak_bytes == 1000  # the backward pack counts; the weight not


def test_recompute_needs_an_enclosing_forward() -> None:
    b = _Builder()
    f = b.pack(1.0, 1000, "<outside>")
    b.unpack(2.0, f)
    trace = b.build(3.0)
    with pytest.raises(ValueError, match="no forward of '<outside>'"):
        simulate(trace, IDEAL, {f: RECOMPUTE})
    with pytest.raises(ValueError, match="'nowhere'"):
        simulate(trace, IDEAL, {f: Decision(placement=RECOMPUTE, recompute_module="nowhere")})


def test_window_can_queue_ahead_of_a_family_still_going_out() -> None:
    # The executor's behaviour, modelled as it is: f1 (needed first) is still going out when
    # backward begins; a window that reaches f0 queues f0's reload before f1's can start.
    b = _Builder()
    b.fwd_start(0.0, "a")
    f0 = b.pack(1.0, 1000, "a")
    b.fwd_end(2.0, "a")
    b.fwd_start(3.0, "b")
    f1 = b.pack(4.0, 1000, "b")
    b.fwd_end(4.0, "b")
    b.bwd_start(4.5, "b")
    b.unpack(6.0, f1)
    b.bwd_start(6.5, "a")
    b.unpack(8.0, f0)
    trace = b.build(9.0)
    # 1000 B/s: f0 out over [1, 2], f1 over [4, 5]; backward begins at 4.5.
    small = simulate(trace, _hw(1000.0), offload_all(trace), prefetch_bytes=1000)
    large = simulate(trace, _hw(1000.0), offload_all(trace), prefetch_bytes=2000)
    # Small window: f1 (deferred to 5) comes back over [5, 6]; f0 over [6.5, 7.5]: in time.
    assert small.stall_s == 0.0
    # Large window: f0 comes back over [4.5, 5.5], f1 only over [5.5, 6.5]: half a second late.
    assert large.stall_s == pytest.approx(0.5)


def test_a_reload_lives_for_one_backward_of_a_step_with_two() -> None:
    """Two backwards of one graph in a step: the k-th unpack of a record is backward pass k, and
    a reload dies after its family's last unpack of a pass (NOTE [ Backward passes ]). The
    simulator held each reload to its last use in the second backward: offloading everything
    peaked at 524,288 B, 8 of the 9 families of 65,536 B, back by the end of the first backward.
    Now it peaks as a single backward does, at 196,608."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
    x = torch.randn(64, 256)

    def step(twice: bool) -> None:
        y = model(x)
        y.pow(2).mean().backward(retain_graph=twice)
        if twice:
            y.sum().backward()

    hw = HardwareModel.h200()
    two = offload.profile(lambda: step(True), model, warmup_steps=0)
    one = offload.profile(lambda: step(False), model, warmup_steps=0)
    peaks = [simulate(t, hw, offload_all(t, rebuild=False)).peak_bytes for t in (one, two)]
    assert peaks == [196_608, 196_608]
    # Where each pass-0 trigger fires again in the second backward: an unpack at its record's
    # second unpack, a module's backward start right after the unpack before that one.
    from offload.lifecycle._trace import BackwardPasses

    passes = BackwardPasses(two.records)
    assert passes.count == 2
    by_seq = {r.seq: r for r in two.records}
    for r in two.records:
        if len(r.unpack_events) == 2:
            assert passes.again(r.unpack_events[0], 1) == r.unpack_events[1]
            assert passes.of_family([r.seq]) == tuple((u, u) for u in r.unpack_events)
    starts = [e for e in two.events if e.kind is EventKind.BACKWARD_START and e.module == "6"]
    (start,) = starts
    u6 = min(by_seq[s].unpack_events[1] for s in by_seq if by_seq[s].module == "6")
    assert passes.again(start.index, 1) == u6 - 1  # right after module 7's second unpack
    assert two.events[u6 - 1].kind is EventKind.BACKWARD_END
