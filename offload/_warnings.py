"""Every warning the manager gives a user: the warn-once helper, the user's stack level, the texts.

A warning is said once per key (per manager) at the user's line: the first frame outside
offload, lifecycle and torch, wherever in the manager it is said.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

from offload import lifecycle
from offload._device import compute_device
from offload._verify import is_tap_pack
from offload.lifecycle._blocks import within
from offload.lifecycle._calls import OUTSIDE
from offload.lifecycle._recorder_calls import is_checkpoint_pack
from offload.lifecycle._tensors import is_compiled, named_modules_stop_at_compiled

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, from the function calling this, of the first frame
    outside this package, lifecycle and torch: the user's line, whether they made the manager
    or :func:`activations` made it for them, or a module hook warns (torch's ``Module.__call__``
    runs it)."""
    ours = (
        os.path.dirname(os.path.abspath(__file__)) + os.sep,
        os.path.dirname(os.path.abspath(lifecycle.__file__)) + os.sep,
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    )
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(ours):
        level, frame = level + 1, frame.f_back
    return level


class WarnOnce:
    """``warn(key, msg)``: a RuntimeWarning ``"offload: <msg>"`` once per ``key``, at the user's
    line. The executor is given this object (not the manager, which its finalizer must not
    keep alive)."""

    __slots__ = ("warned",)

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.warned

    def __call__(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"offload: {msg}", RuntimeWarning, stacklevel=_user_stacklevel())


# -- from the constructor ------------------------------------------------------------------------


def _warn_nvme_dir_ignored(nvme_dir: Any, tiers: tuple[str, ...]) -> None:
    # Not an error (a script's settings may name a spill directory it does not always
    # use), but said: nothing goes there, and the directory is not checked.

    warnings.warn(
        f"offload: nvme_dir={os.fspath(nvme_dir)!r} is ignored: 'nvme' is not in "
        f"tiers={tiers!r}; add 'nvme' to tiers to spill there, or leave nvme_dir out",
        RuntimeWarning,
        stacklevel=_user_stacklevel(),
    )


def _warn_keep_covers_nothing(
    model: nn.Module, names: frozenset[str], types: tuple[type, ...]
) -> None:
    """Warn (once, from the constructor) about ``keep=`` entries that can keep nothing: a type
    no module of the model has, or a module inside a compiled one (whose call is a leaf to the
    manager: see NOTE [ Keep covers the module tree ])."""
    reachable = dict(named_modules_stop_at_compiled(model))
    hidden = sorted(names - reachable.keys())
    if hidden:
        compiled = sorted(
            n for n, m in reachable.items() if is_compiled(m) and within(hidden[0], [n])
        )
        warnings.warn(
            f"offload: keep={hidden!r} keeps nothing: those modules lie inside the compiled "
            f"module {compiled[0] if compiled else '?'!r}, whose call the manager sees as one "
            "(what they save is saved in that call, and moves). Keep the compiled module, or "
            "compile a smaller part",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )
    absent = [t.__name__ for t in types if not any(isinstance(m, t) for m in reachable.values())]
    if absent:
        warnings.warn(
            f"offload: keep names types {absent} that no module of the model (outside compiled "
            "ones) has: they keep nothing. Name modules of this model, or their types",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )


def _warn_plan_without_kept(unplanned: set[str]) -> None:
    """The given ``plan=`` was made without modules this manager keeps."""

    warnings.warn(
        f"offload: this manager keeps modules {sorted(unplanned)} (named in keep=, "
        "or nn.RReLU, always kept) that the given plan= was not made with: their "
        "saved tensors stay on the device while the plan counts them moved or "
        "recomputed, so the budget may not hold. Let the manager profile and plan "
        "(no plan=) to have them counted.",
        RuntimeWarning,
        stacklevel=_user_stacklevel(),
    )


# -- at a step's start and end -------------------------------------------------------------------


def _warn_foreign_around(warn: WarnOnce) -> None:
    warn(
        "foreign",
        "another saved_tensors_hooks context is active around this step; offload's "
        "hooks take precedence inside it",
    )


