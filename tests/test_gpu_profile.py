"""The recorder on a CUDA device: CUDA-event clock, allocator memory probe (skipped without CUDA)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from models import gpt_block, mlp
from torch import nn

import offload
from offload import lifecycle
from offload.lifecycle import EventKind

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


class _Square(torch.autograd.Function):
    """``x * x`` whose backward notes the thread it runs on: the thread of its saved tensor's
    unpack, which runs inside ``ctx.saved_tensors``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, threads: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.threads = threads
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors  # the saved-tensor unpack hook runs here, on this thread
        ctx.threads.append(threading.get_ident())
        return 2 * x * grad, None


class _SquareModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []  # of every backward of the square

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Square.apply(x, self.threads)


def unpack_threads(device: str) -> tuple[lifecycle.Trace, list[int], list[int]]:
    """Profile a Linear, a square and a Linear on ``device``: the trace, the threads the
    square's unpacks ran on, and the ``seq`` of the square's records."""
    torch.manual_seed(0)
    square = _SquareModule()
    model = nn.Sequential(nn.Linear(64, 64), square, nn.Linear(64, 16)).to(device)
    x = torch.randn(32, 64, device=device)
    trace = offload.profile(lambda: model(x).sum().backward(), model)
    seqs = [r.seq for r in trace.records if r.module == "1"]
    return trace, square.threads, seqs


def test_unpacks_happen_on_the_autograd_thread_and_are_logged() -> None:
    """NOTE [ Stream ordering ] rule 5: on CUDA, unpacks run on autograd's device thread, not
    the thread that called backward, and the recorder logs them from there."""
    trace, threads, seqs = unpack_threads("cuda")
    unpacks = [e for e in trace.events if e.kind is EventKind.UNPACK]
    assert len(unpacks) == sum(len(r.unpack_events) for r in trace.records) > 0
    assert seqs, "the square saved nothing"
    assert {e.record for e in unpacks} >= set(seqs), "the square's unpack was not logged"
    # one thread for the warm-up step's backward and the recorded one's, and not this one
    assert len(threads) == 2 and len(set(threads)) == 1, threads
    assert threads[0] != threading.get_ident()
