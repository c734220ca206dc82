"""Offload inside ``lightning.pytorch.Trainer``: one callback, no ``with mgr:`` anywhere.

A LightningModule whose ``training_step`` calls ``self.net(x)`` is fitted twice with gradient
accumulation and a validation loop: once as it is, once with
``OffloadCallback(gpu_budget=...)``, which profiles the first micro-batch, plans it against the
budget and runs the plan on every later one. The final weights of the two fits are compared
bitwise. Runs on CPU in a few seconds (``pip install 'offload[integrations]'``):

    python examples/lightning_fit.py
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.integrations.lightning import OffloadCallback

BATCH, WIDTH, CLASSES = 64, 256, 10
STEPS, ACCUMULATE = 4, 2


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.GELU(),
            nn.Linear(2 * WIDTH, 2 * WIDTH),
            nn.GELU(),
            nn.Linear(2 * WIDTH, CLASSES),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(batches: int, seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * BATCH, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (batches * BATCH,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def fit(callbacks: list[Any]) -> Classifier:
    lightning.seed_everything(0, verbose=False)
    model = Classifier()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=ACCUMULATE,
        limit_val_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, loader(STEPS * ACCUMULATE, seed=1), loader(2, seed=2))
    return model


def main() -> None:
    warnings.filterwarnings("ignore", module="lightning.*")
    want = fit([])

    # The budget: 60% of what keeping every saved activation would hold (what a GPU run sets
    # to the memory it can spare). ``hardware``: copy speeds for the planner, so a CPU run
    # plans as it would on a machine with a fast link.
    probe = Classifier()
    x, y = next(iter(loader(1, seed=1)))
    trace = offload.profile(
        lambda: F.cross_entropy(probe.net(x), y).backward(), probe.net, warmup_steps=0
    )
    budget = int(0.6 * trace.peak_saved_bytes)
    fast = offload.HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    cb = OffloadCallback(gpu_budget=budget, hardware=fast, min_offload_bytes=0)
    unplanned: list[int] = []

    class AfterEachMicroBatch(lightning.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            unplanned.append(cb.manager.stats.last.unplanned_records)

    got = fit([cb, AfterEachMicroBatch()])

    mgr = cb.manager  # closed at the fit's end; its stats and plans stay readable
    total = mgr.stats.total
    (plan,) = mgr.plans.values()
    same = all(torch.equal(a, b) for a, b in zip(got.parameters(), want.parameters(), strict=True))
    print(f"{total.steps} steps ({STEPS} optimizer steps of {ACCUMULATE} micro-batches)")
    print(
        f"plan for a budget of {budget / 2**10:.0f} KiB: predicted peak "
        f"{plan.predicted_peak_bytes / 2**10:.0f} KiB"
    )
    print(f"unplanned records after the first plan: {sum(unplanned[1:])}")
    print(f"final weights bitwise equal to the fit without offload: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
