"""Budget mode's matching of steps to plans: reload triggers as planned, plans given with
``plan=`` checked against the manager, and signatures the budget cannot meet (CPU tensors as the
device; the budget bounds the saved bytes a manager holds there, counted by ``SavedBytes``)."""

from __future__ import annotations

import threading

import pytest
import torch
from models import ALL_MODELS, plan_of
from torch import nn

import offload
from offload._live import SavedBytes
from offload.lifecycle import HardwareModel, Recorder

FAST = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
)
SLOW = HardwareModel.cpu_only(
    copy_bytes_per_s=1e8, disk_write_bytes_per_s=1e8, disk_read_bytes_per_s=1e8
)


class DirectOps(nn.Module):
    """The root runs ops itself between its children's calls: the families those ops save are
    the root's own, and the root's backward starts before every child's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.sigmoid(self.b(h)) * h
        return self.c(h)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _planned_steps(
    model: nn.Module, loss_of, mgr: offload.ActivationOffloader, steps: int
) -> list[tuple[dict[str, torch.Tensor], SavedBytes, offload.StepStats]]:
    out = []
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        with SavedBytes.on(mgr) as meter:
            with mgr:
                loss = loss_of(s)
            loss.backward()
        out.append((_grads(model), meter, mgr.stats.last))
    return out


def test_a_parent_modules_own_families_reload_at_their_planned_trigger() -> None:
    """Under a plan, a family reloads at its planned trigger, not at the start of the backward
    of the module that saved it: for the root (or any module running ops between its
    children's calls) that is the start of the whole backward, which brought the root's tanh
    output back while the kept tensors the plan frees first were still held (98,304 saved bytes
    against a predicted 73,728 and a budget of 81,920)."""
    torch.manual_seed(0)
    model = DirectOps()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    budget = 80 << 10
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    runs = _planned_steps(model, lambda s: model(x).pow(2).sum(), mgr, 4)
    mgr.close()
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    want = _grads(model)
    for grads, _, _ in runs:
        for k in want:
            assert torch.equal(grads[k], want[k]), k
    for _, meter, stats in runs[1:]:  # from the signature's second step
        assert stats.unplanned_records == 0
        assert 0 < meter.peak_planned <= stats.predicted_peak_bytes <= budget, (
            meter.peak_planned,
            stats.predicted_peak_bytes,
        )


@pytest.mark.parametrize("name", ["gpt_block", "checkpointed"])
def test_planned_steps_on_a_slow_link_hold_their_prediction(name: str) -> None:
    """On a link slow enough that the plan starts reloads early, each starts at its planned
    trigger and no earlier: the checkpointed model's root saves its blocks' input itself, and
    the root's backward start brought it back (its planned steps held 98,304 saved bytes
    against a predicted 81,920); no stall either."""
    case = ALL_MODELS[name](seed=0)
    trace = offload.profile(lambda: case.step(0), case.model, warmup_steps=0)
    case.model.zero_grad(set_to_none=True)
    budget = trace.peak_saved_bytes // 2
    mgr = offload.ActivationOffloader(
        case.model, gpu_budget=budget, hardware=SLOW, min_offload_bytes=0
    )
    runs = _planned_steps(case.model, lambda s: case.loss(case.batch(s)), mgr, 3)
    plan = mgr.plan
    mgr.close()
    assert plan is not None
    want = ALL_MODELS[name](seed=0)
    for s, (grads, _, _) in enumerate(runs):
        want.step(s)
        for k, g in want.grads().items():
            assert torch.equal(grads[k], g), (s, k)
    for _, meter, stats in runs[1:]:
        assert stats.unplanned_records == 0 and stats.stalls == 0
        assert 0 < meter.peak_planned <= stats.predicted_peak_bytes <= budget, (
            meter.peak_planned,
            stats.predicted_peak_bytes,
        )


def _saved_plan(model: nn.Module, x: torch.Tensor, tmp_path, **kw) -> str:
    plan = plan_of(model, x, gpu_budget=80 << 10, hardware=FAST, min_offload_bytes=0, **kw)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    return path


def test_a_given_plan_above_the_given_budget_is_refused(tmp_path) -> None:
    """plan= with a gpu_budget below the plan's predicted peak: the plan was run as it was and
    the budget silently not held (a 40 KiB budget with a plan predicting 73,728 B held 73,728
    B); now the manager refuses it, naming both. A budget the plan fits is accepted."""
    torch.manual_seed(0)
    model = DirectOps()
    path = _saved_plan(model, torch.randn(32, 64), tmp_path)
    predicted = offload.Plan.load(path).predicted_peak_bytes
    with pytest.raises(ValueError, match=r"plan.*predicts a peak of .*gpu_budget"):
        offload.ActivationOffloader(model, plan=path, gpu_budget=40 << 10, hardware=FAST)
    offload.ActivationOffloader(model, plan=path, gpu_budget=predicted, hardware=FAST).close()


def test_a_given_plan_placing_bytes_on_a_tier_the_manager_lacks_is_refused(tmp_path) -> None:
    """A plan that moves records to NVMe given to a manager without it: its NVMe records went
    to the host silently (40,960 B, counted neither as unplanned nor as fallbacks); now the
    manager refuses it, naming the tier. A plan using fewer tiers than the manager is fine."""
    torch.manual_seed(0)
    model = DirectOps()
    x = torch.randn(32, 64)
    nvme = _saved_plan(model, x, tmp_path, tiers=("nvme",), nvme_dir=tmp_path)
    assert offload.Plan.load(nvme).bytes_by_placement()["nvme"] > 0
    with pytest.raises(ValueError, match=r"plan.*'nvme'.*tiers"):
        offload.ActivationOffloader(model, plan=nvme, hardware=FAST, tiers=("cpu",))
    mgr = offload.ActivationOffloader(
        model,
        plan=nvme,
        hardware=FAST,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        min_offload_bytes=0,
    )
    with mgr:
        loss = model(x).pow(2).sum()
    loss.backward()
    assert (
        mgr.stats.last.bytes_offloaded_nvme == offload.Plan.load(nvme).bytes_by_placement()["nvme"]
    )
    mgr.close()


def _cli_style_trace(case) -> offload.Trace:
    """A trace recorded as ``offload profile`` records a script: global module hooks, where a
    root module is named by its class (``Checkpointed.blocks.0.fc1``), one warm-up step."""
    rec = Recorder(boundary="backward", max_steps=1, warmup_steps=1)
    rec.begin_step(thread=threading.get_ident())
    with rec.attach_global(), rec.hooks():
        for s in range(2):
            case.step(s)
    case.model.zero_grad(set_to_none=True)
    return rec.trace({"source": "offload profile"})


def test_a_plan_of_an_offload_profile_trace_matches_the_managers_keys(tmp_path) -> None:
    """``offload profile`` names the root by its class, the manager by "": a plan made from the
    CLI's trace (``offload plan``, then ``plan=``) matched none of the manager's keys, so every
    record it would store went unplanned (8 of the 16 per step of the checkpointed model,
    offloaded as in min-memory mode), and a plan recomputing blocks was refused for naming
    modules "not of this model". The manager now reads the plan's module names relative to its
    own root: every record planned, the plan's bytes moved, gradients bitwise."""
    case = ALL_MODELS["checkpointed"](seed=0)
    trace = _cli_style_trace(case)
    assert trace.metadata["root_modules"] == ["Checkpointed"]
    peak = trace.peak_saved_bytes
    # Offloading and rebuilding every small record; recomputing blocks (1 MiB keeps the rest).
    for budget, hw, small in ((peak // 2, SLOW, 0), (peak * 3 // 4, FAST, 1 << 20)):
        plan = offload.plan(trace, gpu_budget=budget, hardware=hw, min_offload_bytes=small)
        path = str(tmp_path / "plan.json")
        plan.save(path)
        mgr = offload.ActivationOffloader(
            case.model, plan=path, hardware=hw, min_offload_bytes=small
        )
        runs = _planned_steps(case.model, lambda s: case.loss(case.batch(s)), mgr, 3)
        mgr.close()
        want = ALL_MODELS["checkpointed"](seed=0)
        for s, (grads, meter, stats) in enumerate(runs):
            want.step(s)
            for k, g in want.grads().items():
                assert torch.equal(grads[k], g), (budget, s, k)
            assert stats.unplanned_records == 0, (budget, s, stats.unplanned_records)
            assert stats.bytes_offloaded_cpu == plan.bytes_by_placement()["cpu"], budget
            assert stats.bytes_recomputed == plan.bytes_by_placement()["recompute"], budget
            assert 0 < meter.peak_planned <= budget, (budget, meter.peak_planned)
    # Not blocks.1, which the model checkpoints itself (NOTE [ Model checkpoints ]).
    assert [m for m, _ in plan.recompute_calls] == [f"Checkpointed.blocks.{i}" for i in (0, 2)]


def test_a_plan_of_another_scripts_root_is_refused() -> None:
    """A plan profiled by ``offload profile`` on a root of another class cannot match any key:
    refused when the manager is made, naming both classes."""
    case = ALL_MODELS["checkpointed"](seed=0)
    trace = _cli_style_trace(case)
    plan = offload.plan(trace, gpu_budget=trace.peak_saved_bytes, hardware=FAST)
    with pytest.raises(ValueError, match=r"plan.*'Checkpointed'.*DirectOps"):
        offload.ActivationOffloader(DirectOps(), plan=plan, hardware=FAST)


class ShiftedTokens(nn.Module):
    """The first saved tensor is ``tokens[:, :-1]``, a view spanning most (not all) of its
    storage, as ``examples/gpt.py``'s ``tok_emb`` saves it; the loss's targets are a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(tokens[:, :-1]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def test_a_view_spanning_most_of_its_storage_is_planned_as_the_storage_it_moves() -> None:
    """The executor stores a view spanning at least a quarter of its storage as the whole
    storage (NOTE [ Alias handling ]); the trace counted the view's own span, so the plan said
    one number and the manager moved another (examples/gpt.py: 4,152 B planned, 4,160 moved).
    The trace now counts the span the executor copies: the bytes moved are the plan's."""
    model = ShiftedTokens()
    tokens = torch.randint(0, 64, (16, 65), generator=torch.Generator().manual_seed(0))
    trace = offload.profile(lambda: model(tokens).backward(), model)
    fam = next(f for f in trace.families() if f.records[0] == 0)
    assert (fam.storage_nbytes, fam.span_bytes) == (16 * 65 * 8, 16 * 65 * 8)
    budget = trace.peak_saved_bytes * 3 // 4
    plan = offload.plan(trace, budget, hardware=SLOW, min_offload_bytes=0)
    mgr = offload.ActivationOffloader(model, plan=plan, hardware=SLOW, min_offload_bytes=0)
    for _ in range(2):
        with mgr:
            loss = model(tokens)
        loss.backward()
    stats = mgr.stats.last
    mgr.close()
    assert stats.unplanned_records == 0
    assert stats.bytes_offloaded_cpu == plan.bytes_by_placement()["cpu"] > 16 * 65 * 8


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_a_cli_plan_places_the_packs_of_a_loss_module() -> None:
    """``criterion = nn.CrossEntropyLoss()`` is a root of its own to ``offload profile`` (its
    packs keyed ``CrossEntropyLoss``), while to a manager of the model its packs are outside the
    model (``<outside>``, numbered with the other packs outside it, in pack order). The plan's
    keys of the loss module matched nothing: its log-softmax of the logits, the step's largest
    record, went unplanned in every step (5 of 9 records a step, with the packs outside the
    model after it). Now the plan's packs outside the model are renumbered as the manager numbers
    them: none unplanned, the plan's cpu bytes moved, at most the predicted peak held, gradients
    bitwise."""
    torch.manual_seed(0)
    model, criterion = _Head(), nn.CrossEntropyLoss()
    target = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(9))

    def loss_of(s: int) -> torch.Tensor:
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(s))
        # A pack outside every module before and after the loss module's.
        return criterion(model(x * 1.5).mul(2.0), target) * x.sum().tanh()

    want = []
    for s in range(3):
        model.zero_grad(set_to_none=True)
        loss_of(s).backward()
        want.append(_grads(model))
    rec = Recorder(boundary="backward", max_steps=1, warmup_steps=1)
    rec.begin_step(thread=threading.get_ident())
    with rec.attach_global(), rec.hooks():
        for s in range(2):
            model.zero_grad(set_to_none=True)
            loss_of(s).backward()
    trace = rec.trace({"source": "offload profile"})
    assert trace.metadata["root_modules"] == ["CrossEntropyLoss", "_Head"]
    plan = offload.plan(
        trace, gpu_budget=trace.peak_saved_bytes * 3 // 4, hardware=FAST, min_offload_bytes=0
    )
    mgr = offload.ActivationOffloader(model, plan=plan, hardware=FAST, min_offload_bytes=0)
    try:
        runs = _planned_steps(model, loss_of, mgr, 3)
    finally:
        mgr.close()
    for (grads, meter, stats), w in zip(runs, want, strict=True):
        assert all(torch.equal(grads[k], g) for k, g in w.items())
        assert stats.unplanned_records == 0, stats.unplanned_records
        assert stats.bytes_offloaded_cpu == plan.bytes_by_placement()["cpu"]
        assert 0 < meter.peak_planned <= plan.predicted_peak_bytes
