"""Saved tensors rebuilt at unpack instead of stored: autocast's weight casts.

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
"""

from __future__ import annotations

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
