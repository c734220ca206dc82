"""Small facts about tensors and modules that the recorder and the offloader both need."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, cast

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


def version_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: its base when ``t`` is a view, else ``t``.

    Saved tensors with the same root share one version counter, so equal ``_version`` means equal
    bytes. Tensors that share a storage without a common root count their in-place changes
    apart: ``unsafe_chunk`` / ``unsafe_split`` outputs (GRU cells make them, then change each in
    place) reach equal versions holding different bytes. (``detach()`` shares its source's counter
    without being a view: such pairs count as apart, which costs a copy, never a wrong byte.)
    """
    base = t._base  # set exactly when ``t._is_view()``
    return t if base is None else base


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ``nn.Parameter`` (a subclass included)."""
    # ``isinstance(t, nn.Parameter)`` goes through a metaclass hook and a failed attribute lookup
    # (an exception) for plain tensors: several microseconds per pack. Plain tensors answer first.
    tt = type(t)
    return tt is not torch.Tensor and (tt is nn.Parameter or isinstance(t, nn.Parameter))


def wraps_parameter(t: torch.Tensor) -> bool:
    """Whether ``t``, a tensor subclass (a DTensor), is a Parameter or a view of one itself.

    Its local shard may be neither: FSDP2's unsharded parameter on a 2-D mesh (FSDP over tensor
    parallel) is a DTensor Parameter whose shard is a plain view of FSDP2's all-gather output, a
    storage no registered parameter holds and FSDP2 frees after the forward. (On a 1-D mesh the
    unsharded parameter is a plain Parameter.)"""
    base = t._base
    return is_parameter(t) or (base is not None and is_parameter(base))


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


def is_compiled(mod: nn.Module) -> bool:
    """Whether ``mod`` runs compiled: ``torch.compile(mod)`` wraps it in an OptimizedModule;
    ``mod.compile()`` sets a compiled call; ``mod.forward = torch.compile(mod.forward)`` sets a
    compiled forward on the instance (dynamo marks what it wraps ``_torchdynamo_orig_callable``;
    hooks inside it split its graph as they do any other's)."""
    # Only look for OptimizedModule when dynamo was imported (importing it costs seconds).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame else ()
    return (
        bool(optimized and isinstance(mod, optimized))
        or bool(getattr(mod, "_compiled_call_impl", None))
        or hasattr(mod.__dict__.get("forward"), "_torchdynamo_orig_callable")
    )


def named_modules_stop_at_compiled(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``named_modules()``, without descending into compiled modules."""

    def walk(prefix: str, mod: nn.Module) -> Iterable[tuple[str, nn.Module]]:
        yield prefix, mod
        if is_compiled(mod):
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

    @property
    def by_id(self) -> dict[int, weakref.ref]:
        """``id(storage) -> weak reference to it``, for every registered storage (the same dict
        for this object's life, for hot paths that look a storage up without a call)."""
        return self._refs

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
        ref = self._refs.get(id(storage))  # _has, inline: once per saved tensor
        if ref is not None and ref() is storage:
            return True
        base = t._base
        return is_parameter(t) or (base is not None and is_parameter(base))

    def _has(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage


# The autograd nodes whose outputs :func:`activation_output` recognises, and their functions.
ACTIVATION_NODES = {
    "GeluBackward0": "gelu",
    "SiluBackward0": "silu",
    "NativeLayerNormBackward0": "layer_norm",
    "FusedRmsNormBackward0": "rms_norm",
}
# Every node whose output :func:`parameter_cast` or :func:`activation_output` can recognise
# (a plain tensor made by another node is neither: a pack asks this first, once per tensor).
RECIPE_NODES = frozenset({"ToCopyBackward0", *ACTIVATION_NODES})
# The name each node keeps its saved input under (read raw: as its pack hook returned it).
_SAVED_INPUT = {
    "gelu": "_raw_saved_self",
    "silu": "_raw_saved_self",
    "layer_norm": "_raw_saved_input",
    "rms_norm": "_raw_saved_input",
}
# Norm modules whose outputs are noted, and the node their own output has. ``nn.RMSNorm`` makes
# a ``FusedRmsNormBackward0`` where ``_fused_rms_norm`` has a kernel (CUDA); on CPU its graph is
# a chain of elementwise nodes, none of which saves the input whole, and its outputs are stored.
NORM_MODULES = {
    nn.LayerNorm: "NativeLayerNormBackward0",
    nn.RMSNorm: "FusedRmsNormBackward0",
}


class NormArgs:
    """What a norm output is rebuilt with besides its input: the node of a LayerNorm (an
    RMSNorm) saves the input, the weight (and the bias) but not ``eps``, so the forward hook of
    the module that made the output notes them all (:class:`NormOutputs`). The weight and bias
    versions are checked at the rebuild: changed in place in between, they would give another
    output."""

    __slots__ = ("bias", "bias_version", "eps", "name", "shape", "weight", "weight_version")

    def __init__(self, module: nn.LayerNorm | nn.RMSNorm) -> None:
        self.name = type(module).__name__
        self.shape = tuple(module.normalized_shape)
        self.eps = module.eps  # an RMSNorm's may be None (the dtype's own)
        self.weight = module.weight
        self.bias = getattr(module, "bias", None)
        self.weight_version = tensor_versions(self.weight)
        self.bias_version = tensor_versions(self.bias)

    def unchanged(self) -> bool:
        return tensor_versions(self.weight) == self.weight_version and (
            tensor_versions(self.bias) == self.bias_version
        )


def tensor_versions(t: torch.Tensor | None) -> tuple[int, int]:
    """``t``'s version and its local shard's (-1 for None): an in-place change of a DTensor
    counts on the DTensor, one made through its ``_local_tensor`` on the shard only."""
    if t is None:
        return (-1, -1)
    local = t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]
    return (t._version, local._version)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a subclass included), without importing
    ``torch.distributed`` (which costs seconds)."""
    tt = type(t)
    if tt is torch.Tensor or not hasattr(t, "_local_tensor"):
        return False
    dt = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dt is not None and isinstance(t, dt)


def dtensor_spec(t: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(mesh, placements)`` of a DTensor ``t``, else None."""
    return (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None


class NormOutputs:
    """The outputs of ``nn.LayerNorm`` and ``nn.RMSNorm`` modules in the step, each with its
    :class:`NormArgs`, noted by forward hooks and found again from the output's autograd node
    (an autocast cast of the output leads back to that node only). Entries go with their
    outputs. Only modules of exactly those types: a subclass may compute its output otherwise
    (a cast around it, another eps)."""

    def __init__(self) -> None:
        # id(output's grad_fn) -> (weak output, its arguments, its version when noted). Autograd
        # nodes take no weak references; the output holds its node, so the id is not reused
        # while the entry lives.
        self._by_node: dict[int, tuple[weakref.ref[torch.Tensor], NormArgs, tuple[int, int]]] = {}

    def note(self, module: nn.Module, output: Any) -> NormArgs | None:
        """From a forward hook: ``output`` of ``module``, if it is a norm module's own output;
        the arguments noted with it, or None."""
        node = NORM_MODULES.get(type(module))
        if node is None or (type(output) is not torch.Tensor and not is_dtensor(output)):
            return None
        fn = output.grad_fn
        if fn is None or type(fn).__name__ != node:
            return None
        key, table = id(fn), self._by_node

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            if table.get(key, (None,))[0] is ref:
                del table[key]

        args = NormArgs(cast("nn.LayerNorm | nn.RMSNorm", module))  # its type was checked
        table[key] = (weakref.ref(output, forget), args, tensor_versions(output))
        return args

    def forget(self, output: torch.Tensor) -> None:
        """Drop ``output``'s entry (its arguments cannot rebuild it)."""
        fn = output.grad_fn
        if fn is not None:
            self._by_node.pop(id(fn), None)

    def output_of(self, fn: Any) -> tuple[torch.Tensor, NormArgs] | None:
        """The noted output whose autograd node is ``fn``, unchanged since, and its arguments."""
        got = self._by_node.get(id(fn))
        if got is None:
            return None
        out = got[0]()
        if out is None or out.grad_fn is not fn or tensor_versions(out) != got[2]:
            return None
        return out, got[1]

    def __bool__(self) -> bool:
        return bool(self._by_node)


class Activation(NamedTuple):
    """A saved tensor :func:`activation_output` recognises."""

    kind: str  # "gelu", "silu", "layer_norm" or "rms_norm"
    args: Any  # GELU's ``approximate``, a norm's NormArgs, or ""
    packed: Any  # what the pack of the function's input returned (read raw)
    out: torch.Tensor  # the function's output (its input's shape and dtype; a DTensor's shard)
    saved: torch.Tensor  # the storage the saved tensor views: ``out``, or autocast's cast of it
    # The saved tensor's bytes as a plain tensor (a view of ``saved``'s storage): the tensor
    # itself, or a DTensor's local shard. The rebuild is viewed as it is.
    local: torch.Tensor
    # ``(mesh, placements)`` of the DTensor the function ran on, whose input must be a DTensor
    # alike (``dtensor_spec`` of the input); None: it ran on plain tensors (a plain input).
    spec: tuple[Any, tuple[Any, ...]] | None = None
    # ``(mesh, placements, shape, stride)`` when the saved tensor is a DTensor: the rebuilt
    # ``local`` view is wrapped so (``DTensor.from_local(..., run_check=False)``), else None.
    wrap: tuple[Any, tuple[Any, ...], torch.Size, tuple[int, ...]] | None = None


def _dense(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def activation_output(t: torch.Tensor, norms: NormOutputs | None = None) -> Activation | None:
    """What ``t`` is if it is, or views, a GELU / SiLU output, a LayerNorm / RMSNorm output that
    ``norms`` noted, or autocast's dtype cast of such a norm output (NOTE [ Activation recipes ]
    in ``offload/_recipe.py``), else None. A DTensor counts where its local shard is the
    function of its input's local shard (NOTE [ DTensor activation recipes ] there): the
    function ran on DTensors, or on the plain tensor ``DTensor.from_local`` wrapped."""
    if type(t) is torch.Tensor:
        return _plain_activation_output(t, norms)
    if not is_dtensor(t):
        return None
    local = t._local_tensor  # type: ignore[attr-defined]
    if type(local) is not torch.Tensor:
        return None  # an AsyncCollectiveTensor: a collective's result, no function's
    dt = t._base if t._base is not None else t  # Linear saves a 2-D view of a 3-D input
    fn: Any = dt.grad_fn
    found: Activation | None
    if type(fn).__name__ == "_FromTorchTensorBackward":
        # ``from_local`` of a plain tensor (ColwiseParallel's replicated input, RowwiseParallel's
        # sharded one): its shard is a view (``view_as``) of that tensor.
        src = dt._local_tensor._base  # type: ignore[attr-defined]
        found = None if type(src) is not torch.Tensor else _plain_activation_output(src, norms)
    else:
        found = _dtensor_function_output(dt, fn, norms)
    if found is None:
        return None
    # The shard the saved DTensor views is the output's (its own view was made below autograd,
    # without a base: the storage tells).
    st, saved_st = local.untyped_storage(), found.saved.untyped_storage()
    if st.data_ptr() != saved_st.data_ptr() or st.nbytes() != saved_st.nbytes():
        return None
    wrap = (t.device_mesh, tuple(t.placements), t.shape, t.stride())  # type: ignore[attr-defined]
    return found._replace(local=local, wrap=wrap)


def _dtensor_function_output(dt: torch.Tensor, fn: Any, norms: NormOutputs | None) -> Any:
    """The :class:`Activation` for ``dt``, a DTensor whose autograd node ``fn`` is a GELU /
    SiLU / noted norm's that ran on DTensors, where its shard is the function of its input's
    shard alone; else None."""
    kind = ACTIVATION_NODES.get(type(fn).__name__)
    if kind is None:
        return None
    out = dt._local_tensor  # type: ignore[attr-defined]
    spec = dtensor_spec(dt)
    if type(out) is not torch.Tensor or spec is None or not _dense(out):
        return None
    # A Partial output holds partial sums: no function's output. (A Partial input gives a
    # Replicate output, after the all-reduce: the callers find the placements differ.)
    if not all(p.is_shard() or p.is_replicate() for p in spec[1]):
        return None
    args: Any = ""
    if kind in ("gelu", "silu"):
        if dt._version != 0 or out._version != 0:
            return None  # changed in place since (see _plain_activation_output)
        if kind == "gelu":
            args = str(getattr(fn, "_saved_approximate", "none"))
    else:
        noted = norms.output_of(fn) if norms is not None else None
        if noted is None or noted[0] is not dt:
            return None
        args = noted[1]
        # Per shard equals global only where no normalised dim is sharded, and the weight and
        # bias are whole on every rank.
        first = dt.ndim - len(args.shape)
        if any(p.is_shard() and p.dim % dt.ndim >= first for p in spec[1]):
            return None
        for w in (args.weight, args.bias):
            wspec = None if w is None else dtensor_spec(w)
            if w is not None and (
                wspec is None
                or wspec[0] != spec[0]
                or not all(p.is_replicate() for p in wspec[1])
                or type(w._local_tensor) is not torch.Tensor
            ):
                return None
    packed = getattr(getattr(fn, _SAVED_INPUT[kind], None), "data", None)
    if packed is None:
        return None
    return Activation(kind, args, packed, out, out, out, spec)


def _plain_activation_output(t: torch.Tensor, norms: NormOutputs | None) -> Activation | None:
    saved = t._base if t._base is not None else t
    out = saved
    fn: Any = saved.grad_fn
    name = type(fn).__name__ if fn is not None else ""
    noted = None
    if name == "ToCopyBackward0":
        # Under autocast a norm runs in float32 and the next Linear saves a cast of its output,
        # whose only input is the norm's node.
        if not norms:  # no norm output noted: not one of theirs (and no node walk)
            return None
        nxt = fn.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        noted = norms.output_of(nxt[0][0])
        if noted is None or type(noted[0]) is not torch.Tensor:
            return None
        out, fn = noted[0], nxt[0][0]
        name = type(fn).__name__
        if out.device != saved.device or out.shape != saved.shape or out.dtype == saved.dtype:
            return None
    kind = ACTIVATION_NODES.get(name)
    if kind is None or not _dense(out) or not _dense(saved):
        return None
    if kind in ("gelu", "silu") and out._version != 0:
        # Changed in place since the op made it (under no_grad, which leaves its node as it
        # was; or made in place, ``silu(x, inplace=True)``): the function of its input is no
        # longer what it holds. (Norm outputs: NormOutputs checks. A change through ``.data``
        # bumps no version: like autograd, offload cannot see it;
        # docs/troubleshooting.md, Known limits.)
        return None
    args: Any = ""
    if kind == "gelu":
        args = str(getattr(fn, "_saved_approximate", "none"))
    elif kind in ("layer_norm", "rms_norm"):
        if noted is None:
            noted = norms.output_of(fn) if norms is not None else None
        if noted is None or noted[0] is not out:
            return None
        args = noted[1]
    # The node's saved input as its pack hook returned it, without unpacking it.
    packed = getattr(getattr(fn, _SAVED_INPUT[kind], None), "data", None)
    if packed is None:
        return None
    return Activation(kind, args, packed, out, saved, t)


def parameter_cast(
    t: torch.Tensor, params: ParameterStorages
) -> tuple[nn.Parameter, torch.Tensor] | None:
    """``(parameter, cast)`` when ``t`` is a dtype cast of one of ``params``' parameters, or a
    view of one (a Linear under autocast saves its weight's cast, transposed), laid out as the
    parameter is; else None. Such a cast can be made again from its parameter at unpack, so it
    is no activation: ``offload`` never stores it (NOTE [ Weight casts ]) and the recorder
    records it as a parameter."""
    if type(t) is not torch.Tensor:
        return None
    cast = t._base if t._base is not None else t
    fn = cast.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return None
    nxt = fn.next_functions
    acc = nxt[0][0] if nxt else None
    param = getattr(acc, "variable", None)
    if type(param) is not nn.Parameter or not params.registered(param):
        return None
    if (
        cast.device != param.device
        or cast.shape != param.shape
        or cast.stride() != param.stride()
        or cast.storage_offset() != 0
        or cast.untyped_storage().nbytes() != cast.numel() * cast.element_size()
    ):
        return None
    return param, cast
