"""The lifecycle recorder against an oracle: identity hooks that keep every saved tensor alive.

While every packed tensor is kept alive no address can be reused, so the oracle may group alias
families by ``data_ptr`` (and version counter, seen by bumping it) and measure spans from real
addresses: an implementation independent of the recorder's storage-object keys and its span
arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from models import ALL_MODELS, ModelCase, checkpointed, gpt_block, lstm, mlp, views_model
from torch import nn

import offload
from offload.lifecycle import EventKind, Recorder, Trace


class Oracle:
    """saved_tensors_hooks that keep every packed tensor and log unpacks by pack index."""

    def __init__(self) -> None:
        self.packed: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.views: list[bool] = []
        self.unpacks: list[int] = []

    def pack(self, t: torch.Tensor) -> int:
        self.packed.append(t.detach())
        self.versions.append(t._version)
        self.views.append(t._is_view())
        return len(self.packed) - 1

    def unpack(self, i: int) -> torch.Tensor:
        self.unpacks.append(i)
        return self.packed[i]

    def run(self, case: ModelCase) -> Oracle:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            case.step()
        return self

    def families(self) -> list[set[int]]:
        """Pack indices grouped by storage address, version at pack and version counter. Which
        tensors share a counter is seen, not derived: bump one member's counter (the step is
        over; only these copies remain) and see whose version moves. Pieces made by
        ``unsafe_chunk`` share a storage but not a counter."""
        ptrs = [t.untyped_storage().data_ptr() for t in self.packed]
        out: list[set[int]] = []
        placed: set[int] = set()
        for i, t in enumerate(self.packed):
            if i in placed:
                continue
            same = [
                j
                for j in range(i, len(self.packed))
                if j not in placed and ptrs[j] == ptrs[i] and self.versions[j] == self.versions[i]
            ]
            before = [self.packed[j]._version for j in same]
            torch._C._increment_version([t])
            members = {j for j, v in zip(same, before, strict=True) if self.packed[j]._version != v}
            out.append(members)
            placed |= members
        return out

    def copy_bytes(self, idxs: set[int]) -> int:
        """What the offloader copies for the family: the whole storage when its first member is
        a view spanning at least a quarter of it (NOTE [ Alias handling ]), else the span."""
        first = min(idxs)
        members = [self.packed[i] for i in sorted(idxs)]
        whole = members[0].untyped_storage().nbytes()
        if self.views[first] and members[0].numel() and whole <= 4 * self.span_bytes(members[:1]):
            return whole
        return self.span_bytes(members)

    def span_bytes(self, members: list[torch.Tensor]) -> int:
        lo = min(t.data_ptr() for t in members if t.numel())
        hi = max(
            t.data_ptr()
            + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))
            * t.element_size()
            for t in members
            if t.numel()
        )
        return hi - lo


def param_ptrs(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}


def record_case(case: ModelCase, **kwargs) -> Trace:
    return offload.profile(case.step, case.model, warmup_steps=0, **kwargs)


REQUIRED = ["mlp", "gpt_block", "conv_net", "lstm"]


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_records_match_oracle(name: str) -> None:
    trace = record_case(ALL_MODELS[name](seed=0))
    case = ALL_MODELS[name](seed=0)
    oracle = Oracle().run(case)
    recs = trace.records
    assert len(recs) == len(oracle.packed) > 0
    params = param_ptrs(case.model)
    for r, t in zip(recs, oracle.packed, strict=True):
        assert r.shape == tuple(t.shape)
        assert r.stride == tuple(t.stride())
        assert r.storage_offset == t.storage_offset()
        assert r.dtype == str(t.dtype)
        assert r.nbytes == t.numel() * t.element_size()
        assert r.storage_nbytes == t.untyped_storage().nbytes()
        assert r.is_parameter == (t.untyped_storage().data_ptr() in params), r
    # Unpacks: the same records, in the same order.
    unpack_order = [e.record for e in trace.events if e.kind is EventKind.UNPACK]
    assert unpack_order == oracle.unpacks
    # Alias families: the same partition of records.
    by_oracle = dict(enumerate(oracle.families()))
    by_trace = {f.family: set(f.records) for f in trace.families()}
    assert sorted(map(sorted, by_trace.values())) == sorted(map(sorted, by_oracle.values()))
    # Bytes: each activation storage once, as the span its members cover (from real addresses),
    # or the whole storage where the offloader copies that.
    expected = 0
    for idxs in by_oracle.values():
        if oracle.packed[min(idxs)].untyped_storage().data_ptr() not in params:
            expected += oracle.copy_bytes(idxs)
    assert trace.saved_bytes == expected


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_lifetimes_consistent(name: str) -> None:
    trace = record_case(ALL_MODELS[name](seed=0))
    events = trace.events
    first_unpack = min((e.index for e in events if e.kind is EventKind.UNPACK), default=len(events))
    prev = -1
    for r in trace.records:
        assert events[r.pack_event].kind is EventKind.PACK and events[r.pack_event].record == r.seq
        assert r.pack_event > prev  # packs in forward order
        prev = r.pack_event
        if not r.in_backward:
            assert r.pack_event < first_unpack  # every forward pack comes before backward
        assert list(r.unpack_events) == sorted(r.unpack_events)
        for u, ts in zip(r.unpack_events, r.unpack_times_s, strict=True):
            assert u > r.pack_event
            assert ts >= r.pack_time_s
            assert events[u].kind is EventKind.UNPACK and events[u].record == r.seq
        assert r.lifetime_s >= 0
    times = [e.time_s for e in events]
    assert times == sorted(times) and times[0] == 0.0


@pytest.mark.parametrize("name", REQUIRED)
def test_recording_leaves_gradients_bitwise_equal(name: str) -> None:
    ref = ALL_MODELS[name](seed=0)
    ref.step()
    case = ALL_MODELS[name](seed=0)
    record_case(case)
    got, want = case.grads(), ref.grads()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_mlp_module_attribution_and_transposed_weights() -> None:
    case = mlp(seed=0)
    x, y = case.batch()
    x.requires_grad_(True)  # so the first Linear also saves weight.t()
    names = {n for n, _ in case.model.named_modules()}

    def step() -> None:
        case.model.zero_grad()
        nn.functional.cross_entropy(case.model(x), y).backward()

    trace = offload.profile(step, case.model, warmup_steps=0)
    linears = [n for n, m in case.model.named_modules() if isinstance(m, nn.Linear)]
    weight_views = [r for r in trace.records if r.is_parameter]
    # Every Linear saves its weight transposed (a view, not the Parameter object): all flagged.
    assert sorted(r.module for r in weight_views) == sorted(linears)
    assert all(r.grad_fn == "TBackward0" for r in weight_views)
    for r in trace.records:
        assert r.module in names or r.module == "<outside>"
    # key = (module, call index, ordinal) is unique within a step
    assert len({r.key for r in trace.records}) == len(trace.records)


def test_views_share_one_family() -> None:
    trace = record_case(views_model(seed=0))
    counts = trace.alias_counts()
    assert max(counts.values()) >= 3, counts
    fams = {f.family: f for f in trace.families()}
    for fam, n in counts.items():
        if n > 1:
            f = fams[fam]
            members = [trace.records[s] for s in f.records]
            assert {m.storage_nbytes for m in members} == {f.storage_nbytes}
            assert f.span_bytes <= f.storage_nbytes
    # Counted once: less than the sum over records.
    assert trace.saved_bytes < sum(r.nbytes for r in trace.activation_records)


def test_version_change_starts_new_family() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            a = h * h  # saves h at version 0 (twice: both operands)
            h.mul_(2)  # a later in-place op changes h's version
            b = h.sigmoid() * h  # saves h at version 1
            return a.sum() + b.sum()

    m = M()
    x = torch.randn(8, 32)
    trace = offload.profile(lambda: m(x).backward(), m, warmup_steps=0)
    h_records = [r for r in trace.activation_records if r.shape == (8, 32) and r.module == ""]
    fams = [r.family for r in h_records]
    assert len(set(fams)) >= 2  # same storage, two versions: two families


def test_retain_graph_logs_every_unpack() -> None:
    case = mlp(seed=0)

    def step() -> None:
        loss = case.loss(case.batch())
        loss.backward(retain_graph=True)
        loss.backward()

    trace = offload.profile(step, case.model, warmup_steps=0)
    used = [r for r in trace.records if r.unpack_events]
    assert used and all(len(r.unpack_events) == 2 for r in used)


def test_double_backward_packs_flagged() -> None:
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def step() -> None:
        y = torch.tanh(lin(x)).pow(2).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.pow(2).sum().backward()

    trace = offload.profile(step, lin, warmup_steps=0)
    assert any(r.in_backward for r in trace.records)
    assert any(not r.in_backward for r in trace.records)


def test_checkpoint_region_shows_only_its_inputs() -> None:
    plain = record_case(checkpointed(seed=0))
    case = checkpointed(seed=0)
    # The same model with no block checkpointed saves more.
    for m in case.model.modules():
        if hasattr(m, "checkpointed"):
            m.checkpointed = ()
    full = record_case(case)
    assert len(plain.records) < len(full.records)


def test_calls_a_checkpoint_recomputation_leaves_unfinished_end_with_its_backward() -> None:
    """Non-reentrant checkpoint stops recomputing early, so recomputed calls never end; their
    stack entries stayed, and a second forward in the step had its packs outside any module
    named after one of them ('blocks.0.fc2', call 1). Now both pairs' loss packs are
    '<outside>'."""
    from models import Checkpointed

    torch.manual_seed(0)
    model = Checkpointed(checkpointed=(0, 1, 2))
    x = torch.randn(32, 64, requires_grad=True)

    def two_pairs() -> None:
        for _ in range(2):
            model(x).pow(2).sum().backward()

    trace = offload.profile(two_pairs, model, warmup_steps=0)
    outside = [r for r in trace.records if r.module == "<outside>"]
    assert [r.ordinal for r in outside] == [0, 1]
    assert not any(r.module.startswith("blocks") and r.call_index == 1 for r in trace.records)


class Aside(nn.Module):
    """An identity that first runs ``aside`` (when set): work done in the middle of a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.aside: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.aside is not None:
            self.aside()
        return x


