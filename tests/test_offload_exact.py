"""Exactness: gradients with offloading are bitwise equal to gradients without, for every tier,
with synchronous copies and with the deferred engine (copies on a worker thread after a random
delay, released regions poisoned with 0xFF, ``.wait()`` the only synchronisation)."""

from __future__ import annotations

import pytest
import torch
from models import ALL_MODELS, ModelCase

import offload
from offload import storage

TIERS = {
    "cpu": {"tiers": ("cpu",)},
    "nvme": {"tiers": ("nvme",)},
    "cpu+nvme": {"tiers": ("cpu", "nvme")},
}


def reference(name: str, steps: int = 1) -> list[dict[str, torch.Tensor]]:
    case = ALL_MODELS[name](seed=0)
    out = []
    for s in range(steps):
        case.step(s)
        out.append(case.grads())
    return out


def run_offloaded(
    case: ModelCase, mgr: offload.ActivationOffloader, steps: int = 1
) -> list[dict[str, torch.Tensor]]:
    out = []
    for s in range(steps):
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(s))
        loss.backward()
        out.append(case.grads())
    return out


def assert_bitwise(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k


def assert_moved(mgr: offload.ActivationOffloader, tier: str) -> None:
    """The step stored records in ``tier``'s tiers: an exactness check of a step that kept
    everything on the device would prove nothing."""
    last = mgr.stats.last
    assert last.records_offloaded_cpu + last.records_offloaded_nvme > 0
    if "cpu" not in tier:
        assert last.records_offloaded_cpu == 0
    if "nvme" not in tier:
        assert last.records_offloaded_nvme == 0


def make_mgr(
    case: ModelCase, tier: str, tmp_path, engine: storage.CopyEngine | None = None, **kw
) -> offload.ActivationOffloader:
    args = dict(TIERS[tier], min_offload_bytes=0, **kw)
    if "nvme" in args["tiers"]:
        args["nvme_dir"] = tmp_path
    return offload.ActivationOffloader(case.model, _copy_engine=engine, **args)


@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_gradients_bitwise_equal(name: str, tier: str, tmp_path) -> None:
    want = reference(name, steps=2)
    case = ALL_MODELS[name](seed=0)
    mgr = make_mgr(case, tier, tmp_path)
    try:
        got = run_offloaded(case, mgr, steps=2)
        stats = mgr.stats
        assert stats.total.steps == 2
        moved = stats.last.bytes_offloaded_cpu + stats.last.bytes_offloaded_nvme
        assert moved > 0
        if tier == "nvme":
            assert stats.last.bytes_offloaded_cpu == 0
        assert mgr._executor.live_families() == 0  # backward released everything
    finally:
        mgr.close()
    assert_bitwise(got, want)


@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize("name", ["mlp", "gpt_block", "views_model", "mixed_dtypes", "lstm"])
def test_gradients_bitwise_equal_deferred_engine(name: str, tier: str, tmp_path) -> None:
    want = reference(name, steps=2)
    case = ALL_MODELS[name](seed=0)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.003, seed=1)
    mgr = make_mgr(case, tier, tmp_path, engine=engine)
    try:
        got = run_offloaded(case, mgr, steps=2)
        assert_moved(mgr, tier)
    finally:
        mgr.close()
        engine.close()
    assert_bitwise(got, want)


def test_deferred_copies_held_back_until_backward(tmp_path) -> None:
    """With every copy held back, unpack must use the held sources (or wait), never stale bytes."""
    want = reference("gpt_block")
    case = ALL_MODELS["gpt_block"](seed=0)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0, seed=2)
    mgr = make_mgr(case, "cpu+nvme", tmp_path, engine=engine, max_inflight_bytes=1 << 30)
    try:
        case.model.zero_grad(set_to_none=True)
        with engine.paused():
            with mgr:
                loss = case.loss(case.batch(0))
        loss.backward()
        got = [case.grads()]
        assert_moved(mgr, "cpu+nvme")
    finally:
        mgr.close()
        engine.close()
    assert_bitwise(got, want)


def test_retain_graph_two_backward_passes(tmp_path) -> None:
    ref = ALL_MODELS["gpt_block"](seed=0)
    ref.model.zero_grad(set_to_none=True)
    loss = ref.loss(ref.batch())
    loss.backward(retain_graph=True)
    loss.backward()
    want = [ref.grads()]
    for tier in TIERS:
        case = ALL_MODELS["gpt_block"](seed=0)
        mgr = make_mgr(case, tier, tmp_path)
        try:
            case.model.zero_grad(set_to_none=True)
            with mgr:
                loss = case.loss(case.batch())
            loss.backward(retain_graph=True)
            assert mgr._executor.live_families() > 0  # the graph keeps them
            loss.backward()
            del loss
            assert mgr._executor.live_families() == 0
            assert_bitwise([case.grads()], want)
        finally:
            mgr.close()


def test_backward_inside_the_step(tmp_path) -> None:
    want = reference("mlp")
    case = ALL_MODELS["mlp"](seed=0)
    with make_mgr(case, "cpu", tmp_path) as mgr:
        case.model.zero_grad(set_to_none=True)
        case.loss(case.batch()).backward()
    assert_moved(mgr, "cpu")
    mgr.close()
    assert_bitwise([case.grads()], want)


def test_double_backward_inside_step_passes_through() -> None:
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def grads(use: bool) -> torch.Tensor:
        lin.zero_grad(set_to_none=True)
        x.grad = None
        mgr = offload.ActivationOffloader(lin, min_offload_bytes=0) if use else None
        ctx = (
            mgr
            if mgr is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:
            y = torch.tanh(lin(x)).pow(2).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            g.pow(2).sum().backward()
        if mgr is not None:
            assert mgr.stats.last.records_kept > 0  # packs made by the first backward stayed
            assert mgr.stats.last.records_offloaded_cpu > 0  # the forward's went out
            mgr.close()
        return torch.cat([lin.weight.grad.flatten(), x.grad.flatten()])

    assert torch.equal(grads(True), grads(False))
