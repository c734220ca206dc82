"""Saved tensors rebuilt at unpack instead of stored: autocast's weight casts, activation outputs.

NOTE [ Weight casts ]
    Under ``torch.autocast`` a Linear saves the low-precision copy of its weight (a
    ``ToCopyBackward0`` of the Parameter, or a view of one, such as its transpose) for the
    backward. Stored, it costs the weight's bytes again per step (per microbatch under a pipeline,
    whose stage 0 stashes several); copied out, it crosses the link every step for bytes the
    device already has in higher precision. docs/design.md: autocast weight casts never cross PCIe. So
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
    In min-memory mode (no budget) the output of a GELU, a SiLU, an ``nn.LayerNorm`` or an
    ``nn.RMSNorm``, saved by the next Linear, is not stored either: its input was just saved by
    the function's own backward node, so the output is that input passed through the same
    function again, computed at unpack on the compute stream with autocast off, as the forward
    ran it (the same kernel on the same bytes: bitwise). The recipe holds a second handle on the
    input's family (``Executor.share``), so one reload serves both unpacks. Checked at pack: a
    plain tensor (a DTensor: NOTE [ DTensor activation recipes ]) whose own or whose base's ``grad_fn`` is ``GeluBackward0`` / ``SiluBackward0``
    / ``NativeLayerNormBackward0`` / ``FusedRmsNormBackward0`` whose saved input (read raw, as
    its pack returned it, without unpacking) is a handle of this manager, both dense and
    contiguous with the same shape and dtype.
    Norms: their nodes save the input, the weight (and a LayerNorm's bias) but not eps, so the
    manager's forward hook on each module of exactly type ``nn.LayerNorm`` or ``nn.RMSNorm``
    notes its output with the module's eps, weight and bias (``lifecycle._tensors.NormOutputs``,
    found again from the output's node); a subclass may compute its output otherwise and a
    functional call has no module, so their outputs are stored. An RMSNorm output has such a
    node where torch runs the norm as one op, ``_fused_rms_norm`` (it has CUDA kernels); CPU
    torch decomposes that op into elementwise nodes (the last one saves the normalised tensor,
    not the input), so there its outputs are stored. The tests give the op CPU kernels (torch's
    own decompositions, registered for the test) to run the real ``FusedRmsNormBackward0`` on
    CPU. (A norm made an FSDP2 unit of its own has another type, ``FSDPLayerNorm`` say: not
    noted.) A norm's weight and bias are read again at the rebuild, so they must still hold
    their forward's bytes then: the model's own parameters do (their versions are checked at
    unpack: changed in place, they would give another output, ``OffloadError``). A weight that
    is no registered parameter storage at the step's start was swapped in for the forward
    only: FSDP2's unsharded parameter, whose storage ``reshard_after_forward`` frees when the
    norm's unit ends its forward and fills again only at that unit's pre-backward. Where the
    output's saver sits in a later unit (a post-norm block ends with its norm, and the next
    block's first Linear saves the output), the saver's backward came first and found the
    storage freed ("data is not allocated yet") or, with a prefetch, allocated but not yet
    filled. The forward hook that notes such a norm output therefore copies its weight and bias
    (``hold_norm_weights``: a norm's weights, a few KiB against the output's rows x width,
    aligned as the originals, see NOTE [ Alias handling ]); a weight already freed when the
    output is noted leaves the output unnoted (stored).
    Under autocast a norm runs in float32 and the Linear saves a bf16 cast of its output
    (``ToCopyBackward0`` whose only input is the noted node): the recipe rebuilds the output and
    casts it again (the same ``_to_copy``). A chain (a LayerNorm of a GELU output) rebuilds the
    inner output only: the outer one's input pack returned a recipe, not a stored tensor.
    Several packs of one output (separate q, k and v projections of one norm output) share one
    rebuild (``SharedRebuild``): the first unpack of a backward runs it and the others reuse
    it, so it is held from that unpack to the last of them (as the planner models a rebuilt
    family), and its bytes count once in ``bytes_rebuilt``.
    In budget mode the plan decides (``Placement.REBUILD``, NOTE [ Budget mode ] in
    _planned.py): the profiling step (min-memory mode) rebuilds these outputs too, but only
    where it can record the link to their input (``TensorRecord.rebuild_from``: where the input
    was offloaded whole, at offset 0 of its own storage, as ``lifecycle.Recorder`` links them;
    the others it stores), and a planned step builds the recipe for the keys the plan
    rebuilds. There the input may also have been kept by the plan (the
    activation's pack returned a plain tensor this manager kept in this step, not a parameter):
    the recipe then holds that tensor itself, whose bytes autograd holds anyway until the
    activation's backward, which comes after this unpack; its version is checked at unpack (an
    in-place change would rebuild another output). When the conditions fail, the record is
    stored as an unplanned one.

NOTE [ DTensor activation recipes ]
    Under tensor parallelism the saved tensor reaches pack as a DTensor. Its local shard is
    rebuilt where it is exactly the function of the local shard of an input the same step
    stored, and unpack wraps the rebuilt shard as the executor wraps a reloaded one
    (``DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)``: no
    collective). Two ways qualify (``lifecycle._tensors.activation_output``):
    - ``from_local`` of a plain output (ColwiseParallel's replicated input, RowwiseParallel's
      sharded one, wrapping a norm or activation output computed on plain tensors): the shard
      is a view of that output, found through the wrapper's ``view_as``; the input is the
      plain tensor the function's node saved. Any placements: the bytes are re-wrapped as
      they were.
    - the function ran on DTensors (its node is the DTensor's own): the input the node saved
      must be a DTensor of the same mesh and placements (a Partial input comes back Replicate
      after DTensor's all-reduce: differing placements, stored), none of them Partial; GELU and
      SiLU are elementwise, so each shard is the function of the input's shard; a norm only
      where no normalised dim is sharded (``Shard`` on a batch or sequence dim, or Replicate)
      and its weight and bias are Replicate DTensors of that mesh, whose shards the rebuild
      uses. Versions are checked on the DTensor and its shard (an in-place change counts on
      the one it went through).
    Left out (stored): a norm output that sequence parallel all-gathers before the Linear
    saves it (the saved tensor is the gathered one: no function of this rank's input without
    the collective), and a plain ``to_local()`` of a DTensor output (SequenceParallel's
    ``use_local_output=True``), whose DTensor's version counter the plain view does not see.
    Budget mode links them in traces alike (``TensorRecord.rebuild_from``; the recorder checks
    the input's placements as above). An input the plan kept qualifies as a moved one does: on
    the first way a plain tensor, on the second a DTensor of the output's mesh and placements
    whose shard is laid out as the output's; the recipe holds it and checks its versions (the
    DTensor's and its shard's) at unpack.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from offload._errors import OffloadError
from offload._family import aligned_buffer
from offload.lifecycle._tensors import (
    Activation,
    NormArgs,
    NormOutputs,
    ParameterStorages,
    is_dtensor,
    local_tensor,
    parameter_cast,
    tensor_versions,
)


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
    found = parameter_cast(t, params)
    return None if found is None else WeightCast(found[0], found[1], t)


class SharedRebuild:
    """One rebuild for every pack of one output (the q, k and v projections of one LayerNorm
    output each save it): the first unpack of a backward runs it, the others reuse it, and it
    is let go after the last of them (see NOTE [ Activation recipes ])."""

    __slots__ = ("members", "out", "pending")

    def __init__(self) -> None:
        self.members = 1  # recipes sharing it
        self.out: torch.Tensor | None = None  # held between its uses in one backward
        self.pending = 0  # uses of ``out`` still to come

    def hold(self, out: torch.Tensor) -> None:
        """``out`` was just rebuilt: keep it for the other members' unpacks."""
        if self.members > 1:
            self.out, self.pending = out, self.members

    def used(self) -> None:
        """One member's unpack took ``out``; after the last, it is let go."""
        self.pending -= 1
        if self.pending <= 0:
            self.out = None