def on_another_thread(fn: Callable[[], object]) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def forward_starts(trace: Trace) -> list[tuple[str, int]]:
    return [(e.module, e.call_index) for e in trace.events if e.kind is EventKind.FORWARD_START]


def test_another_threads_module_calls_are_not_the_steps() -> None:
    """An evaluation or data thread calling a submodule while a step runs: the recorder listens
    to the step's thread only, so the step's trace is the one it has alone (before, that call
    was recorded too and the step's own call of the module became call 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(Aside(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(8, 16)
    alone = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    aside = model[1](torch.randn(4, 16, requires_grad=True))
    model[0].aside = lambda: on_another_thread(
        lambda: model[1](torch.randn(4, 16, requires_grad=True)).sum()
    )
    trace = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    assert forward_starts(trace) == forward_starts(alone)
    assert [r.key for r in trace.records] == [r.key for r in alone.records]
    assert [(e.kind, e.module) for e in trace.events] == [(e.kind, e.module) for e in alone.events]
    assert aside.shape == (4, 32)


def test_a_backward_on_another_thread_is_still_the_steps() -> None:
    """Calls from inside a backward count on any thread (on CUDA backward runs on autograd's
    device thread): a checkpointed block's recomputation, run by a backward started on another
    thread, is recorded as when the step's thread runs it."""
    same = record_case(checkpointed(seed=0))
    case = checkpointed(seed=0)

    def step() -> None:
        loss = case.loss(case.batch())
        on_another_thread(loss.backward)

    trace = offload.profile(step, case.model, warmup_steps=0)
    assert forward_starts(trace) == forward_starts(same)
    assert len(forward_starts(same)) > len({m for m, _ in forward_starts(same)})  # recomputed
    assert [(r.key, r.in_backward) for r in trace.records] == [
        (r.key, r.in_backward) for r in same.records
    ]


