"""Saved tensors rebuilt at unpack instead of stored: autocast's weight casts, activation outputs.

NOTE [ Weight casts ]
    Under ``torch.autocast`` a Linear saves the low-precision copy of its weight (a
    ``ToCopyBackward0`` of the Parameter, or a view of one, such as its transpose) for the
    backward. Stored, it costs the weight's bytes again per step (per microbatch under a pipeline,
    whose stage 0 stashes several); copied out, it crosses the link every step for bytes the
    device already has in higher precision. DESIGN.md: autocast weight casts never cross PCIe. So
    the manager stores a recipe instead: the parameter, the dtype and the view's geometry, and
    unpack casts the parameter again on the compute stream (the same ``_to_copy`` kernel on the
    same bytes: bitwise the same cast) and rebuilds the view. The profiler records such packs as
    parameters (to a plan they cost nothing).
    Conditions, checked at pack (otherwise the tensor is handled like any other): a plain tensor
    (not a subclass) whose own or whose base's ``grad_fn`` is ``ToCopyBackward0`` fed straight by a
    registered parameter's gradient accumulator, on the parameter's device, with the parameter's
    shape and strides (a dense copy the rebuilt cast will match byte for byte). A parameter
    changed in place between forward and backward (an optimizer step before the backward) would
    give another cast: unpack checks the parameter's version and raises instead.

NOTE [ Activation recipes ]
    In min-memory mode (no budget) the output of a GELU or SiLU, saved by the next Linear, is
    not stored either: its input was just saved by the activation's own backward node, so the
    output is that input passed through the same function again, computed at unpack on the
    compute stream (the same kernel on the same bytes, at the same address alignment:
    bitwise). The recipe holds a second handle on the input's family (``Executor.share``),
    so one reload serves both unpacks. Checked at pack: a plain tensor whose own or whose base's
    ``grad_fn`` is ``GeluBackward0`` / ``SiluBackward0`` whose saved input (read raw, as its
    pack returned it, without unpacking) is a handle of this manager, both dense and
    contiguous with the same shape and dtype. A plan would have to price the
    recomputation and the input's longer stay, which the planner does not model yet, so budget
    mode stores these outputs like any other tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from lifecycle._tensors import ParameterStorages
from offload._errors import OffloadError


class WeightCast:
    """What pack returns for a weight cast: how to cast it again at unpack."""

    __slots__ = ("dtype", "nbytes", "offset", "param", "seq", "size", "stride", "version")

    def __init__(self, param: torch.Tensor, cast: torch.Tensor, t: torch.Tensor) -> None:
        self.param = param
        self.version = param._version
        self.dtype = cast.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.nbytes = cast.untyped_storage().nbytes()
        self.seq = -1  # the profiler's record number, during a profiling step

    def rebuild(self) -> torch.Tensor:
        """The saved tensor again: the parameter cast once more, viewed as it was."""
        if self.param._version != self.version:
            raise OffloadError(
                f"a parameter of shape {tuple(self.param.shape)} changed in place between the "
                f"forward that saved its {self.dtype} cast (autocast) and this backward; offload "
                "rebuilds such casts from the parameter at backward, so the weights must not "
                "change in between (step the optimizer after backward)"
            )
        with torch.no_grad():
            cast = self.param.to(self.dtype)
        return cast.as_strided(self.size, self.stride, self.offset)


def weight_cast(t: torch.Tensor, params: ParameterStorages) -> WeightCast | None:
    """A :class:`WeightCast` for ``t`` if it is a weight cast the recipe can rebuild, else None
    (see NOTE [ Weight casts ])."""
    if type(t) is not torch.Tensor:
        return None
    cast = t._base if t._base is not None else t  # Linear saves the cast's transpose, a view
    fn = cast.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return None
    nxt = fn.next_functions
    acc = nxt[0][0] if nxt else None
    param = getattr(acc, "variable", None)
    if type(param) is not torch.nn.Parameter or not params.registered(param):
        return None
    if (
        cast.device != param.device
        or cast.shape != param.shape
        or cast.stride() != param.stride()
        or cast.storage_offset() != 0
        or cast.untyped_storage().nbytes() != cast.numel() * cast.element_size()
    ):
        return None
    return WeightCast(param, cast, t)


_ACTIVATIONS = {"GeluBackward0": "gelu", "SiluBackward0": "silu"}


class ActivationRecipe:
    """What pack returns for an activation output rebuilt from its input (see NOTE [ Activation
    recipes ])."""

    __slots__ = ("approximate", "kind", "nbytes", "offset", "parent", "size", "stride")

    def __init__(self, kind: str, approximate: str, parent: Any, out: torch.Tensor,
                 t: torch.Tensor) -> None:  # fmt: skip
        self.kind, self.approximate, self.parent = kind, approximate, parent
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.nbytes = out.untyped_storage().nbytes()

    @property
    def family(self) -> Any:
        """The input's alias family (whose step this backward belongs to)."""
        return self.parent.family

    def rebuild(self, parent: torch.Tensor) -> torch.Tensor:
        """The saved tensor again from its input ``parent`` (unpacked from ``self.parent``)."""
        with torch.no_grad():
            if self.kind == "gelu":
                out = torch.nn.functional.gelu(parent, approximate=self.approximate)
            else:
                out = torch.nn.functional.silu(parent)
        return out.as_strided(self.size, self.stride, self.offset)


def activation_output(t: torch.Tensor) -> tuple[str, str, Any, torch.Tensor] | None:
    """``(kind, approximate, what the pack of its input returned, output)`` if ``t`` is, or
    views, a GELU / SiLU output (see NOTE [ Activation recipes ]), else None."""
    if type(t) is not torch.Tensor:
        return None
    out = t._base if t._base is not None else t
    fn = out.grad_fn
    kind = _ACTIVATIONS.get(type(fn).__name__) if fn is not None else None
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
