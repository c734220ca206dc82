"""The recorder's module-call hooks: each call a frame on the shared call stack
(lifecycle/_calls.py, which numbers the record keys), its forward and backward spans as events,
and what the trace says about modules (stateful, checkpointed by the model, writing an input).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from offload.lifecycle._calls import CallStack, Frame, foreign_call, in_backward
from offload.lifecycle._tensors import (
    NormOutputs,
    is_compiled,
    named_modules_stop_at_compiled,
    tensors_in,
)
from offload.lifecycle._trace import EventKind

if TYPE_CHECKING:
    import threading


# NOTE [ Model checkpoints ]
#     A module called while non-reentrant ``torch.utils.checkpoint``'s pack hooks are the
#     innermost pair (the model checkpoints it, or a module around it, itself) is never
#     recomputed by a plan: checkpointing it again inside the model's checkpoint can make every
#     backward fail (``CheckpointError``: recomputed values with different metadata), and its
#     saves never reach offload's hooks anyway. A manager's own checkpoints (a plan recomputing a
#     module) enter :class:`PlannedCheckpoint` as their forward context, which marks their pack
#     hooks, so that a recorded planned step does not name the modules inside them.
_CHECKPOINT_PACK = "_checkpoint_hook."  # torch.utils.checkpoint's pack hook's __qualname__
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_planned_packs: weakref.WeakSet[Any] = weakref.WeakSet()


class PlannedCheckpoint:
    """The forward context (``context_fn``) of a checkpoint a manager's plan runs: marks the
    checkpoint's pack hook, the innermost when it is entered, as the plan's (NOTE [ Model
    checkpoints ])."""

    def __enter__(self) -> None:
        top = _top_hooks(False) if _top_hooks is not None else None
        if top is not None:
            _planned_packs.add(top[0])

    def __exit__(self, *exc: object) -> None:
        return None


def is_checkpoint_pack(fn: Any) -> bool:
    """Whether ``fn`` is non-reentrant ``torch.utils.checkpoint``'s pack hook."""
    return getattr(fn, "__qualname__", "").startswith(_CHECKPOINT_PACK)


