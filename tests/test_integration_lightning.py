"""``offload.integrations.lightning.OffloadCallback`` in a real ``lightning.pytorch.Trainer`` fit
on CPU: the final weights are bitwise those of the same fit without offload (min-memory, under a
budget, with gradient accumulation, and under DDP on two gloo ranks); under a budget a plan is
made and the later steps run it; validation and the sanity check leave the stats alone."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from budget_util import FAST
from models import MLP

lightning = pytest.importorskip("lightning")
integration = pytest.importorskip("offload.integrations.lightning")
OffloadCallback = integration.OffloadCallback

import offload  # noqa: E402

BATCH, D_IN, CLASSES = 64, 64, 16


class Classifier(lightning.LightningModule):
    """``training_step`` calls ``self.net(x)``: the module's own ``forward`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(D_IN, 128, CLASSES)
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(F.cross_entropy(self.net(x), y)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(batches: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * BATCH, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (batches * BATCH,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class Seen(lightning.Callback):
    """What the manager's stats say after each training micro-batch (its backward has run)."""

    def __init__(self, cb: Any) -> None:
        self.cb = cb
        self.rows: list[tuple[int, int, int, int]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        s = self.cb.manager.stats
        last = s.last
        self.rows.append(
            (
                s.total.steps,
                last.bytes_offloaded_cpu,
                last.predicted_peak_bytes,
                last.unplanned_records,
            )
        )


def _fit(
    callbacks: list[Any],
    steps: int,
    accumulate: int = 1,
    validate: bool = False,
    ranks: int = 1,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps of a fresh model from seed 0 (on each of ``ranks`` DDP ranks,
    which split the data); its final weights."""
    lightning.seed_everything(0, verbose=False)
    model = Classifier()
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=2 if validate else 0,
        val_check_interval=2 if validate else None,
        limit_val_batches=2 if validate else None,
        **kw,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec).*")
        trainer.fit(model, _loader(steps * accumulate * ranks), _loader(2) if validate else None)
    if validate:
        assert model.val_losses  # validation and the sanity check did run
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(got["net.fc1.weight"], _initial())  # it trained


def _initial() -> torch.Tensor:
    lightning.seed_everything(0, verbose=False)
    return Classifier().net.fc1.weight.detach().clone()


def _keep_all_peak() -> int:
    lightning.seed_everything(0, verbose=False)
    model = Classifier()
    batch = next(iter(_loader(1)))
    trace = offload.profile(lambda: model.training_step(batch, 0).backward(), model, warmup_steps=0)
    return trace.peak_saved_bytes


@pytest.mark.parametrize("accumulate", [1, 2])
def test_min_memory_fit_is_bitwise_and_offloads(accumulate: int) -> None:
    steps = 3
    want = _fit([], steps, accumulate, validate=True)
    cb = OffloadCallback(min_offload_bytes=0)
    seen = Seen(cb)
    got = _fit([cb, seen], steps, accumulate, validate=True)
    _assert_bitwise(got, want)
    # One step per micro-batch, none for the sanity check or validation (under inference_mode).
    assert [r[0] for r in seen.rows] == list(range(1, steps * accumulate + 1))
    assert all(r[1] > 0 for r in seen.rows)
    assert cb.manager.closed and not cb.manager.installed
    assert cb.manager.stats.total.steps == steps * accumulate
    assert cb.manager.stats.total.records_offloaded_cpu > 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_budget_fit_plans_then_runs_the_plan_bitwise(accumulate: int) -> None:
    steps = 4
    budget = int(0.6 * _keep_all_peak())
    want = _fit([], steps, accumulate, validate=True)
    cb = OffloadCallback(gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    seen = Seen(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no ignored budget, no other offload warning
        warnings.filterwarnings("ignore", module="lightning.*")
        got = _fit([cb, seen], steps, accumulate, validate=True)
    _assert_bitwise(got, want)
    assert [r[0] for r in seen.rows] == list(range(1, steps * accumulate + 1))
    assert seen.rows[0][1] > 0  # the first micro-batch is profiled in min-memory mode
    for micro, (_, _, predicted, unplanned) in enumerate(seen.rows[1:], start=1):
        assert 0 < predicted <= budget, micro
        assert unplanned == 0, micro
    plans = cb.manager.plans  # readable after the fit
    assert len(plans) == 1
    (plan,) = plans.values()
    assert plan.predicted_peak_bytes <= plan.target_bytes
    assert cb.manager.stats.total.min_memory_steps == 0


class Scaled(Classifier):
    """A module of its own ``forward`` and a parameter of its own, ``training_step`` calling
    ``self(x)``: the view the manager is made on holds that parameter too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_own_forward_and_own_parameter_fit_is_bitwise() -> None:
    def fit(callbacks: list[Any]) -> Scaled:
        lightning.seed_everything(0, verbose=False)
        model = Scaled()
        lightning.Trainer(
            accelerator="cpu",
            max_steps=3,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
        ).fit(model, _loader(3))
        return model

    want = fit([])
    cb = OffloadCallback(min_offload_bytes=0)
    got = fit([cb])
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(got.scale, torch.ones(CLASSES))
    assert cb.manager.stats.total.steps == 3
    assert cb.manager.stats.total.records_offloaded_cpu > 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in got.modules())


class Raising(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raised_closes_the_manager() -> None:
    cb = OffloadCallback(min_offload_bytes=0)
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Raising()
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, _loader(3))
    assert cb.manager.closed and not cb.manager.installed
    assert cb.manager.stats.total.steps == 1
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bad_arguments_and_manager_before_fit() -> None:
    with pytest.raises(TypeError, match="gpu_budgt"):
        OffloadCallback(gpu_budgt="1GiB")
    assert OffloadCallback().manager is None


def test_docstring_example_runs() -> None:
    result = doctest.testmod(integration, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_import_offload_imports_no_trainer_package() -> None:
    code = "import offload, offload.integrations, sys; print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# -- DDP on two gloo ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from distributed_util import RankPool

    with RankPool(tmp_path_factory.mktemp("ranks"), timeout_s=90.0) as pool:
        yield pool


def _ddp_worker(rank: int, world_size: int, accumulate: int, budget: bool) -> Any:
    # The ranks exist already (RankPool joined them in a gloo group): LOCAL_RANK tells Lightning
    # not to launch processes, and it keeps the initialised process group.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    steps = 3
    kw = {"devices": world_size, "strategy": "ddp", "ranks": world_size}
    want = _fit([], steps, accumulate, **kw)
    mgr_kw: dict[str, Any] = {"min_offload_bytes": 0}
    if budget:
        mgr_kw.update(gpu_budget=int(0.6 * _keep_all_peak()), hardware=FAST)
    cb = OffloadCallback(**mgr_kw)
    seen = Seen(cb)
    got = _fit([cb, seen], steps, accumulate, **kw)
    equal = all(torch.equal(got[k], want[k]) for k in want)
    moved = not torch.equal(got["net.fc1.weight"], _initial())
    return equal, moved, got["net.fc1.weight"], seen.rows, len(cb.manager.plans)


@pytest.mark.distributed
@pytest.mark.parametrize(("accumulate", "budget"), [(1, False), (2, True)])
def test_ddp_fit_on_two_ranks_is_bitwise(ranks: Any, accumulate: int, budget: bool) -> None:
    results = ranks.run(_ddp_worker, accumulate, budget)
    (eq0, moved0, w0, rows0, plans0), (eq1, moved1, w1, rows1, plans1) = results
    assert eq0 and eq1 and moved0 and moved1
    assert torch.equal(w0, w1)  # DDP kept the ranks in step
    for rows, plans in ((rows0, plans0), (rows1, plans1)):
        # Each rank's micro-batches (the sampler splits the data): one step each.
        assert [r[0] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) == 3 * accumulate
        if budget:
            assert plans == 1 and all(r[3] == 0 for r in rows[1:])
        else:
            assert plans == 0 and all(r[1] > 0 for r in rows)


def test_example_runs(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "lightning_fit.py"
    done = subprocess.run(
        [sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "final weights bitwise equal to the fit without offload: yes" in done.stdout
    assert "unplanned records after the first plan: 0" in done.stdout
