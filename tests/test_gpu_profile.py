"""The recorder on a CUDA device: CUDA-event clock, allocator memory probe (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from models import gpt_block, mlp

import offload
from lifecycle import EventKind

pytestmark = pytest.mark.gpu


def test_profile_on_cuda_uses_events_and_allocator() -> None:
    case = gpt_block(seed=0, device="cuda")
    trace = offload.profile(case.step, case.model)
    assert trace.metadata["clock"] == "CudaClock"
    assert trace.metadata["memory_probe"] == "cuda_memory_allocated"
    assert all(r.device.startswith("cuda") for r in trace.activation_records)
    times = [e.time_s for e in trace.events]
    assert times[0] == 0.0 and all(t >= 0 for t in times)
    # The allocator holds at least the saved activations while they are live.
    live = dict(trace.live_saved_bytes())
    assert all(e.memory_bytes >= live[e.index] for e in trace.events)
    assert trace.peak_memory_bytes >= trace.peak_saved_bytes > 0


def test_cuda_recording_keeps_gradients_bitwise() -> None:
    ref = mlp(seed=0, device="cuda")
    ref.step()
    ref2 = mlp(seed=0, device="cuda")
    ref2.step()
    for k, g in ref.grads().items():
        assert torch.equal(g, ref2.grads()[k]), "baseline not deterministic"
    case = mlp(seed=0, device="cuda")
    offload.profile(case.step, case.model, warmup_steps=0)
    for k, g in ref.grads().items():
        assert torch.equal(case.grads()[k], g), k


def test_unpacks_happen_on_the_autograd_thread_and_are_logged() -> None:
    case = mlp(seed=0, device="cuda")
    trace = offload.profile(case.step, case.model)
    unpacks = [e for e in trace.events if e.kind is EventKind.UNPACK]
    assert len(unpacks) == sum(len(r.unpack_events) for r in trace.records) > 0
