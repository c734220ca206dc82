"""Records rebuilt instead of stored (NOTE [ Weight casts ], NOTE [ Activation recipes ]):
autocast's weight casts, activation and norm outputs, bitwise, and loud failures when what
they are rebuilt from changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offload_util import _grads, _NormNet
from torch import nn

import offload
from offload import lifecycle


def _autocast_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)
    )
    return model, torch.randn(64, 128, requires_grad=True)


def _autocast_step(model: torch.nn.Module, x: torch.Tensor, mgr: Any = None) -> list[torch.Tensor]:
    return _grads(model, x, mgr, amp=torch.autocast("cpu", dtype=torch.bfloat16))


def test_autocast_weight_casts_are_rebuilt_not_stored() -> None:
    """docs/design.md: autocast's weight casts never cross PCIe; they are cast again at unpack (NOTE
    [ Weight casts ]), bitwise, and hold no memory between forward and backward."""
    from offload._live import LiveBytes

    model, x = _autocast_mlp()
    want = _autocast_step(model, x)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    got = _autocast_step(model, x, mgr)
    last = mgr.stats.last
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    casts = 2 * 128 * 256 * 2  # both Linear weights in bf16, saved as views of their casts
    gelu_out = 64 * 256 * 2  # rebuilt from the GELU input too (NOTE [ Activation recipes ])
    # x's bf16 cast, the GELU input (bf16), and pow's fp32 input.
    activations = 64 * (128 + 256) * 2 + 64 * 128 * 4
    assert (last.records_rebuilt, last.bytes_rebuilt) == (3, casts + gelu_out)
    assert last.bytes_offloaded_cpu == activations, (last.bytes_offloaded_cpu, casts)
    # Between forward and backward nothing of the casts is alive (kept, they were 128 KiB).
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with mgr:
                loss = model(x).float().pow(2).sum()
        torch.zeros(1)  # the counter settles frees at its next op
        between = live.live
        loss.backward()
    mgr.close()
    assert between < casts // 2, between


def test_parameter_changed_before_backward_fails_loudly() -> None:
    """A rebuilt cast of a parameter changed in place since forward would be another cast: the
    unpack raises instead of returning it."""
    model, x = _autocast_mlp()
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with mgr:
            loss = model(x).float().pow(2).sum()
    with torch.no_grad():
        model[2].weight.mul_(0.5)  # an optimizer step before the backward
    with pytest.raises(offload.OffloadError, match="changed in place"):
        loss.backward()
    mgr.close()


def test_planned_steps_leave_weight_casts_out_of_the_plan() -> None:
    """Budget mode profiles the casts as parameters: no plan entry places them, every planned
    step rebuilds them, and gradients stay bitwise. (The profiling step rebuilds the GELU
    output too, as min-memory mode does; this plan, with room, stores it.)"""
    model, x = _autocast_mlp()
    want = _autocast_step(model, x)
    hw = offload.HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, gpu_budget="200KiB", hardware=hw)
    for rebuilt in (3, 2, 2):
        got = _autocast_step(model, x, mgr)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert mgr.stats.last.records_rebuilt == rebuilt
    plan = mgr.plan
    assert plan is not None and mgr.stats.last.unplanned_records == 0
    # The plan holds the activations only: 64 x (128 + 256 + 256) bf16 + 64 x 128 fp32 bytes.
    assert sum(plan.bytes_by_placement().values()) == 64 * (128 + 256 + 256) * 2 + 64 * 128 * 4
    mgr.close()


def _act_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.SiLU(),
        nn.Linear(64, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 8),
    )  # fmt: skip


@pytest.mark.parametrize("how", ["cpu", "nvme", "deferred", "retain_graph"], ids=lambda s: s)
def test_activation_outputs_are_rebuilt_from_their_inputs(how: str, tmp_path) -> None:
    """NOTE [ Activation recipes ]: in min-memory mode a GELU / SiLU output saved by the next
    Linear is not stored: rebuilt at unpack from the activation's input (offloaded once for
    both), bitwise, on every tier and copy engine, and again for a second backward."""
    from offload.storage import CopyEngine

    model = _act_mlp()
    x = torch.randn(4, 32, 64)  # 3-D: each Linear saves a 2-D view of its input

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        return _grads(model, x, mgr, twice=how == "retain_graph")

    want = grads(None)
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if how == "nvme":
        kw.update(tiers=("nvme",), nvme_dir=tmp_path)
    if how == "deferred":
        kw["_copy_engine"] = CopyEngine(deferred=True, max_delay_s=0.002, seed=3)
    mgr = offload.ActivationOffloader(model, **kw)
    try:
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(grads(mgr), want, strict=True))
            last = mgr.stats.last
            # Two GELU outputs and one SiLU output, 128 rows each: 256 + 64 + 64 floats wide.
            assert (last.records_rebuilt, last.bytes_rebuilt) == (3, 128 * (256 + 64 + 64) * 4)
            # Stored: the input x, the three activations' inputs, pow's input (all float32).
            stored = 128 * (64 + 256 + 64 + 64 + 8) * 4
            assert last.bytes_offloaded_cpu + last.bytes_offloaded_nvme == stored
            # A rebuild does not wait on its input's reload: the module saving the output starts
            # it. The one stall per backward is pow's input, unpacked first with nothing before
            # it (the second backward's too: the window no longer holds it between the two).
            assert last.stalls <= (2 if how == "retain_graph" else 1), last
        assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()
        if "_copy_engine" in kw:
            kw["_copy_engine"].close()


@pytest.mark.parametrize("how", ["cpu", "nvme", "retain_graph", "autocast"], ids=lambda s: s)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "rms_norm_composite"])
def test_norm_outputs_are_rebuilt_with_their_modules_arguments(
    kind: str, how: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """NOTE [ Activation recipes ]: an ``nn.LayerNorm``'s or ``nn.RMSNorm``'s output saved by
    the next Linear is rebuilt at unpack from the input its node saved, with the module's eps,
    weight and bias (noted by its forward hook: the node does not save eps), bitwise; under
    autocast, the bf16 cast of it that the Linear saves is rebuilt and cast again. A subclass's
    or a functional call's output is stored. ``rms_norm`` runs RMSNorm as CUDA does, through
    ``_fused_rms_norm`` (the ``fused_rms_norm`` fixture); ``rms_norm_composite`` as CPU torch
    does, a chain of elementwise nodes, whose outputs are stored (still bitwise)."""
    if kind == "rms_norm":
        request.getfixturevalue("fused_rms_norm")
    model = _NormNet("layer_norm" if kind == "layer_norm" else "rms_norm")
    x = torch.randn(4, 32, 64)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast")

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        return _grads(model, x, mgr, amp=amp, twice=how == "retain_graph")

    want = grads(None)
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if how == "nvme":
        kw.update(tiers=("nvme",), nvme_dir=tmp_path)
    mgr = offload.ActivationOffloader(model, **kw)
    norms = 0 if kind == "rms_norm_composite" else 3
    try:
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(grads(mgr), want, strict=True))
            last = mgr.stats.last
            if how == "autocast":
                # The Linears save bf16 casts of the float32 norm outputs: three rebuilt (and
                # cast), besides the five Linear weights' casts (NOTE [ Weight casts ]).
                casts = 5 * 64 * 64 * 2
                want_rebuilt = (5 + norms, casts + norms * 128 * 64 * 2)
            else:
                want_rebuilt = (norms, norms * 128 * 64 * 4)
            assert (last.records_rebuilt, last.bytes_rebuilt) == want_rebuilt
            assert last.records_offloaded_cpu + last.records_offloaded_nvme > 0
            assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()


class _QKV(nn.Module):
    """One LayerNorm output saved three times, by separate q, k and v projections."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "retain_graph"])