def _warn_uncompiled(warn: WarnOnce, call: Any, model: nn.Module | None) -> None:
    """A module lost the compiled call the manager's hooks run around (NOTE [ Hooks of a
    compiled call ])."""
    names = {m: n for n, m in model.named_modules()} if model is not None else {}
    warn(
        f"uncompiled {id(call)}",
        f"module {names.get(call.module, '?')!r} no longer has the compiled call "
        "this manager's hooks for it run around (its _compiled_call_impl was set "
        "to None), so they no longer run for it. Make a new ActivationOffloader "
        "for the model as it is now",
    )


def _check_device(warn: WarnOnce, model: nn.Module | None, device: torch.device) -> None:
    """From ``__enter__``: warn once when the model's parameters left the device the manager
    was made on (a manager made before ``model.cuda()``, or on a meta model materialized
    later). The device is fixed when the manager is made and only tensors saved there move,
    so such steps moved nothing, and said nothing."""
    if "device" in warn or model is None:
        return
    now = compute_device(model)
    if now != device:
        warn(
            "device",
            f"the model's parameters are on {now}, but this ActivationOffloader was made "
            f"when they were on {device}: it moves only tensors saved on "
            f"{device}, so nothing saved on {now} leaves it. Move the model first, "
            "then make the manager on it",
        )


# NOTE [ One compiled leaf holding the step ]
#     A compiled module is a leaf (no hooks inside it). Under AOTAutograd (inductor,
#     aot_eager) its saved tensors are packed together when its compiled forward returns and
#     unpacked together when its backward starts, so the leaf's reloads all come back at once:
#     with one leaf holding most of the step (the whole model compiled), the peak barely
#     drops while every byte still crosses PCIe twice. At the end of each step's forward, if
#     one compiled leaf holds more than half of the bytes the step stored, the manager warns
#     once, naming it and pointing at per-block compilation.


def _check_compiled_share(warn: WarnOnce, ex: Any, compiled_leaves: set[str]) -> None:
    """Warn once when one compiled leaf holds most of the step's stored bytes (NOTE [ One
    compiled leaf holding the step ])."""
    if not compiled_leaves or "compiled_share" in warn or ex is None:
        return
    step = ex.step
    if step is None or step.stored_bytes == 0:
        return
    held: dict[str, int] = {}
    for fam in step.families:
        if fam.module in compiled_leaves:
            held[fam.module] = held.get(fam.module, 0) + fam.nbytes
    if not held:
        return
    name, nbytes = max(held.items(), key=lambda kv: kv[1])
    if 2 * nbytes <= step.stored_bytes:
        return
    which = "the whole model (its root module)" if name == "" else f"module {name!r}"
    warn(
        "compiled_share",
        f"{which} is compiled and holds {nbytes} of the {step.stored_bytes} bytes this step "
        f"stored ({100 * nbytes // step.stored_bytes}%). A compiled module is one leaf: "
        "its saved tensors all come back when its backward starts (under AOTAutograd, as "
        "with inductor, they are also packed together when its compiled forward returns), "
        "so offloading them lowers the peak little while PCIe is still paid. Compile each "
        "block instead (for b in model.blocks: b.compile()) and "
        "make the manager on the model: each block's tensors then leave as it ends and "
        "come back just before its backward",
    )


def _check_foreign_hooks(warn: WarnOnce, module: str, pack_fn: Any, hooks_popped: bool) -> None:
    """At a module call of the step (forward, not paused): warn once when a foreign
    saved-tensor hooks pair entered inside the step shadows ours (only the innermost pair
    fires, so nothing saved under it is offloaded). Checkpoint's own pair (pushed during a
    checkpointed forward, which composes) and packs of a backward are not foreign."""
    if "foreign_inside" in warn or _top_hooks is None or hooks_popped:
        return
    top = _top_hooks(False)
    if top is None or top[0] is pack_fn:
        return
    if is_checkpoint_pack(top[0]) or is_tap_pack(top[0]):
        return
    if _current_graph_task_id is not None and _current_graph_task_id() != -1:
        return
    warn(
        "foreign_inside",
        f"a saved_tensors_hooks pair ({getattr(top[0], '__qualname__', top[0])}) entered "
        f"inside this step is active at module {module or repr('')}: it takes every tensor "
        "saved under it (only the innermost pair fires), so none of those is offloaded. "
        "Enter it around the step instead, or leave it out",
    )


