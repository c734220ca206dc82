"""Activation checkpointing under the manager: reentrant and not, with backward inside or
after the step, and recomputations left unfinished."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from offload_util import (
    ENGINES,
    CheckpointedBlocks,
    assert_bitwise,
    assert_nothing_live,
    local_grads,
    manager,
)
from torch import nn


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant: bool, backward_inside: bool) -> None:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return CheckpointedBlocks(use_reentrant)

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ref = build()
    ref(x).pow(2).sum().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    want_x = x.grad.clone()
    x.grad = None
    model = build()
    with manager(model) as mgr:
        with mgr:
            loss = model(x).pow(2).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        del loss
        gc.collect()
        assert_nothing_live(mgr)
    assert_bitwise({n: p.grad for n, p in model.named_parameters()}, want)
    assert torch.equal(x.grad, want_x)


@pytest.mark.parametrize("engine", ENGINES)
def test_calls_a_checkpoint_recomputation_leaves_unfinished_end_with_its_backward(engine: str):
    """Non-reentrant checkpoint stops recomputing once backward has what it needs, so the
    recomputed calls' forward hooks never come. Their stack entries stayed, and a second
    forward in the same ``with mgr:`` block ran under them: kept whole under a kept module
    (0 bytes offloaded by the second forward and backward, 24,576 by the first). Now the end of
    the backward drops them; both pairs offload alike, gradients bitwise."""
    from models import Checkpointed

    def two_pairs(model: nn.Module, x: torch.Tensor, mgr: Any | None) -> list[int]:
        moved: list[int] = []
        for _ in range(2):
            model(x).pow(2).sum().backward()
            if mgr is not None:
                assert mgr._step.calls.frames == []
                moved.append(mgr.stats.last.bytes_offloaded_cpu - sum(moved))
        return moved

    torch.manual_seed(0)
    model = Checkpointed(checkpointed=(0, 1, 2))
    x = torch.randn(32, 64, requires_grad=True)
    two_pairs(model, x, None)
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    with manager(model, engine, min_offload_bytes=0, keep=["blocks.0"]) as mgr:
        # Two pairs in one block are one step on purpose here: the manager says so once.
        with pytest.warns(RuntimeWarning, match="a forward began after a backward"), mgr:
            moved = two_pairs(model, x, mgr)
        assert moved[0] > 0 and moved[1] == moved[0], moved
        assert_bitwise(local_grads(model), want)