def test_an_output_saved_by_several_ops_is_rebuilt_once_per_backward(
    twice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Activation recipes ]: the three packs of one LayerNorm output share one rebuild:
    the first unpack of a backward runs it, the other two reuse it (bitwise), and its bytes
    count once."""
    from offload._recipe import ActivationRecipe

    model, x = _QKV(), torch.randn(4, 32, 64)
    want = _grads(model, x, twice=twice)
    runs = []
    rebuild = ActivationRecipe.rebuild

    def counted(self: ActivationRecipe, parent: torch.Tensor) -> torch.Tensor:
        runs.append(self.kind)
        return rebuild(self, parent)

    monkeypatch.setattr(ActivationRecipe, "rebuild", counted)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    try:
        for _ in range(2):
            runs.clear()
            got = _grads(model, x, mgr, twice=twice)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            last = mgr.stats.last
            assert (last.records_rebuilt, last.bytes_rebuilt) == (3, 128 * 64 * 4)
            assert runs == ["layer_norm"] * (2 if twice else 1)
            assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_weight_changed_before_backward_fails_loudly(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A norm output rebuilt with a weight changed in place since forward would be another
    output: the unpack raises instead of returning it."""
    if kind == "rms_norm":
        request.getfixturevalue("fused_rms_norm")
    model = _NormNet(kind)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    with mgr:
        loss = model(torch.randn(4, 32, 64)).pow(2).sum()
    with torch.no_grad():
        model.norms[0].weight.mul_(0.5)  # an optimizer step before the backward
    name = "LayerNorm" if kind == "layer_norm" else "RMSNorm"
    with pytest.raises(offload.OffloadError, match=f"weight or bias of a {name} over"):
        loss.backward()
    mgr.close()


def test_budget_mode_rebuilds_activation_outputs_as_planned() -> None:
    """Under a budget the plan decides (NOTE [ Rebuilt outputs ] in lifecycle/_planner.py): with
    room for everything the outputs are stored; on a tight budget with dear copies the plan
    rebuilds them, and every planned step rebuilds exactly the plan's records, none unplanned."""
    model = _act_mlp()
    x = torch.randn(4, 32, 64)
    hw = offload.HardwareModel.cpu_only(
        copy_bytes_per_s=5e8, disk_write_bytes_per_s=1e8, disk_read_bytes_per_s=1e8
    )
    rebuilt_by_budget = {}
    for budget in ("1MiB", "400KiB"):
        mgr = offload.ActivationOffloader(
            model, gpu_budget=budget, hardware=hw, min_offload_bytes=0
        )
        for step in range(4):
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
            if step >= 1:  # planned steps
                plan = mgr.plan
                keys = [e.keys for e in plan.entries if e.placement is lifecycle.Placement.REBUILD]
                assert mgr.stats.last.records_rebuilt == sum(map(len, keys))
                assert mgr.stats.last.unplanned_records == 0
        rebuilt_by_budget[budget] = mgr.stats.last.records_rebuilt
        mgr.close()
    assert rebuilt_by_budget["1MiB"] == 0 and rebuilt_by_budget["400KiB"] == 3
