"""``OffloadCallback``: offload's manager in ``lightning.pytorch.Trainer``'s fit.

Importing this module imports lightning (``pip install 'offload[integrations]'``);
``import offload`` does not.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - the extra's absence is tested by the skip
    raise ImportError(
        "offload.integrations.lightning needs lightning: pip install 'offload[integrations]'"
    ) from e

from offload._offloader import ActivationOffloader

__all__ = ["OffloadCallback"]


class OffloadCallback(Callback):
    """Run each training step of a ``lightning.pytorch.Trainer`` fit under an
    :class:`~offload.ActivationOffloader`.

    At ``on_fit_start`` (after the strategy moved the model to its device and wrapped it) the
    callback makes the manager on the ``LightningModule``'s submodules and parameters and
    installs it (:meth:`~offload.ActivationOffloader.install`): every forward with grad through
    any of its submodules, with the backward that consumes it, is one step, so ``self.net(x)``
    inside ``training_step`` is seen though the module's own ``forward`` never runs. Each
    ``accumulate_grad_batches`` micro-batch is a step; validation and the sanity check run
    under ``no_grad``/``inference_mode`` and are left alone; under DDP each rank has its own
    manager. At ``on_fit_end``, on an exception, or at teardown, it uninstalls and closes the
    manager; :attr:`manager` (its ``stats`` and ``plans``) stays readable afterwards.

    Args:
        **manager_kwargs: :class:`~offload.ActivationOffloader`'s keyword arguments
            (``gpu_budget``, ``tiers``, ``min_offload_bytes``, ...), checked here.

    Raises:
        TypeError: an argument the manager does not take.

    Example:
        >>> import lightning, torch
        >>> from offload.integrations.lightning import OffloadCallback
        >>> class Net(lightning.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch[0]).square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 64))
        >>> cb = OffloadCallback(min_offload_bytes=0)
        >>> trainer = lightning.Trainer(
        ...     accelerator="cpu", max_steps=2, callbacks=[cb], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=16))
        >>> cb.manager.stats.total.steps, cb.manager.closed
        (2, True)
    """

    def __init__(self, **manager_kwargs: Any) -> None:
        inspect.signature(ActivationOffloader).bind(None, **manager_kwargs)
        self.manager_kwargs = manager_kwargs
        self._manager: ActivationOffloader | None = None
        self._model: nn.Module | None = None  # the manager holds its model weakly

    @property
    def manager(self) -> ActivationOffloader | None:
        """The manager of the latest fit (closed once it ended); None before a fit started, as
        in :class:`offload.integrations.hf.OffloadCallback`."""
        return self._manager

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._model = _children_of(pl_module)
        self._manager = ActivationOffloader(self._model, **self.manager_kwargs)
        self._manager.install()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()  # a fit that ended some other way (interrupted); nothing when closed

    def _close(self) -> None:
        if self._manager is not None:
            self._manager.close()  # uninstalls; idempotent


def _children_of(pl_module: nn.Module) -> nn.Module:
    """The LightningModule without its own call: its submodules, parameters and buffers, under
    their names. Under DDP, Lightning runs ``training_step`` through the module's ``__call__``
    with ``(batch, batch_idx)``; a manager on the module would take that call's counter as part
    of each step's signature (NOTE [ Signatures ] in offload/_planned.py) and profile eight steps
    before sharing one plan. On its submodules, each step begins at the first one
    ``training_step`` calls, with or without DDP."""
    view = nn.Module()
    for name, child in pl_module.named_children():
        view.add_module(name, child)
    for name, p in pl_module.named_parameters(recurse=False):
        view.register_parameter(name, p)
    for name, b in pl_module.named_buffers(recurse=False):
        view.register_buffer(name, b)
    return view