class ActivationRecipe:
    """What pack returns for an activation output rebuilt from its input (see NOTE [ Activation
    recipes ]).

    ``parent``: a second handle on the input's offloaded family (``Executor.share``), or the
    input itself where the manager kept it (budget mode). ``key``: the record key under a plan
    (its unpack is a reload trigger), else None. ``step``: the executor's state of the step
    that packed it, held weakly (whose trigger table that key is looked up in), or None.
    ``shared``: the rebuild this pack shares with the other packs of the same output.
    """

    __slots__ = (
        "args",
        "cast",
        "dtensor",
        "key",
        "kind",
        "nbytes",
        "offset",
        "parent",
        "seq",
        "shared",
        "size",
        "step_ref",
        "stride",
        "version",
    )

    def __init__(
        self,
        found: Activation,
        parent: Any,
        *,
        key: tuple[str, int, int] | None = None,
        step: Any = None,
        shared: SharedRebuild | None = None,
    ) -> None:
        self.kind, self.args, self.parent = found.kind, found.args, parent
        self.shared = SharedRebuild() if shared is None else shared
        # Autocast's cast of the output (a LayerNorm's, in float32) is what was saved.
        self.cast = found.saved.dtype if found.saved is not found.out else None
        # The saved tensor's bytes (a DTensor's shard), and how to wrap them again (see NOTE
        # [ DTensor activation recipes ]).
        local = found.local
        self.size, self.stride = tuple(local.shape), local.stride()
        self.offset = local.storage_offset()
        self.dtensor = found.wrap
        self.nbytes = found.saved.untyped_storage().nbytes()
        # A kept DTensor input: an in-place change counts on the DTensor or on its shard.
        self.version = tensor_versions(parent) if isinstance(parent, torch.Tensor) else None
        self.key = key
        self.step_ref = None if step is None else weakref.ref(step)
        self.seq = -1  # the profiler's record number, during a recorded step

    @property
    def family(self) -> Any:
        """The input's alias family (whose step this backward belongs to); None for a kept
        input."""
        return getattr(self.parent, "family", None)

    def kept_input(self) -> torch.Tensor:
        """The kept input (``parent`` is a tensor), checked unchanged since the pack."""
        parent = self.parent
        if tensor_versions(parent) != self.version:
            raise OffloadError(
                f"the input of a {self.kind} of shape {list(parent.shape)} was changed in place "
                "after the forward that saved it (autograd would refuse its backward too); "
                "offload rebuilds the activation's output from it at backward"
            )
        return parent

    def view(self, out: torch.Tensor) -> torch.Tensor:
        """The saved tensor, a view of the rebuilt output ``out`` (a shard of it, wrapped as
        the DTensor it was: the executor's wrapping, NOTE [ DTensor activation recipes ])."""
        local = out.as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    def rebuild(self, parent: torch.Tensor) -> torch.Tensor:
        """The output again (whole: see :meth:`view`; a DTensor's shard) from its input
        ``parent`` (unpacked from ``self.parent``, or :meth:`kept_input`)."""
        kind, args = self.kind, self.args
        if is_dtensor(parent):  # the function ran on DTensors: on their shards alone
            parent = parent._local_tensor  # type: ignore[attr-defined]
        # As the forward ran it, whatever autocast state this backward runs in.
        with torch.no_grad(), torch.autocast(parent.device.type, enabled=False):
            if kind == "gelu":
                out = torch.nn.functional.gelu(parent, approximate=args)
            elif kind == "silu":
                out = torch.nn.functional.silu(parent)
            else:
                if not args.unchanged():
                    raise OffloadError(
                        f"the weight or bias of a {args.name} over {list(args.shape)} changed "
                        "in place between the forward that saved its output and this backward; "
                        "offload rebuilds that output from its input at backward, so the "
                        "weights must not change in between (step the optimizer after backward)"
                    )
                # A DTensor weight's (replicated) shard.
                weight = None if args.weight is None else local_tensor(args.weight)
                bias = None if args.bias is None else local_tensor(args.bias)
                if kind == "layer_norm":
                    out = torch.nn.functional.layer_norm(parent, args.shape, weight, bias, args.eps)
                else:
                    out = torch.nn.functional.rms_norm(parent, args.shape, weight, args.eps)
            if self.cast is not None:
                out = out.to(self.cast)
        return out


