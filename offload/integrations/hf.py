"""``OffloadCallback``: offload inside a Hugging Face ``transformers.Trainer``.

The Trainer's loop has no place for a ``with mgr:`` block around each forward, so the callback
builds an :class:`offload.ActivationOffloader` on the trainer's model when training begins and
installs it (:meth:`offload.ActivationOffloader.install`: each forward with grad and the backward
that consumes it is a step, each gradient-accumulation micro-batch is one); when training ends it
uninstalls and closes it. The manager stays readable as ``callback.manager`` (its ``stats``,
``plan`` and ``plans``) after training. See docs/trainers-hf.md.

Importing this module imports ``transformers``; ``import offload`` does not import it.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "offload.integrations.hf needs transformers: pip install 'offload[integrations]'"
    ) from e

from offload._offloader import ActivationOffloader

__all__ = ["OffloadCallback"]


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module the optimizer's parameters belong to, under any ``DistributedDataParallel``
    or ``DataParallel`` wrapper. The wrapper's ``forward`` calls that module, whose forward
    pre-hook begins the installed step; a manager on the wrapper would see the same calls but
    count the wrapper's own buffers and mode in a step's signature."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


class OffloadCallback(TrainerCallback):  # type: ignore[misc]
    """Offloads the activations of every training step a ``transformers.Trainer`` runs.

    Args:
        **manager_kwargs: passed to :class:`offload.ActivationOffloader` (``gpu_budget``,
            ``tiers``, ``min_offload_bytes``, ...), which is made on the trainer's model, under
            any DDP wrapper, when training begins.

    Raises:
        TypeError: an argument the manager does not take.

    Attributes:
        manager: the manager of the last ``trainer.train()`` (None before it began); closed
            when training ended, its ``stats`` and plans still readable.

    Example:
        >>> import offload.integrations.hf as hf
        >>> cb = hf.OffloadCallback(min_offload_bytes=0, gpu_budget="64MiB")
        >>> cb.manager is None
        True
        >>> # Trainer(model, args, train_dataset=..., callbacks=[cb]).train()
    """

    def __init__(self, **manager_kwargs: Any) -> None:
        # A misspelt argument fails here, not when training begins.
        inspect.signature(ActivationOffloader).bind(None, **manager_kwargs)
        self.manager_kwargs = manager_kwargs
        self.manager: ActivationOffloader | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise ValueError(
                "OffloadCallback.on_train_begin got no model: add it to a transformers.Trainer "
                "(Trainer(..., callbacks=[OffloadCallback(...)]))"
            )
        self._close()  # a manager a train() that raised left installed
        self.manager = ActivationOffloader(_unwrapped(model), **self.manager_kwargs)
        self.manager.install()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.manager is not None and not self.manager.closed:
            self.manager.close()  # uninstalls first
