"""Record keys (module path, call index, ordinal): ``lifecycle.Recorder`` and offload's manager
number them with one implementation (``lifecycle/_calls.py``); here, that they give the same
packs the same keys. A drift would silently misplace every planned record after it."""

from __future__ import annotations

import pytest
from models import ALL_MODELS

import offload
from offload.lifecycle import HardwareModel, Recorder
from offload.lifecycle._calls import OUTSIDE, CallStack, Frame

FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)
MODELS = ["mlp", "gpt_block", "conv_net", "lstm", "checkpointed", "views_model"]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, tuple[str, int, int]]]:
    """Every key any CallStack numbers, with the id of the stack that numbered it."""
    keys: list[tuple[int, tuple[str, int, int]]] = []
    real = CallStack.next_key

    def next_key(self: CallStack) -> tuple[str, int, int]:
        key = real(self)
        keys.append((id(self), key))
        return key

    monkeypatch.setattr(CallStack, "next_key", next_key)
    return keys


def _step_keys(trace: offload.Trace, step: int = 0) -> list[tuple[str, int, int]]:
    return [(r.module, r.call_index, r.ordinal) for r in trace.records if r.step == step]


@pytest.mark.parametrize("name", MODELS)
def test_the_recorder_and_the_manager_key_a_steps_packs_alike(name, monkeypatch) -> None:
    """One step with its backward (checkpoint recomputation included), recorded by a Recorder
    alone, then run by a manager in min-memory mode, keyed: the keys the manager's stack numbered,
    pack by pack, are the recorder's."""
    case = ALL_MODELS[name](seed=0)
    rec = Recorder()
    with rec.attach(case.model), rec.hooks():
        rec.begin_step()
        case.step(0)
        rec.end_step()
    recorded = _step_keys(rec.trace())
    keys = _spy(monkeypatch)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    # A min-memory manager looks up no key, so it counts none (Packer.keyed); counted as a
    # budget's manager counts them:
    assert not mgr._packer.keyed
    mgr._packer.keyed = True
    try:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()
        assert mgr._step is not None
        mine = [k for stack, k in keys if stack == id(mgr._step.calls)]
    finally:
        mgr.close()
    assert recorded and mine == recorded


@pytest.mark.parametrize("name", ["mlp", "gpt_block", "checkpointed"])
def test_a_profiling_step_keys_its_packs_as_its_profile_does(name, monkeypatch) -> None:
    """A budgeted manager's profiling step: its own numbering and its profiler's recorder (both
    running, each over its own call stack) key every pack alike, so that the plan made from the
    profile finds each later pack's decision."""
    case = ALL_MODELS[name](seed=0)
    keys = _spy(monkeypatch)
    mgr = offload.ActivationOffloader(
        case.model, gpu_budget=1 << 30, hardware=FAST, min_offload_bytes=0
    )
    try:
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()
        assert mgr._step is not None and mgr._budget._profiler is not None
        mine = [k for stack, k in keys if stack == id(mgr._step.calls)]
        profiled = _step_keys(mgr._budget._profiler.trace())
    finally:
        mgr.close()
    assert profiled and mine == profiled


def test_a_call_stack_numbers_keys_per_call_and_outside_any_module() -> None:
    calls = CallStack()
    assert calls.next_key() == (OUTSIDE, 0, 0)
    calls.push(Frame("a", calls.call_index("a")))
    calls.push(Frame("a.b", calls.call_index("a.b")))
    assert [calls.next_key(), calls.next_key()] == [("a.b", 0, 0), ("a.b", 0, 1)]
    calls.pop()
    assert calls.next_key() == ("a", 0, 0)
    calls.pop()
    calls.push(Frame("a", calls.call_index("a", count=False)))  # not counted: index 1 again
    assert calls.next_key() == ("a", 1, 0)
    calls.clear()
    assert calls.next_key() == (OUTSIDE, 0, 1)  # the counts stay until reset
    calls.reset()
    assert calls.next_key() == (OUTSIDE, 0, 0) and calls.call_index("a") == 0
