"""Trace: JSON round trip, derived facts on a hand-built trace, exports."""

from __future__ import annotations

import dataclasses
import errno
import json
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from models import gpt_block, views_model
from torch import nn

import offload
from offload import lifecycle
from offload.lifecycle import (
    SCHEMA_VERSION,
    Event,
    EventKind,
    TensorRecord,
    Trace,
    transformer_trace,
    write_memory_png,
    write_perfetto,
)


def _rec(
    seq: int,
    family: int,
    nbytes: int,
    pack: int,
    unpacks: tuple[int, ...],
    *,
    offset: int = 0,
    param: bool = False,
    module: str = "m",
) -> TensorRecord:
    n = nbytes // 4
    return TensorRecord(
        seq=seq,
        step=0,
        family=family,
        module=module,
        call_index=0,
        ordinal=seq,
        nbytes=nbytes,
        storage_nbytes=4096,
        storage_offset=offset,
        shape=(n,),
        stride=(1,),
        dtype="torch.float32",
        device="cpu",
        is_parameter=param,
        grad_fn="",
        in_backward=False,
        pack_event=pack,
        pack_time_s=float(pack),
        unpack_events=unpacks,
        unpack_times_s=tuple(float(u) for u in unpacks),
    )


def _synthetic() -> Trace:
    """Timeline 0..9: three families; family 1 has two views (bytes 0-1023 and 512-2047)."""
    kinds = {
        0: EventKind.STEP_START,
        9: EventKind.STEP_END,
        1: EventKind.PACK,
        2: EventKind.PACK,
        3: EventKind.PACK,
        4: EventKind.PACK,
    }
    recs = (
        _rec(0, 0, 1000, 1, (8,)),
        _rec(1, 1, 1024, 2, (6,)),
        _rec(2, 1, 1536, 3, (7,), offset=128),
        _rec(3, 2, 512, 4, (5,), param=True),
    )
    record_of = {1: 0, 2: 1, 3: 2, 4: 3, 5: 3, 6: 1, 7: 2, 8: 0}
    events = tuple(
        Event(
            index=i,
            kind=kinds.get(i, EventKind.UNPACK),
            step=0,
            time_s=float(i),
            memory_bytes=0,
            record=record_of.get(i, -1),
        )
        for i in range(10)
    )
    return Trace(records=recs, events=events, steps=1)


def test_derived_facts_by_hand() -> None:
    t = _synthetic()
    fams = {f.family: f for f in t.families()}
    assert fams[1].span_bytes == 128 * 4 + 1536  # views at bytes [0, 1024) and [512, 2048)
    assert fams[1].records == (1, 2)
    assert t.saved_bytes == 1000 + 2048  # the parameter family is not an activation
    live = dict(t.live_saved_bytes())
    # family 0 lives over events 1..8, family 1 over 2..7
    assert [live[i] for i in range(10)] == [0, 1000, 3048, 3048, 3048, 3048, 3048, 3048, 1000, 0]
    assert t.peak_saved_bytes == 3048
    assert t.alias_counts() == {0: 1, 1: 2}
    assert t.bytes_by_module() == {"m": 3048}
    assert sorted(t.lifetimes_s()) == [4.0, 4.0, 7.0]


def test_records_must_be_in_order() -> None:
    t = _synthetic()
    with pytest.raises(ValueError, match="seq"):
        Trace(records=tuple(reversed(t.records)), events=t.events)
    # A rebuild link names an earlier record (the input its activation saved before it).
    for link in (1, 5, -2):
        linked = (t.records[0], dataclasses.replace(t.records[1], rebuild_from=link))
        with pytest.raises(ValueError, match=f"record 1's rebuild_from .* got {link}"):
            Trace(records=(*linked, *t.records[2:]), events=t.events)
    ok = (t.records[0], dataclasses.replace(t.records[1], rebuild_from=0), *t.records[2:])
    assert Trace(records=ok, events=t.events).records[1].rebuild_from == 0