def hold_norm_weights(
    norms: NormOutputs, args: NormArgs, out: torch.Tensor, params: ParameterStorages
) -> None:
    """A norm output was just noted with ``args``: where its weight or bias is no registered
    parameter storage (FSDP2's unsharded parameter, freed after its unit's forward), the
    rebuild gets a copy of it, taken now; one already freed unnotes the output (see NOTE
    [ Activation recipes ])."""
    for name in ("weight", "bias"):
        w = getattr(args, name)
        if w is None:
            continue
        if type(w) is not torch.Tensor and type(w) is not torch.nn.Parameter:
            # A DTensor weight (tensor parallel): its shard must be the model's own; FSDP2's
            # unsharded one (2-D meshes) is not copied: the output is stored.
            if not is_dtensor(w) or not params.registered(w._local_tensor):
                norms.forget(out)
                return
            continue
        if params.registered(w):
            continue
        if w.untyped_storage().nbytes() == 0:
            norms.forget(out)
            return
        setattr(args, name, _aligned_copy(w))
        setattr(args, f"{name}_version", tensor_versions(getattr(args, name)))


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose address is congruent to ``t``'s modulo ALIGN_BYTES (kernels choose
    code paths by alignment; NOTE [ Alias handling ])."""
    with torch.no_grad():
        if not t.is_contiguous():
            return t.detach().clone()
        nbytes = t.numel() * t.element_size()
        raw, off = aligned_buffer(nbytes, t.data_ptr(), t.device)
        out = raw[off : off + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out