def under_model_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are a checkpoint's the model entered itself
    (NOTE [ Model checkpoints ])."""
    top = _top_hooks(False) if _top_hooks is not None else None
    return top is not None and is_checkpoint_pack(top[0]) and top[0] not in _planned_packs


@dataclass
class _Call(Frame):
    """One module call being run: where packs go and what its backward hooks refer to."""

    # id -> grad_fn of each input at the call (see _forward_hook), and the handle of the hook
    # that marks the end of the call's backward.
    inputs: dict[int, Any] | None = None
    end_hook: Any = None
    buffers: tuple[tuple[torch.Tensor, int], ...] = ()  # the module's own, at the call
    versions: tuple[tuple[torch.Tensor, int], ...] = ()  # its tensor arguments, at the call


class CallHooks:
    """The module hooks of :class:`~offload.lifecycle.Recorder` (part of it)."""

    # The recorder's (see Recorder.__init__).
    _calls: CallStack
    _names: weakref.WeakKeyDictionary[nn.Module, str]
    _roots: weakref.WeakKeyDictionary[nn.Module, None]
    _global_roots: set[str]
    _compiled: set[int]
    _stateful: set[str]
    _checkpointed: set[str]
    _writes_input: set[str]
    _fill_after_pack: set[str]
    _norms: NormOutputs
    _recording: bool
    _thread: int | None
    _lock: threading.RLock
    _graph_task: int | None

    def add_parameters(self, module: nn.Module) -> None:
        raise NotImplementedError  # Recorder's

    def _event(self, kind: EventKind, module: str = "", call_index: int = -1) -> None:
        raise NotImplementedError  # Recorder's

    def _backward_signal(self) -> None:
        raise NotImplementedError  # Recorder's

    # -- module hooks ------------------------------------------------------------------------

    def _global_pre_hook(self, module: nn.Module, args: Any) -> None:
        if foreign_call(self._thread):
            return  # another thread's module: not named after what this thread runs
        if module not in self._names:
            if not self._calls.frames:
                root = type(module).__name__
                self._roots[module] = None
                self._global_roots.add(root)
                for name, mod in named_modules_stop_at_compiled(module):
                    if is_compiled(mod):
                        self._compiled.add(id(mod))
                    if mod not in self._names:
                        self._names[mod] = f"{root}.{name}" if name else root
                self.add_parameters(module)
            else:
                parent = self._calls.frames[-1].module
                self._names[module] = f"{parent}.<{type(module).__name__}>"
                self.add_parameters(module)
        self._forward_pre_hook(module, args)

    def _forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self._recording or foreign_call(self._thread):
            return
        name = self._names.get(module, type(module).__name__)
        # A compiled module is a leaf (no hooks inside): it answers for its whole subtree.
        leaf = id(module) in self._compiled
        if any(
            isinstance(m, _NormBase) and m.training and m.track_running_stats
            for m in (module.modules() if leaf else (module,))
        ):
            self._stateful.add(name)
        # F.rrelu in training saves its noise tensor and then fills it, and the fill leaves the
        # version counter as it was (torch 2.13; NOTE [ Fill after pack ] in
        # offload/_pack.py: offload defers such copies). offload also keeps every
        # nn.RReLU's saved tensors where they are; a plan made from this trace must count them
        # kept too (a plan that moved them on paper was 1.6x over its budget).
        if isinstance(module, nn.RReLU):
            self._fill_after_pack.add(name)
        with self._lock:
            idx = self._calls.call_index(name)
            call = _Call(name, idx)
            if module._buffers or leaf:
                buffers = module.buffers() if leaf else module._buffers.values()
                call.buffers = tuple((b, b._version) for b in buffers if b is not None)
            backward = in_backward()
            self._calls.push(call, backward)
            self._event(EventKind.FORWARD_START, name, idx)
            if backward:
                return
            if not torch.is_grad_enabled():
                return
        args_in = list(tensors_in(args))
        call.inputs = {id(t): t.grad_fn for t in args_in}
        call.versions = tuple((t, t._version) for t in args_in)
        if under_model_checkpoint():
            self._checkpointed.add(name)
        # The gradient of the first differentiable input marks the end of the module's backward.
        for t in args_in:
            if t.requires_grad and t.grad_fn is not None:
                call.end_hook = t.register_hook(_BackwardEnd(self, name, idx))
                break

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording or foreign_call(self._thread):
            return
        with self._lock:
            if not self._calls.frames:
                return
            call = self._calls.pop()
            self._event(EventKind.FORWARD_END, call.module, call.call_index)
            if any(b._version != v for b, v in call.buffers):
                # Its forward changed its own buffers in place (running statistics, a spectral
                # norm's power iteration): running it again would change them twice.
                self._stateful.add(call.module)
            if any(t._version != v for t, v in call.versions):
                self._writes_input.add(call.module)
            call.versions = ()
            if in_backward() or not torch.is_grad_enabled():
                return
        self._norms.note(module, output)
        outputs = list(tensors_in(output))
        # A module that hands back its inputs untouched (Dropout(0.0) or Dropout in eval mode,
        # Identity) has no backward of its own: its outputs' node is the one that made its
        # input, whose pre-hook fires after the gradient of that input is known, so the end hook
        # would fire before the start. Its backward is an empty span at that start instead (the
        # one offload's executor triggers at for the call). An in-place module (ReLU(inplace=True))
        # hands back its input too, with a node of its own: it keeps both hooks.
        inputs = call.inputs or {}
        through = bool(outputs) and all(
            id(t) in inputs and inputs[id(t)] is t.grad_fn for t in outputs
        )
        if through and call.end_hook is not None:
            call.end_hook.remove()
        # A pre-hook on the outputs' grad_fn fires right before the module's backward starts and,
        # unlike register_full_backward_pre_hook, leaves the graph alone (an in-place op after the
        # module keeps working).
        seen: set[int] = set()
        hook = _BackwardStart(self, call.module, call.call_index, ends=through)
        for t in outputs:
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(hook)


class _BackwardStart:
    __slots__ = ("call_index", "ends", "fired", "module", "rec")

    def __init__(self, rec: CallHooks, module: str, call_index: int, ends: bool = False):
        self.rec, self.module, self.call_index, self.fired = rec, module, call_index, False
        self.ends = ends  # a pass-through module's: its backward ends where it starts

    def __call__(self, grad_outputs: Any) -> None:
        rec = self.rec
        if self.fired or not rec._recording:
            return None
        self.fired = True
        with rec._lock:
            rec._event(EventKind.BACKWARD_START, self.module, self.call_index)
            if self.ends:
                rec._event(EventKind.BACKWARD_END, self.module, self.call_index)
        rec._backward_signal()
        return None


class _BackwardEnd:
    __slots__ = ("call_index", "module", "rec")

    def __init__(self, rec: CallHooks, module: str, call_index: int):
        self.rec, self.module, self.call_index = rec, module, call_index

    def __call__(self, grad: torch.Tensor) -> None:
        rec = self.rec
        if rec._recording:
            with rec._lock:
                rec._event(EventKind.BACKWARD_END, self.module, self.call_index)
        return None