def test_warmup_steps_are_discarded_and_steps_recorded() -> None:
    case = gpt_block(seed=0)
    one = record_case(gpt_block(seed=0))
    trace = offload.profile(case.step, case.model, warmup_steps=2, steps=3)
    assert trace.steps == 3
    per_step = [sum(1 for r in trace.records if r.step == s) for s in range(3)]
    assert per_step == [len(one.records)] * 3
    assert [e.step for e in trace.events if e.kind is EventKind.STEP_START] == [0, 1, 2]
    # Keys repeat step after step (what a plan is matched on).
    keys = [[r.key for r in trace.records if r.step == s] for s in range(3)]
    assert keys[0] == keys[1] == keys[2]


def test_module_spans_forward_and_backward() -> None:
    trace = record_case(gpt_block(seed=0))
    spans = trace.module_spans()
    fwd = {(s.module, s.call_index) for s in spans if s.phase == "forward"}
    bwd = {(s.module, s.call_index) for s in spans if s.phase == "backward"}
    assert ("", 0) in fwd
    assert bwd and bwd <= fwd
    for s in spans:
        assert s.duration_s >= 0
        assert s.start_event < s.end_event


@pytest.mark.parametrize("through", ["dropout0", "identity", "dropout_eval"])
def test_a_module_handing_back_its_input_has_an_empty_backward_span(through: str) -> None:
    """Dropout(0.0), Identity or Dropout in eval mode return their input: its node is the one
    before them, whose pre-hook fires after that input's gradient is known. Their backward is an
    empty span where that node's backward starts (where offload's executor triggers for them),
    not an end before the start left open to the end of the step. An in-place ReLU returns its
    input too, with a node of its own: its span holds its own unpack."""
    torch.manual_seed(0)
    mid = {"dropout0": nn.Dropout(0.0), "identity": nn.Identity(), "dropout_eval": nn.Dropout(0.5)}
    model = nn.Sequential(
        nn.Linear(8, 8), mid[through], nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8)
    )
    model.train()
    model[1].train(through != "dropout_eval")
    x = torch.randn(4, 8)
    trace = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    ends = [e for e in trace.events if e.kind is EventKind.BACKWARD_END and e.module == "1"]
    assert len(ends) == 1
    span = {s.module: s for s in trace.module_spans() if s.phase == "backward"}
    assert span["1"].end_event == span["1"].start_event + 1 == ends[0].index
    # It sits where Linear 0's backward starts, and its step goes on after it.
    assert span["1"].start_event == span["0"].start_event + 1
    assert span["1"].end_event < trace.events[-1].index
    (relu,) = [r for r in trace.records if r.module == "3"]
    assert span["3"].start_event < relu.unpack_events[0] < span["3"].end_event


