"""The manager's unpack hook: a saved tensor back for backward, whatever its pack made of it.

A kept tensor (its version checked, NOTE [ Kept tensors keep autograd's check ] in _pack.py),
a deferred pack, a weight cast or an activation recipe rebuilt, or an offloaded member reloaded
by the executor after the reloads planned to start at this unpack. The first unpack of each
backward registers that backward's end (``on_backward_begin``). Per tensor: the hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offload import _reload
from offload._errors import modified_after_save
from offload._executor import Executor
from offload._family import Family, _Member
from offload._pack import _check_kept, _Deferred
from offload._recipe import ActivationRecipe, WeightCast

if TYPE_CHECKING:
    from offload._hooks import StepEnd
    from offload._planned import Profiler
    from offload._step import Step

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class Unpacker:
    """Unpacks what the manager's packs returned. ``task_ends``: the end callback of each
    backward running (by graph task), shared with the manager; ``on_backward_begin(task)``
    makes and queues one at a backward's first unpack."""

    def __init__(
        self, task_ends: dict[int, StepEnd], on_backward_begin: Callable[[int], StepEnd]
    ) -> None:
        self.task_ends = task_ends
        self.on_backward_begin = on_backward_begin
        self.meter: Any = None  # offload._live.SavedBytes while one counts (tests, benchmarks)

    def unpack(
        self,
        packed: Any,
        step: Step | None,
        ex: Executor | None,
        profiler: Profiler | None,
        prof: Profiler | None,
    ) -> torch.Tensor:
        """The unpack hook: ``step`` and ``ex`` are the manager's current ones, ``profiler`` its
        profiler (recording or not), ``prof`` the profiler while a step is recorded."""
        task = _current_graph_task_id() if _current_graph_task_id is not None else 0
        # Unpack also runs outside backward (``grad_fn._saved_self``), where queue_callback
        # raises "Final callbacks can only be installed during backward pass".
        if task != -1:
            end = self.task_ends.get(task)
            if end is None:
                end = self.on_backward_begin(task)
            if end.step is None:
                # Whose backward this is: the step that packed the first offloaded tensor it
                # unpacks (with two forwards before their backwards, pipelining or
                # accumulation, not the current one). Kept tensors do not say.
                fam = getattr(packed, "family", None)
                if fam is not None and fam.step_ref is not None:
                    end.step = fam.step_ref()
        if type(packed) is not _Member:  # an offloaded tensor, the common case, goes on below
            if type(packed) is _Deferred:
                if step is not None and step.deferred and packed.tensor is not None:
                    # The backward of this step's last ops has begun (not an earlier step's,
                    # run inside this one: its packs were stored at its exit).
                    keep_deferred(step)
                if packed.seq >= 0 and profiler is not None:
                    profiler.recorder.record_unpack(packed.seq, held=packed)
                if packed.error is not None:
                    raise packed.error
                if packed.member is None:
                    assert packed.tensor is not None
                    if packed.tensor._version != packed.version:
                        raise modified_after_save(
                            f"a tensor saved by {packed.module}", packed.tensor, packed.version
                        )
                    return packed.tensor.detach()
                packed = packed.member
            elif isinstance(packed, torch.Tensor):
                _check_kept(packed)
                if step is not None and step.kept_seq and profiler is not None:
                    profiler.recorder.record_unpack(step.kept_seq.get(id(packed), -1), held=packed)
                return packed
            if isinstance(packed, WeightCast):
                if packed.seq >= 0 and profiler is not None:
                    profiler.recorder.record_unpack(packed.seq, held=packed)
                return packed.rebuild()
            if isinstance(packed, ActivationRecipe):
                return self.rebuild(packed, ex, profiler, prof)
        elif packed.seq >= 0 and profiler is not None:
            # What autograd holds: the recorder learns from it whether the graph outlives this
            # backward (NOTE [ Retained graphs ] in lifecycle's recorder).
            profiler.recorder.record_unpack(packed.seq, held=packed)
        if prof is None:
            # unpack_member, inline (once per saved tensor)
            ref = packed.family.step_ref
            packed_by = ref() if ref is not None else None
            if packed_by is not None and packed_by.triggers:
                self.start_triggered(packed.executor, packed_by, packed.key)
            return _reload.unpack(packed.executor, packed, packed_by, task)
        held = prof.compute_clock
        if held is None:
            return self.unpack_member(packed.executor, packed, None, task)
        started = time.perf_counter()
        try:
            return self.unpack_member(packed.executor, packed, None, task)
        finally:
            held.held_s += time.perf_counter() - started

    def rebuild(
        self,
        recipe: ActivationRecipe,
        ex: Executor | None,
        profiler: Profiler | None,
        prof: Profiler | None,
    ) -> torch.Tensor:
        """Unpack of an activation output: its input's bytes through the activation again."""
        if recipe.seq >= 0 and profiler is not None:
            profiler.recorder.record_unpack(recipe.seq, held=recipe)
        held = prof.compute_clock if prof is not None else None
        started = time.perf_counter() if held is not None else 0.0
        try:
            parent, shared = recipe.parent, recipe.shared
            out = shared.out
            if out is not None:  # rebuilt for another pack of the same output
                family = getattr(parent, "family", None)
                ref = family.step_ref if family is not None else recipe.step_ref
                self.start_triggered(ex, ref() if ref else None, recipe.key)
            elif isinstance(parent, _Member):
                # The record's own reload trigger (its input's, as planned) fires first.
                out = recipe.rebuild(self.unpack_member(parent.executor, parent, recipe.key))
            else:
                ref = recipe.step_ref
                step = ref() if ref is not None else None
                self.start_triggered(ex, step, recipe.key)
                out = recipe.rebuild(recipe.kept_input())
            if shared.out is None:
                if self.meter is not None:  # the rebuilt bytes are held from here, as planned
                    self.meter.watch(out.untyped_storage())
                shared.hold(out)
            if shared.out is not None:
                shared.used()
            return recipe.view(out)
        finally:
            # A recorded planned step on CPU: the rebuild is the plan's cost, not the model's
            # (as a copy's; see ComputeClock in _planned.py).
            if held is not None:
                held.held_s += time.perf_counter() - started

    def unpack_member(
        self, ex: Executor, packed: Any, key: Any = None, task: int | None = None
    ) -> torch.Tensor:
        """``ex.unpack(packed)`` after the reloads planned to start at this unpack (of
        ``packed``'s key, or ``key``: the record a recipe stands for) have started; ``task``:
        the running backward's graph task, where the caller read it."""
        ref = packed.family.step_ref
        step = ref() if ref is not None else None
        if step is not None and step.triggers:
            self.start_triggered(ex, step, key if key is not None else packed.key)
        return _reload.unpack(ex, packed, step, task)  # Executor.unpack, one call less

    @staticmethod
    def start_triggered(ex: Executor | None, step: Any, key: Any) -> None:
        if ex is not None and step is not None and step.triggers and key is not None:
            waiting = step.triggers.get(("unpack", *key))  # a family, or a list of them
            if waiting:
                ex.prefetch((waiting,) if type(waiting) is Family else waiting, step, window=False)


def keep_deferred(step: Step) -> None:
    """Backward has begun: a pack still waiting stays where it is (copied now, it would
    come back at once)."""
    pending, step.deferred = step.deferred, []
    stats = step.stats
    for ref in pending:
        d = ref()
        if d is not None and d.tensor is not None and stats is not None:
            stats.records_kept += 1