def test_json_round_trip_is_exact(tmp_path) -> None:
    trace = offload.profile(gpt_block(seed=0).step, gpt_block(seed=0).model, warmup_steps=0)
    case = views_model(seed=0)
    trace2 = offload.profile(case.step, case.model, warmup_steps=0, steps=2)
    for i, t in enumerate((trace, trace2, _synthetic())):
        p = tmp_path / f"t{i}.json"
        t.save(p)
        back = Trace.load(p)
        assert back == t
        assert back.summary() == t.summary()
        assert json.loads(p.read_text())["schema_version"] == SCHEMA_VERSION


def test_load_rejects_other_files(tmp_path) -> None:
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Trace.load(p)
    p.write_text("[" * 100_000)  # the parser's recursion runs out first
    with pytest.raises(ValueError, match="nested too deeply"):
        Trace.load(p)
    p.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an offload trace"):
        Trace.load(p)
    d = _synthetic().to_dict()
    d["schema_version"] = SCHEMA_VERSION + 1
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="schema_version"):
        Trace.load(p)
    with pytest.raises(FileNotFoundError):
        Trace.load(tmp_path / "missing.json")


_DELETE = object()


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        (("records",), _DELETE, r"missing the field\(s\) 'records'"),
        (("records", 1, "foo"), 1, r"records\[1\]: .*unexpected keyword argument 'foo'"),
        (("records", 1, "shape"), None, r"records\[1\]: field 'shape' must be a list; got None"),
        (("records", 2), 7, r"records\[2\]: expected a JSON object; got int"),
        (("events", 3, "kind"), _DELETE, r"events\[3\]: missing the field 'kind'"),
        (("steps",), None, "'steps' must be an int >= 0; got None"),
        (("metadata",), ["device", "cpu"], "'metadata' must be a JSON object; got list"),
        # Indices into the timeline and the records must point at something.
        (("records", 1, "pack_event"), 10**6, r"record 1: pack_event 1000000 is not an event"),
        (("records", 1, "unpack_events"), [10], r"record 1: unpack_events 10 is not an event"),
        (("events", 2, "record"), 4, r"event 2: record 4 is not a record's seq in \[0, 4\)"),
        (("records", 1, "pack_event"), "2", r"records\[1\]: field 'pack_event' must be an int"),
        # Every field holds what it must (each of these loaded, and offload plan then crashed
        # or planned from nonsense).
        (("records", 1, "pack_event"), 3.5, r"records\[1\]: field 'pack_event' must be an int"),
        (("records", 1, "seq"), True, r"records\[1\]: field 'seq' must be an int \(not a bool"),
        (("records", 1, "nbytes"), -4096, r"records\[1\]: field 'nbytes' must be an int in \[0, "),
        (("records", 1, "nbytes"), 1.5, r"records\[1\]: field 'nbytes' must be an int"),
        (("records", 1, "nbytes"), 10**30, r"field 'nbytes' must be an int in \[0, 2\*\*63\)"),
        (
            ("records", 1, "module"),
            None,
            r"records\[1\]: field 'module' must be a string; got None",
        ),
        (("records", 1, "dtype"), "torch.nonsense", "'torch.nonsense' is not a torch dtype"),
        (("records", 1, "device"), "gpu0", "field 'device' 'gpu0' is not a torch device"),
        (("metadata",), {"device": "cuda:x"}, "metadata 'device' 'cuda:x' is not a torch device"),
        (("records", 1, "is_parameter"), "no", "field 'is_parameter' must be true or false"),
        (("records", 1, "shape"), ["a"], "field 'shape' must be a list of ints >= 0"),
        (("records", 1, "stride"), [1, 1], "field 'stride' must be a list of ints as long as"),
        (("records", 1, "pack_time_s"), float("nan"), "'pack_time_s' must be a finite number"),
        (("records", 1, "unpack_times_s"), [], r"'unpack_times_s' must be .* one per unpack"),
        (("events", 5, "time_s"), "x", r"events\[5\]: field 'time_s' must be a finite number"),
        (("events", 5, "time_s"), float("nan"), r"events\[5\]: field 'time_s' must be a finite"),
        (("events", 5, "time_s"), float("inf"), r"events\[5\]: field 'time_s' must be a finite"),
        (("events", 3, "memory_bytes"), "x", r"events\[3\]: field 'memory_bytes' must be an int"),
        (("events", 3, "memory_bytes"), -1, r"events\[3\]: field 'memory_bytes' must be an int"),
        (("events", 3, "record"), 0.5, r"events\[3\]: field 'record' must be an int"),
        # Records and events agree (each of these loaded and was planned).
        (("records", 1, "pack_event"), 3, "record 1: pack_event 3 is not its pack .*record 2"),
        (("records", 1, "pack_event"), 0, "record 1: pack_event 0 is not its pack .*step_start"),
        (("records", 1, "unpack_events"), [7], "record 1: unpack event 7 is not an unpack of it"),
        (("events", 9, "kind"), "unpack", r"'steps' is 1, but the events end 0 step\(s\)"),
        (("events", 5, "step"), 1, "event 6: step 0 after step 1; steps are in order"),
        (("events", 5, "time_s"), 0.0, r"event 5: time_s 0.0 is before the event before"),
        (("records", 1, "pack_time_s"), 0.0, "record 1: pack_time_s or unpack_times_s differ"),
        (("records", 1, "unpack_times_s"), [9.0], "record 1: pack_time_s or unpack_times_s"),
    ],
)
def test_load_names_what_is_wrong_in_the_body(
    tmp_path, where: tuple, value: object, named: str
) -> None:
    """A file with a trace's header but a malformed body fails at load with a ``ValueError`` that
    names what is wrong (not a ``KeyError``, ``TypeError`` or ``IndexError`` from deep inside)."""
    d = _synthetic().to_dict()
    *parents, last = where
    target = d
    for k in parents:
        target = target[k]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=named):
        Trace.load(p)