def _warn_traced(warn: WarnOnce) -> None:
    """From ``__enter__`` / ``__exit__`` (eager code): warn once that the model was compiled
    after the manager was made (docs/design.md: a compiled module is a leaf; no hooks inside)."""
    warn(
        "compiled",
        "the model (or a submodule of it, or a function that calls it) was compiled with "
        "torch.compile after this ActivationOffloader was made, so dynamo traces the "
        "manager's module hooks: it cannot compile them, the compiled graph breaks at "
        "every module (many small graphs, slower steps) and fullgraph=True fails inside a "
        "step. Compile first, then make the manager on the compiled model: a compiled "
        "module is a leaf (no hooks inside it) whose saved tensors still move.",
    )


def _check_given_plan(
    warn: WarnOnce,
    active: Any,
    given: bool,
    looked_up: int,
    matched: int,
    model: nn.Module | None,
) -> None:
    """At a step's end: warn once when the plan given with ``plan=`` knew none of the
    step's record keys inside the model (a plan made on a model with other module names, or
    another structure; packs outside the model, the loss's, match whatever it is): those
    records then go unplanned to the first tier with room, exact but not planned for the
    budget, and nothing else would say so."""
    if active is None or not given or matched or not looked_up:
        return
    mine = sorted({m for m, _, _ in active.action if m != OUTSIDE} | active.recompute_modules)
    seen = [n for n, _ in named_modules_stop_at_compiled(model) if n] if model else []
    warn(
        "given-plan",
        f"the given plan= matched 0 of this step's {looked_up} record keys inside "
        "the model (module path, call index, ordinal): those records went unplanned to the "
        "first tier with room (stats.unplanned_records), so the budget is not planned. "
        f"The plan places records of modules {mine[:6]}; this model's modules are "
        f"{sorted(seen)[:6]}. A plan is made for the model it was profiled on: profile this model "
        "(leave plan= out) or plan it offline",
    )


def _warn_no_module(warn: WarnOnce, outside_packs: int, model: nn.Module | None) -> None:
    """At a budgeted step's end: warn once when it saved tensors but entered no module of
    the model (NOTE [ Top-level calls ]): it had no signature, so nothing was profiled or
    planned, and its saved tensors were offloaded without a plan."""
    if not outside_packs:
        return  # nothing saved (no forward, or one without grad)
    warn(
        "no-module",
        f"gpu_budget is not applied: this step saved {outside_packs} tensors but "
        f"called no module of the model ({type(model).__name__}) this manager was made on, "
        "so it has no signature to profile and plan (a step's signature comes from the "
        "first module of the model it enters); its saved tensors were offloaded without a "
        "plan. Make the manager on the module the step runs, or run the forward through it",
    )


def _warn_several_backwards(warn: WarnOnce) -> None:
    """A forward of the model began inside a ``with mgr:`` block after a backward ended in it
    (``with mgr: trainer.train()``, gradient accumulation inside one block): the block is one
    step however many it holds, so nothing is planned per training step. Said once."""
    warn(
        "several-backwards",
        "a forward began after a backward inside one `with mgr:` block: the whole block is "
        "one step of the manager (its statistics, its profile and plan), however many "
        "training steps it holds. Enter the manager around each forward (and its backward), "
        "or call mgr.install() once and leave `with mgr:` out: each forward with grad and the "
        "backward that consumes it is then one step",
    )


# -- texts said by budget mode and the pack hook -------------------------------------------


def _overlap_text(sig: str, steps: int) -> str:
    """Said when a signature was not profiled ``steps`` times in a row (overlapping steps)."""
    return (
        f"signature {sig} was not profiled in {steps} steps in a row: an older "
        "step's saved tensors were still alive at each start (a graph kept without its "
        "backward, or retain_graph=True); it runs in min-memory mode. Free old graphs "
        "before the next step, or plan offline and pass plan="
    )


def _unfinished_text(sig: str, times: int) -> str:
    """Said when ``times`` profiles of a signature were cut short by overlapping steps."""
    return (
        f"a step of signature {sig} began before the backward of the step being profiled "
        "ended (forwards run before their backwards, a forward never run backward, or a "
        "backward that raised), "
        f"{times} times; gpu_budget profiles one step with its backward, so "
        "this signature runs in min-memory mode. Run each backward before the next forward, "
        "or plan offline (offload.profile, offload.plan) and pass plan="
    )


