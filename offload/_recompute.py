"""The modules a plan recomputes: each runs its forward through a ``RecomputeForward``
(offload/_planned.py), which asks, call by call, whether this call is the plan's to checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offload._planned import ActivePlan, RecomputeForward
from offload._resources import _uninstall_forwards
from offload.lifecycle._calls import foreign_call
from offload.lifecycle._tensors import named_modules_stop_at_compiled

if TYPE_CHECKING:
    from offload._budget import Budget
    from offload._step import Step

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class Recomputes:
    """The RecomputeForwards a manager installed; what they call back (``_recompute_this``,
    ``_checkpoint_context``: a RecomputeForward holds this object weakly, as its manager)."""

    def __init__(
        self,
        model_ref: weakref.ref[nn.Module],
        budget: Budget,
        current: Callable[[], Step | None],
    ) -> None:
        self._model_ref, self._budget, self._current = model_ref, budget, current
        # Module name -> (module, its RecomputeForward), both weakly, and whether the forward it
        # wraps was the module's own attribute (set on the instance: close() puts it back).
        self.installed: dict[str, tuple[weakref.ref[nn.Module], weakref.ref[Any], bool]] = {}

    def install(self, active: ActivePlan) -> None:
        """The modules ``active`` recomputes run their forward through a RecomputeForward."""
        model = self._model_ref()
        if model is None or not active.recompute_modules:
            return
        # torch.utils.checkpoint.checkpoint imports torch._dynamo at its first call (its
        # disable-dynamo wrapper). That import leaves reference cycles through the frames it
        # runs under, up to the model's forward; run inside the first planned step, which the
        # recorder times with the cyclic GC off (NOTE [ Refinement ]), they held the forward's
        # locals (saved tensors autograd had released) until the step ended. Here, before the
        # recorder begins, the frames are the step's caller's and the root call's.
        import torch._dynamo  # noqa: F401

        modules = dict(named_modules_stop_at_compiled(model))
        for name in active.recompute_modules - self.installed.keys():
            mod = modules.get(name)
            if mod is None:
                continue
            own = "forward" in mod.__dict__  # ``module.forward = ...`` by the user (or a tool)
            wrapper = RecomputeForward(self, name, mod.forward)
            mod.forward = wrapper  # type: ignore[method-assign]
            # Weakly (the finalizer holds this dict): the model's lifetime is its owner's.
            self.installed[name] = (weakref.ref(mod), weakref.ref(wrapper), own)

    def _checkpoint_context(self, name: str, module: Any) -> Callable[[], tuple[Any, Any]]:
        """Called by a RecomputeForward about to checkpoint a call of ``name`` (``module``):
        checkpoint's ``context_fn`` (NOTE [ Verified recomputation ] in _verify.py)."""
        budget = self._budget
        return budget._verifier.context_fn(budget._last_signature or "", name, module)

    def uninstall(self) -> None:
        _uninstall_forwards(self.installed)

    def _recompute_this(self, name: str) -> tuple[str, int] | None:
        """Called by a RecomputeForward: the (module, call) to checkpoint now, or None."""
        step = self._current()
        if step is None or not step.running or not step.calls.frames:
            return None
        active = step.active
        if active is None or not torch.is_grad_enabled():
            return None
        if name in self._budget._verifier.differing:
            return None  # see NOTE [ Verified recomputation ] in _verify.py
        if foreign_call(step.thread):
            return None  # another thread's call: as it is (no stack entry of its own is on top)
        if _current_graph_task_id is not None and _current_graph_task_id() != -1:
            return None  # a recomputation or double backward runs it: as it is
        if step.diverged is not None:
            return None  # off the plan's sequence (NOTE [ Structure ])
        top = step.calls.frames[-1]
        call = (top.module, top.call_index)
        if top.module != name or call not in active.recompute_calls:
            return None
        step.stats.bytes_recomputed = active.recompute_bytes
        return call