def test_summary_names_the_facts() -> None:
    case = views_model(seed=0)
    s = offload.profile(case.step, case.model, warmup_steps=0).summary()
    for needle in (
        "activation bytes saved per step",
        "peak live saved bytes",
        "top modules",
        "lifetime",
        "aliasing",
    ):
        assert needle in s
    # Aliasing is per step, as the lines above it: two recorded steps read as one.
    two = offload.profile(case.step, case.model, warmup_steps=0, steps=2).summary()
    alias = [line for line in s.splitlines() if "aliasing" in line]
    assert alias and alias == [line for line in two.splitlines() if "aliasing" in line]


def test_repr_counts_rather_than_lists() -> None:
    """A trace's repr (a notebook cell, a log line) gives counts, not every record and event."""
    trace = transformer_trace(layers=2, hidden=64, tokens=64)
    text = repr(trace)
    assert text == (
        f"Trace(steps=1, records={len(trace.records)}, events={len(trace.events)}, "
        f"saved_bytes={trace.saved_bytes}, device={trace.metadata.get('device', '?')!r})"
    )
    assert len(text) < 200 and len(trace.records) > 20


def test_summary_lists_top_modules_or_none() -> None:
    """``top`` modules by saved bytes, as many as asked for; 0 lists none, as Plan.summary."""
    trace = transformer_trace(layers=2, hidden=64, tokens=64)
    header = "  top modules by saved bytes"

    def listed(top: int) -> list[str]:
        lines = trace.summary(top=top).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(header))
        return [line for line in lines[at + 1 :] if line.startswith("    ")]

    every = listed(100)
    assert len(every) == len(trace.bytes_by_module()) >= 2
    assert listed(1) == every[:1]
    assert header not in trace.summary(top=0)
    with pytest.raises(ValueError, match="top must be >= 0"):
        trace.summary(top=-1)
    with pytest.raises(TypeError, match="top must be an int"):
        trace.summary(top="3")  # type: ignore[arg-type]


