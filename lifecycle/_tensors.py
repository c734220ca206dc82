"""Small facts about tensors and modules that the recorder and the offloader both need."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes: a DTensor's local shard, else ``t``; an
    ``AsyncCollectiveTensor`` (a collective's result still in flight, e.g. a RowwiseParallel
    output) is waited for first, since its storage cannot be read before."""
    if type(t) is not torch.Tensor and hasattr(t, "_local_tensor"):
        t = t._local_tensor
    if type(t) is not torch.Tensor and type(t).__name__ == "AsyncCollectiveTensor":
        t = t.wait()  # type: ignore[attr-defined]
    return t


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ``nn.Parameter`` (a subclass included)."""
    # ``isinstance(t, nn.Parameter)`` goes through a metaclass hook and a failed attribute lookup
    # (an exception) for plain tensors: several microseconds per pack. Plain tensors answer first.
    tt = type(t)
    return tt is not torch.Tensor and (tt is nn.Parameter or isinstance(t, nn.Parameter))


def tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    """The tensors in ``obj`` and in the tuples, lists and dicts it nests."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def params_and_buffers(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def named_modules_stop_at_compiled(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``named_modules()``, without descending into compiled modules."""
    # Only look for compiled modules when dynamo was imported (importing it costs seconds).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame else ()

    def walk(prefix: str, mod: nn.Module) -> Iterable[tuple[str, nn.Module]]:
        yield prefix, mod
        # torch.compile(mod) wraps it in an OptimizedModule; mod.compile() sets a compiled call.
        if (optimized and isinstance(mod, optimized)) or getattr(mod, "_compiled_call_impl", None):
            return
        for name, child in mod.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)

    return walk("", model)


class ParameterStorages:
    """The storages of a model's parameters and buffers, to tell weights from activations.

    Keyed by storage (held weakly), so views of a parameter (``weight.t()`` saved by Linear) count
    too; a tensor whose ``_base`` is a Parameter also counts (FSDP2's unsharded views, whose
    storage changes every step).
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def clear(self) -> None:
        self._refs.clear()

    def add(self, module: nn.Module) -> None:
        """Register ``module``'s parameters and buffers (DTensors by their local shard)."""
        self.add_tensors(params_and_buffers(module))

    def add_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register the storages of ``tensors`` too (tensors someone else holds for the whole
        step, such as a pipeline stage's microbatch inputs)."""
        for t in tensors:
            st = local_tensor(t).untyped_storage()
            self._refs[id(st)] = weakref.ref(st)

    def registered(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is itself one registered here (no view-of-a-Parameter rule)."""
        return self._has(t.untyped_storage())

    def holds(self, t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether ``t`` (a plain or local tensor whose storage is ``storage``) is a weight."""
        if self._has(storage):
            return True
        base = t._base
        return is_parameter(t) or (base is not None and is_parameter(base))

    def _has(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage


# The autograd nodes whose outputs :func:`activation_output` recognises, and their functions.
ACTIVATION_NODES = {"GeluBackward0": "gelu", "SiluBackward0": "silu"}


def activation_output(t: torch.Tensor) -> tuple[str, str, Any, torch.Tensor] | None:
    """``(kind, approximate, what the pack of its input returned, output)`` if ``t`` is, or
    views, a GELU / SiLU output (NOTE [ Activation recipes ] in ``offload/_recipe.py``), else
    None."""
    if type(t) is not torch.Tensor:
        return None
    out = t._base if t._base is not None else t
    fn = out.grad_fn
    kind = ACTIVATION_NODES.get(type(fn).__name__) if fn is not None else None
    if fn is None or kind is None or not out.is_contiguous() or out.storage_offset() != 0:
        return None
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        return None
    # The node's saved input as its pack hook returned it, without unpacking it.
    packed = getattr(getattr(fn, "_raw_saved_self", None), "data", None)
    if packed is None:
        return None
    approximate = str(getattr(fn, "_saved_approximate", "none")) if kind == "gelu" else ""
    return kind, approximate, packed, out