def _unplanned_text(steps: int, sigs: list[str]) -> str:
    """Said when ``steps`` budgeted steps in a row (of signatures ``sigs``) ran unplanned."""
    msg = (
        f"gpu_budget has not been planned for in {steps} steps in a row: each "
        "ran in min-memory mode (everything eligible offloaded: slower than a plan) because "
        "the profiles of their signatures were cut short by steps that began before the "
        "profiled step's backward ended. Forwards run before their backwards (gradient "
        "accumulation with every microbatch's forward first) never let a profile finish: "
        "give each microbatch's forward its own `with mgr:` block and run its backward "
        "before the next microbatch's forward (the gradients accumulate in .grad just the "
        "same; README: gradient accumulation); for a pipeline schedule use "
        "mgr.attach(stage), which profiles a whole round"
    )
    if len(sigs) > 1:
        msg += (
            f". Those steps also came with {len(sigs)} input signatures ({sigs[0]!r}, "
            f"{sigs[1]!r}, ...): a plain argument of the root that changes from step to "
            "step (an int step counter) makes each step a signature of its own, profiled "
            "afresh; pass it as a float (counted by its type only) or a tensor (by its dtype "
            "and shape), or keep it out of the root module's call"
        )
    return msg


def _signatures_text(most: int, e: Exception) -> str:
    """Said when the merged plan past ``most`` signatures cannot meet the budget."""
    return (
        f"more than {most} input signatures, and the plan of their per-key byte "
        f"maxima cannot meet gpu_budget ({e}): new signatures run in min-memory mode"
    )


def _infeasible_text(sig: str, e: Exception) -> str:
    """Said when a signature met after the first cannot meet the budget."""
    return (
        f"signature {sig} cannot meet gpu_budget ({e}); its steps run in min-memory "
        "mode (on_infeasible='min_memory')"
    )


def _recompute_differs_text(name: str) -> str:
    """Said when a recomputed module gave other values than its forward saved."""
    return (
        f"module {name!r}, which the plan recomputed (non-reentrant checkpoint), "
        "recomputed other values than its forward saved (a torch.Generator of its own, "
        "or state that changed since its forward): that step used the values its "
        "forward saved, so its gradients are exact, and no plan of this manager "
        "recomputes it again. Signatures planned from their profile are planned again "
        "without it; others run it as it is"
    )


def _left_plan_text(base: str, at: int, got: Any, expected: Any) -> str:
    """Said when a planned step left its plan's sequence of keys (NOTE [ Structure ])."""
    return (
        f"a planned step of signature {base} left its plan at pack {at} (saved key {got}, "
        f"the plan's next: {expected}): the forward's structure changed while its "
        "signature did not. Likely causes: a float argument that switches a branch (a float "
        "counts by its type only), a module attribute or global flag set between steps, or "
        "data-dependent control flow. The rest of that step went unplanned to the first "
        "tier with room (stats.unplanned_records), and the signature's next step profiles "
        "its structure again. Pass such a switch to the model as a bool, int or str "
        "argument (part of the signature), or keep= the module whose saves vary"
    )


def _structures_text(base: str, most: int) -> str:
    """Said when a signature showed more than ``most`` structures."""
    return (
        f"signature {base} showed more than {most} forward structures; it is "
        "no longer profiled again, and steps off their plan run their rest unplanned. "
        "Pass what switches the structure to the model as a bool, int or str argument"
    )


def _futile_text(base: str, futile: int) -> str:
    """Said when re-profiles in a row found the structure that had just diverged."""
    return (
        f"signature {base} changes its forward's structure from step to step: "
        f"{futile} re-profiles in a row found the structure that had just diverged. It "
        "is no longer profiled again; steps off their plan run their rest unplanned "
        "(slower, and not planned for the budget). Pass what switches the structure to "
        "the model as a bool, int or str argument"
    )


def _subclass_text(name: str) -> str:
    """Said for saved tensors of a wrapper subclass without storage of their own."""
    return f"saved tensors of type {name} have no storage to copy; they stay where they are"


_GRAPHS_TEXT = "CUDA graph capture: saved tensors are left in place"