def test_perfetto_export(tmp_path) -> None:
    case = gpt_block(seed=0)
    trace = offload.profile(case.step, case.model, warmup_steps=0)
    p = tmp_path / "t.perfetto.json"
    write_perfetto(trace, p)
    evs = json.loads(p.read_text())["traceEvents"]
    spans = [e for e in evs if e["ph"] == "X"]
    counters = [e for e in evs if e["ph"] == "C"]
    assert len(spans) == len(trace.module_spans())
    assert {e["cat"] for e in spans} == {"forward", "backward"}
    assert len(counters) == 2 * len(trace.events)
    assert (
        max(e["args"]["bytes"] for e in counters if e["name"] == "live saved bytes")
        == trace.peak_saved_bytes
    )


def test_perfetto_tracks_hold_only_nesting_spans(tmp_path) -> None:
    """Perfetto draws a track's slices only if they nest. Backward spans overlap partly (the
    root's starts after its last child's and runs to the end of the step): they are spread
    over as many tracks per phase as needed, each one nesting."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.0), nn.Linear(64, 32))
    x = torch.randn(8, 32)
    trace = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    p = tmp_path / "t.perfetto.json"
    write_perfetto(trace, p)
    evs = json.loads(p.read_text())["traceEvents"]
    spans = [e for e in evs if e["ph"] == "X"]
    assert len(spans) == len(trace.module_spans())
    named = {e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    by_tid: dict[int, list[tuple[float, float]]] = {}
    for e in spans:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert set(by_tid) <= named
    for tid, intervals in by_tid.items():
        for a0, a1 in intervals:
            for b0, b1 in intervals:
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested, (tid, (a0, a1), (b0, b1))
    # This model's backward spans do overlap partly: more than one backward track.
    assert len({e["tid"] for e in spans if e["cat"] == "backward"}) > 1


def test_png_export(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    case = gpt_block(seed=0)
    trace = offload.profile(case.step, case.model, warmup_steps=0)
    p = tmp_path / "m.png"
    write_memory_png(trace, p)
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_names_the_extra(tmp_path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None\n"
        "from offload.lifecycle import Trace, write_memory_png\n"
        "try:\n"
        "    write_memory_png(Trace(records=(), events=()), 'x.png')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert "offload[plot]" in out.stdout


def test_derived_facts_are_built_once_and_not_pickled() -> None:
    """Records and events are immutable, so families, module spans and live bytes are built at
    their first use and kept with the trace (the simulator and the planner's replays ask again
    and again); a copy or an unpickled trace builds its own, and callers get fresh lists."""
    import pickle

    t = _synthetic()
    assert t.families() is t.families()
    assert t.module_spans() is t.module_spans()
    live = t.live_saved_bytes()
    live.clear()  # the caller's list: the kept facts do not change
    assert t.live_saved_bytes() == _synthetic().live_saved_bytes() != []
    assert t.peak_saved_bytes == 3048
    back = pickle.loads(pickle.dumps(t))
    assert back == t and "_memo" not in vars(back)
    assert back.families() == t.families() and back.families() is not t.families()
    other = dataclasses.replace(t, records=t.records[:2])
    assert [f.family for f in other.families()] == [0, 1]


def test_json_files_are_written_whole_or_not_at_all(tmp_path) -> None:
    """``write_json`` encodes first, then writes a temp file and renames it: data that cannot be
    encoded leaves no file behind, and an existing file is replaced only by a complete one."""
    from offload.lifecycle._jsonfile import write_json

    target = tmp_path / "plan.json"
    write_json(target, {"ok": 1})
    with pytest.raises(ValueError):
        write_json(target, {"bad": float("nan")}, allow_nan=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    assert json.loads(target.read_text()) == {"ok": 1}


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, file_size_limit) -> None:
    """A write that fails half-way (disk full, file too large) raises, keeps the file it was to
    replace, and removes its temp file: for a trace, a plan, a hardware model and the exports."""
    pytest.importorskip("matplotlib")
    from offload.lifecycle import HardwareModel, plan, write_plan_png

    trace = transformer_trace(layers=2, hidden=64, tokens=64)
    p = plan(trace, trace.peak_memory_bytes, HardwareModel.h200(), margin=0)
    written = []
    for name, save in (
        ("trace.json", trace.save),
        ("plan.json", p.save),
        ("hardware.json", HardwareModel.h200().save),
        ("trace.perfetto.json", lambda path: write_perfetto(trace, path)),
        ("memory.png", lambda path: write_memory_png(trace, path)),
        ("plan.png", lambda path: write_plan_png(trace, p, path)),
    ):
        target = tmp_path / name
        target.write_text("old")
        written.append(name)
        with file_size_limit(100), pytest.raises(OSError) as e:
            save(target)
        assert e.value.errno == errno.EFBIG
        assert target.read_text() == "old"
        assert sorted(f.name for f in tmp_path.iterdir()) == sorted(written)  # no *.tmpPID


def test_profile_warns_when_the_steps_run_no_backward_or_save_nothing() -> None:
    """A step_fn that only runs forward, or runs it without grad, gives a trace no plan can use:
    said at the caller's line (the trace comes back all the same)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)

    def forward_only() -> None:
        model(x).sum()

    def no_grad() -> None:
        with torch.no_grad():
            model(x).sum()

    for profile in (offload.profile, lifecycle.profile):
        with pytest.warns(RuntimeWarning, match="ran no backward: none of the") as caught:
            trace = profile(forward_only, model, warmup_steps=0)
        assert caught[0].filename == __file__ and trace.records
        with pytest.warns(RuntimeWarning, match="saved no tensor for backward") as caught:
            trace = profile(no_grad, model, warmup_steps=0)
        assert caught[0].filename == __file__ and not trace.records
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            profile(lambda: model(x).sum().backward(), model, warmup_steps=0)


