"""``offload.activations(model)``: the short form, one cached manager per model and settings."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from offload._config import _check_model, _check_nvme_dir_type, _tiers_arg
from offload._offloader import ActivationOffloader
from offload.lifecycle._units import parse_bytes

_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], ActivationOffloader]] = (
    weakref.WeakKeyDictionary()
)
_cache_lock = threading.Lock()


def activations(
    model: nn.Module,
    *,
    tiers: Iterable[str] = ("cpu",),
    nvme_dir: str | os.PathLike[str] | None = None,
    min_offload_bytes: int | str = 1 << 20,
) -> ActivationOffloader:
    """The manager for ``model`` with these settings, made once and reused (its host pool and
    files survive across steps); ``with offload.activations(model):`` is one step.

    Each distinct setting keeps its own manager, with its host pool claim and files, until the
    model is freed or that manager is closed; a closed manager is replaced at the next call.

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Linear(256, 256)
        >>> with offload.activations(model, min_offload_bytes=0):
        ...     loss = model(torch.randn(64, 256, requires_grad=True)).pow(2).sum()
        >>> loss.backward()
        >>> offload.activations(model, min_offload_bytes=0) is offload.activations(model, min_offload_bytes=0)
        True
    """
    # Checked before the cache is keyed on them (a model that is no module cannot be a key).
    _check_model(model)
    tiers = _tiers_arg(tiers)
    _check_nvme_dir_type(nvme_dir)
    # By meaning, not spelling: 0 and "0", or two spellings of one directory, are one manager.
    key = (
        tiers,
        None if nvme_dir is None else os.path.realpath(nvme_dir),
        parse_bytes(min_offload_bytes, name="min_offload_bytes"),
    )
    with _cache_lock:
        per_model = _cache.setdefault(model, {})
        mgr = per_model.get(key)
        if mgr is None or mgr.closed:
            mgr = per_model[key] = ActivationOffloader(
                model, tiers=tiers, nvme_dir=nvme_dir, min_offload_bytes=min_offload_bytes
            )
        return mgr