def test_a_compiled_module_answers_for_the_state_its_subtree_changes() -> None:
    """A compiled module is a leaf (no hooks inside it): a BatchNorm in training within it, or
    a buffer its forward changes, names the leaf stateful (it went unnamed: a plan could have
    recomputed the block and updated the running statistics twice)."""
    torch.manual_seed(0)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())

    model = nn.Sequential(nn.Linear(16, 16), torch.compile(block(), backend="eager"), block())
    x = torch.randn(8, 16)
    trace = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    assert trace.metadata["stateful_modules"] == ["1", "2.1"]


def test_lstm_records_and_unpacks() -> None:
    trace = record_case(lstm(seed=0))
    assert trace.activation_records
    assert all(r.unpack_events for r in trace.activation_records if r.nbytes >= 4096)


def test_live_saved_bytes_and_memory_curve_on_cpu() -> None:
    trace = record_case(mlp(seed=0))
    live = trace.live_saved_bytes()
    assert live[0][1] == 0 and live[-1][1] == 0
    assert trace.peak_saved_bytes == max(b for _, b in live) > 0
    # On CPU the memory probe is the live saved curve itself.
    assert [e.memory_bytes for e in trace.events] == [b for _, b in live]
    # Forward only grows the curve; backward only shrinks it.
    first_unpack = next(e.index for e in trace.events if e.kind is EventKind.UNPACK)
    fwd = [b for i, b in live if i < first_unpack]
    assert fwd == sorted(fwd)
    assert trace.peak_saved_bytes <= trace.saved_bytes