def _writers() -> list[tuple[str, Any]]:
    from offload.lifecycle import HardwareModel, plan, write_plan_png

    trace = transformer_trace(layers=2, hidden=64, tokens=64)
    p = plan(trace, trace.peak_memory_bytes, HardwareModel.h200(), margin=0)
    return [
        ("Trace.save", trace.save),
        ("Plan.save", p.save),
        ("HardwareModel.save", HardwareModel.h200().save),
        ("write_perfetto", lambda path: write_perfetto(trace, path)),
        ("write_memory_png", lambda path: write_memory_png(trace, path)),
        ("write_plan_png", lambda path: write_plan_png(trace, p, path)),
    ]


def test_a_write_that_fails_names_the_path_given_not_the_temp_file(tmp_path) -> None:
    """A missing directory or a path that is a directory raised an error naming the temp file
    (``plan.json.tmp4242``) the user never gave; it names the user's path now, and the temp
    file is still removed."""
    pytest.importorskip("matplotlib")
    (tmp_path / "adir").mkdir()
    for what, save in _writers():
        missing = tmp_path / "missing" / "out.json"
        with pytest.raises(FileNotFoundError) as e:
            save(missing)
        assert e.value.filename == str(missing) and ".tmp" not in str(e.value), (what, e.value)
        with pytest.raises(IsADirectoryError) as e:
            save(tmp_path / "adir")
        assert e.value.filename == str(tmp_path / "adir"), (what, e.value)
        assert ".tmp" not in str(e.value) and e.value.filename2 is None, (what, e.value)
        assert sorted(f.name for f in tmp_path.iterdir()) == ["adir"], what
        assert list((tmp_path / "adir").iterdir()) == [], what


@pytest.mark.parametrize("path", [5, None, b"trace.json"])
def test_save_and_load_name_a_path_that_is_not_one(tmp_path, monkeypatch, path: Any) -> None:
    """``Plan.load(5)`` said "expected str, bytes or os.PathLike object, not int" (and a bytes
    path was saved as a file named "b'trace.json'.tmpPID" before failing)."""
    pytest.importorskip("matplotlib")
    from offload.lifecycle import HardwareModel, Plan

    monkeypatch.chdir(tmp_path)
    accepted = r"^path must be a str or os\.PathLike naming a file; got "
    for cls in (Trace, Plan, HardwareModel):
        with pytest.raises(TypeError, match=accepted + type(path).__name__):
            cls.load(path)
    for what, save in _writers():
        with pytest.raises(TypeError, match=accepted + type(path).__name__):
            save(path)
        assert list(tmp_path.iterdir()) == [], what
