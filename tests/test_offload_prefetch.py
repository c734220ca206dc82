"""The executor's look-ahead: prefetches without memory or room, reloads that fail to
start, NVMe reloads landing before their unpack, and families reloaded once."""

from __future__ import annotations

from typing import Any

import faults
import pytest
import torch
from models import ALL_MODELS, gpt_block
from offload_util import (
    _WaitForTier,
    assert_bitwise,
    assert_nothing_live,
    local_grads,
    manager,
    nvme_kw,
    offloaded_step,
    reference_grads,
    settle,
)
from torch import nn

import offload
from offload import storage


@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
def test_a_prefetch_without_memory_leaves_the_family_for_its_unpack(
    tiers, tmp_path, monkeypatch
) -> None:
    """A look-ahead reload whose buffer cannot be allocated (a device OOM) used to leave its
    family half-started (a later unpack could return an unfilled buffer); now the prefetch
    gives up, and the unpack reloads it (a stall), bitwise."""
    import sys

    import offload._reload as reload_module

    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    real = reload_module.aligned_buffer
    refused = []

    def short_for_prefetches(*args: Any, **kw: Any) -> Any:
        if sys._getframe(2).f_code.co_name == "begin_reload":  # fault injection: prefetch only
            refused.append(args[0])
            raise torch.OutOfMemoryError("injected: no memory for a prefetch")
        return real(*args, **kw)

    monkeypatch.setattr(reload_module, "aligned_buffer", short_for_prefetches)
    with manager(case.model, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(0))
        settle(mgr)  # backward reloads (a family still being written is served its source)
        loss.backward()
        del loss
        got = case.grads()
        last = mgr.stats.last
        assert refused and last.stalls == last.reloads > 0
        assert mgr._executor._ahead_bytes == 0
        assert_bitwise(got, want)
        assert_nothing_live(mgr)