def test_injected_clock_and_memory_probe() -> None:
    ticks = iter(range(10_000))

    class Clock:
        def stamp(self) -> int:
            return next(ticks)

        def seconds(self, stamps):
            return [float(s - stamps[0]) for s in stamps]

    calls = []

    def probe() -> int:
        calls.append(1)
        return 1000 + len(calls)

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    rec = Recorder(clock=Clock(), memory_probe=probe)
    with rec.attach(model), rec.hooks():
        rec.begin_step()
        model(torch.randn(2, 8)).sum().backward()
        rec.end_step()
    trace = rec.trace()
    assert [e.time_s for e in trace.events] == [float(i) for i in range(len(trace.events))]
    assert [e.memory_bytes for e in trace.events] == list(range(1001, 1001 + len(trace.events)))
    assert trace.metadata["memory_probe"] == "probe"


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="step_fn"):
        offload.profile(3, nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        offload.profile(lambda: None, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_steps"):
        offload.profile(lambda: None, nn.Linear(2, 2), warmup_steps=-1)
    with pytest.raises(ValueError, match="steps"):
        offload.profile(lambda: None, nn.Linear(2, 2), steps=0)
    # Another type than int is a TypeError naming the argument (a ValueError before; and
    # Recorder took max_steps=True as 1).
    for kw, named in (
        ({"warmup_steps": 1.5}, "warmup_steps must be an int >= 0; got float 1.5"),
        ({"warmup_steps": True}, "warmup_steps must be an int >= 0; got bool True"),
        ({"steps": 2.0}, "steps must be an int >= 1; got float 2.0"),
    ):
        with pytest.raises(TypeError, match=named):
            offload.profile(lambda: None, nn.Linear(2, 2), **kw)
    with pytest.raises(TypeError, match="max_steps must be an int >= 0; got bool"):
        Recorder(max_steps=True)
    with pytest.raises(TypeError, match="warmup_steps must be an int >= 0; got float"):
        Recorder(warmup_steps=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="boundary"):
        Recorder(boundary="sometimes")
    with pytest.raises(TypeError, match="clock"):
        Recorder(clock=object())  # type: ignore[arg-type]


def test_step_fn_exception_propagates_and_hooks_are_removed() -> None:
    model = nn.Linear(4, 4)

    def boom() -> None:
        model(torch.randn(2, 4)).sum()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        offload.profile(boom, model, warmup_steps=0)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_gc_paused_only_while_a_step_is_recorded() -> None:
    import gc

    seen = []
    model = nn.Linear(4, 4)

    def step() -> None:
        seen.append(gc.isenabled())
        model(torch.randn(2, 4)).sum().backward()

    assert gc.isenabled()
    offload.profile(step, model, warmup_steps=1, steps=2)
    assert seen == [True, False, False]  # the warm-up step is not recorded
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        offload.profile(lambda: (_ for _ in ()).throw(RuntimeError("x")), model, warmup_steps=0)
    assert gc.isenabled()


def test_autocast_weight_casts_are_recorded_as_parameters() -> None:
    """The bf16 cast of a weight a Linear saves under autocast is made again from the parameter
    at unpack (offload never stores it), so an offline profile records it as a parameter, as the
    manager's own profile does: the same activations, and plans over the same families."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()

    trace = offload.profile(step, model, warmup_steps=0)
    casts = [r for r in trace.records if r.dtype == "torch.bfloat16" and r.grad_fn == "TBackward0"]
    # The second Linear's weight cast (the first Linear's input needs no gradient, so its
    # weight cast is not saved).
    assert len(casts) == 1 and all(r.is_parameter for r in casts)
    activations = {f.family for f in trace.families() if not f.is_parameter}
    assert not activations & {r.family for r in casts}
    mgr = offload.ActivationOffloader(
        model, gpu_budget=1 << 30, min_offload_bytes=0, hardware=offload.HardwareModel.h200()
    )
    try:
        for _ in range(2):
            with mgr:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
            loss.backward()
        planned = mgr.plan
    finally:
        mgr.close()
    offline = offload.plan(
        trace, 1 << 30, offload.HardwareModel.h200(), min_offload_bytes=0, margin=0
    )
    assert planned is not None
    assert sorted(e.keys for e in planned.entries) == sorted(e.keys for e in offline.entries)
    assert trace.saved_bytes == sum(e.nbytes for e in offline.entries)


def test_family_spans_are_what_the_offloader_copies(tmp_path) -> None:
    """A family whose first member is a view spanning at least a quarter of its storage counts
    the whole storage, as the executor copies it (NOTE [ Alias handling ]); a smaller slice, and
    a piece that is no view (``unsafe_chunk``), count their own span. Before, the trace counted
    ``x[:, :-1]`` of a (16, 65) float32 storage by its span, 4,156 B, 4 short of the storage the
    manager moves."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            most = self.lin(x[:, :-1])  # saves the view: 64 of 65 columns
            few = (x * 1)[:4, :64].sin()  # saves the view: its span is just under a quarter
            pieces = torch.unsafe_chunk(torch.tanh(x[:15, :63] * 1), 3, dim=0)  # no views
            return most.sum() + few.sum() + sum(p.sin().sum() for p in pieces)

    m = M()
    x = torch.randn(16, 65, requires_grad=True)
    trace = offload.profile(lambda: m(x).backward(), m, warmup_steps=0)
    spans = {}
    for f in trace.families():
        spans.setdefault(trace.records[f.records[0]].shape, []).append(f.span_bytes)
    assert spans[(16, 64)] == [16 * 65 * 4]  # the whole storage
    assert spans[(4, 64)] == [(3 * 65 + 64) * 4]  # its own span
    assert spans[(5, 63)] == [5 * 63 * 4] * 3  # each piece its own
    trace.save(tmp_path / "t.json")  # the records say which were views
    assert Trace.load(tmp_path / "t.json").families() == trace.families()


def test_a_module_compiled_again_is_still_recorded_as_itself() -> None:
    """``mod.compile()`` again after the recorder attached replaces the compiled call its hooks
    ran around, and its hooks stopped: in the second step the block's 4 records took the root's
    name (``""``) instead of ``"1"``. Each step now puts the hooks back around the new call."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
    model = nn.Sequential(nn.Linear(16, 16), block)
    block.compile(backend="eager")
    x = torch.randn(8, 16)
    rec = Recorder()
    with rec.attach(model), rec.hooks():
        for _ in range(2):
            rec.begin_step()
            model(x).sum().backward()
            rec.end_step()
            block.compile(backend="eager")
    compiled_call = block._compiled_call_impl
    trace = rec.trace()
    by_step = [sorted(r.module for r in trace.activation_records if r.step == s) for s in (0, 1)]
    assert by_step[0] == by_step[1] == ["0", "1", "1", "1", "1"]
    # Detached, the module keeps its latest compiled call.
    assert block._compiled_call_impl is compiled_call


def test_hooks_added_after_a_module_is_compiled_again_join_the_earlier_ones() -> None:
    """One recorder attached, ``mod.compile()`` again, a second recorder attached: the second's
    hooks join the first's around the new compiled call. (Given a wrapper of their own, each
    recorder putting its wrapper back at its step's start made the two wrap each other, and
    the next forward recursed until RecursionError.) Both see the block in both steps."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    model = nn.Sequential(nn.Linear(16, 16), block)
    block.compile(backend="eager")
    x = torch.randn(8, 16)
    first, second = Recorder(), Recorder()
    with first.attach(model):
        block.compile(backend="eager")
        with second.attach(model), second.hooks():
            for _ in range(2):
                first.begin_step()
                second.begin_step()
                model(x).sum().backward()
                second.end_step()
                first.end_step()
    for rec in (first, second):
        spans = [s for s in rec.trace().module_spans() if s.module == "1" and s.phase == "forward"]
        assert len(spans) == 2