def test_a_reload_that_failed_to_start_is_not_reused_on_retry(monkeypatch) -> None:
    """A reload whose read failed to start left its family pointing at the new, unfilled
    buffer (kept alive by the kept error's traceback): a retried backward reused it as a
    finished reload, a wrong gradient (off by 131). The retry reads the bytes again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(512, 64)
    model(x).square().sum().backward()
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    host = faults.install(monkeypatch, "cpu")["cpu"]
    error = storage.StorageError("injected: the read failed to start")
    host.fail("read", error, at="submit", calls={0})  # the first read fails to start
    with manager(model) as mgr:
        with mgr:
            loss = model(x).square().sum()
        with pytest.raises(offload.StorageError) as kept:  # the error is kept, as loggers do
            loss.backward(retain_graph=True)
        assert host.injected == 1
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert_bitwise(local_grads(model), want)
        del kept, loss


@pytest.mark.parametrize("name", ["mlp", "gpt_block"])
def test_a_prefetch_without_room_on_the_device_is_left_to_its_unpack(name: str) -> None:
    """A room probe that says the device has no room for a reload: no prefetch is tried (on
    CUDA each try would OOM, and the allocator empty its cache, a device synchronization),
    each is counted, every family is reloaded by its unpack instead, and the gradients are
    bitwise those without offloading. With room, the same steps prefetch."""
    from offload._family import ALIGN_BYTES

    want = [reference_grads(name, s) for s in range(2)]
    asked: list[int] = []

    def no_room(nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    for room, prefetched in ((no_room, False), (lambda n: True, True)):
        case = ALL_MODELS[name](seed=0)
        with manager(case.model, _room=room) as mgr:
            for s in range(2):
                assert_bitwise(offloaded_step(case, mgr, s), want[s])
                last = mgr.stats.last
                assert last.reloads == last.records_offloaded_cpu > 0
                if prefetched:
                    assert last.stalls < last.reloads and last.prefetches_skipped == 0
                else:
                    assert last.stalls == last.reloads  # each at its unpack
                    assert last.prefetches_skipped > 0
                    # asked for a family's bytes and the buffer's alignment slack
                    sizes = {f.nbytes + ALIGN_BYTES for f in mgr._executor.step.families}
                    assert asked and set(asked) <= sizes
            assert_nothing_live(mgr)


def test_a_prefetched_nvme_reload_lands_before_its_unpack(tmp_path) -> None:
    """NVMe tier, min-memory mode, a window holding every family, every file write done before
    backward: the look-ahead starts every reload when backward begins, and the first half's
    file reads are done before that half's backward begins (the op between the halves waits
    for them). The copy to the device was issued only at each unpack (on CUDA: behind all the
    compute queued before it, a bubble per record); now the first poll that sees a read done
    issues it (NOTE [ NVMe reloads land early ]), so each of the first half's families (the
    input, 3 Tanh outputs) had landed before its unpack ran. Gradients bitwise."""

    def half() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.Tanh())])

    torch.manual_seed(0)
    a, b = half(), half()
    x = torch.randn(256, 256)
    model = nn.ModuleList([a, b])

    def forward(tier: Any) -> torch.Tensor:
        h = a(x)
        return b(_WaitForTier.apply(h, tier) if tier is not None else h.clone()).sum()

    forward(None).backward()
    want = local_grads(model)
    with manager(model, tiers=("nvme",), nvme_dir=tmp_path, max_inflight_bytes="64MiB") as mgr:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mgr:
                tier = mgr._tiers[0]
                loss = forward(tier)
            assert mgr.stats.last.records_offloaded_nvme == 8  # waits for every file write
            ex = mgr._executor
            landed = getattr(ex, "landed_early", 0)
            loss.backward()
            assert_bitwise(local_grads(model), want)
            last = mgr.stats.last
            assert last.reloads == 8 and last.stalls == 0
            assert getattr(ex, "landed_early", 0) - landed >= 4  # before: 0


def test_a_member_released_after_its_unpack_leaves_its_family_reloaded_once() -> None:
    """Attention on views of one qkv output saves three members of one family: v (by att @ v)
    and q, k (by q @ k^T). Backward unpacks v, frees it with its node, then unpacks k and q.
    The family counted v's unpack after v was gone, so the unpack of k looked like its last
    one: its buffer was dropped and q's unpack reloaded the family a second time while k's
    view still held the first buffer (2 reloads, 2 x 6,144 bytes held, where 1 and 6,144
    are due)."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    qkv = nn.Linear(32, 96)
    x = torch.randn(2, 8, 32)

    def attend() -> torch.Tensor:
        q, k, v = qkv(x).view(2, 8, 3, 32).unbind(2)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return (att @ v).sum()

    attend().backward()
    want = qkv.weight.grad.clone()
    qkv.zero_grad(set_to_none=True)
    with manager(qkv, keep=()) as mgr:
        with SavedBytes.on(mgr) as saved:
            with mgr:
                loss = attend()
            settle(mgr)
            families = [f for f in mgr._executor.step.families if f.nbytes == 2 * 8 * 96 * 4]
            assert len(families) == 1 and families[0].members == 3
            del families
            loss.backward()
        assert mgr.stats.last.reloads == mgr.stats.last.records_offloaded_cpu
        assert torch.equal(qkv.weight.grad, want)
        # The qkv output's buffer once (with the softmax output's beside it), not twice.
        assert saved.peak_planned < 2 * (2 * 8 * 96 * 4), saved.peak_planned


@pytest.mark.parametrize("engine", ["sync", "deferred"])
def test_every_prefetch_counts_one_lead(engine: str) -> None:
    """A prefetched reload's lead is counted once, at its family's first unpack, whether the
    read completed in its call (NOTE [ Reloads done at once ] in offload/_reload.py) or ran on
    the engine; a stall's reload and a reused buffer count none."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64)
    with manager(model, engine, tiers=("cpu",)) as mgr:
        for _ in range(2):
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
        last = mgr.stats.last
        assert len(last._leads) == last.reloads - last.stalls
        assert all(lead >= 0 for lead in last._leads)
        if engine == "sync":
            # (A deferred engine's copies out may still run at unpack: no reload then.)
            assert last.reloads == last.records_offloaded_cpu == 7
            assert len(last._leads) > 0 and last.prefetch_lead_s_p50 > 0
        with mgr:
            loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # every family reloads again (none is still alive to reuse)
        last = mgr.stats.last
        assert len(last._leads) == last.reloads - last.stalls
        assert_nothing_live(mgr)
