"""The manager's pack hook: what each saved tensor of a step becomes.

Kept where it is (a parameter, small, on another device, inside a kept module, placed KEEP by
the plan), a recipe (an autocast weight cast, an activation output rebuilt from its input), or
stored by the executor (offloaded; a tensor without gradient once its op has returned, NOTE
[ Fill after pack ]). Under a plan each pack's record key finds its decision. The per-tensor
work is the hot path: nothing here is per step.
"""

from __future__ import annotations

import time
import weakref
from _thread import get_ident
from typing import TYPE_CHECKING, Any

import torch

from offload._errors import modified_after_save
from offload._executor import Executor
from offload._family import _Member, span_of
from offload._planned import KEEP, REBUILD
from offload._recipe import ActivationRecipe, SharedRebuild, weight_cast
from offload._warnings import (
    _GRAPHS_TEXT,
    WarnOnce,
    _subclass_text,
)
from offload.lifecycle._calls import OUTSIDE
from offload.lifecycle._tensors import (
    RECIPE_NODES,
    NormOutputs,
    ParameterStorages,
    activation_output,
    dtensor_spec,
    local_tensor,
    wraps_parameter,
)

if TYPE_CHECKING:
    from offload._planned import Profiler
    from offload._step import Step

_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_UNPLANNED = (None, 0)  # a key the plan does not name: no decision (and no limit)
_NO_KEY: Any = None  # a pack's key where none is looked up (Packer.keyed)
# The number the next autograd node of this thread will get (see NOTE [ Fill after pack ]).
_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


class Packer:
    """Packs a step's saved tensors; holds what does not change from step to step (the
    device, the size threshold, the parameters' storages, the norm outputs seen)."""

    def __init__(
        self,
        device: torch.device,
        min_offload_bytes: int,
        params: ParameterStorages,
        norms: NormOutputs,
        warn: WarnOnce,
    ) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"  # (``t.is_cpu`` makes no device object per pack)
        self.min_offload_bytes = min_offload_bytes
        self.params = params
        # Norm outputs and what they were made with (eps is not on their autograd node).
        self.norms = norms
        self.warn = warn
        self.meter: Any = None  # offload._live.SavedBytes while one counts (tests, benchmarks)
        # Whether packs need their record keys: a plan's or a profile's (a budget, or a plan
        # given). A min-memory manager's packs look nothing up by key, and skip counting it.
        self.keyed = True
        self.saw_dtensor = False  # a DTensor was saved: tensor parallel, no block recompute

    def keep(self, t: torch.Tensor, step: Step, prof: Profiler | None) -> torch.Tensor:
        """A saved tensor left where it is (counted)."""
        step.stats.records_kept += 1
        d = _kept(t)
        meter = self.meter
        if meter is not None:
            local = local_tensor(t)
            if local.device == self.device and _has_storage(local):
                st = local.untyped_storage()
                if not self.params.holds(local, st) and (local is t or not wraps_parameter(t)):
                    meter.watch(st)
        if prof is not None:
            seq = prof.recorder.record_pack(t)
            if seq >= 0:
                step.kept_seq[id(d)] = seq
        active = step.active
        if active is not None and active.rebuilds:
            step.kept_refs[id(d)] = weakref.ref(d)
        return d

    def pack(self, t: torch.Tensor, step: Step, ex: Executor, prof: Profiler | None) -> Any:
        """The pack hook of a step (not paused) that has an executor; ``prof``: the profiler
        while this step is recorded (a profiling or timing step), else None."""
        stats = step.stats
        frames = step.calls.frames
        top = frames[-1] if frames else None  # step.top, inline (the innermost module call)
        key: tuple[str, int, int] = step.calls.next_key() if self.keyed else _NO_KEY
        stats.records += 1
        if _current_graph_task_id is not None and _current_graph_task_id() != -1:
            return self.keep(t, step, prof)  # packed by a backward (recomputation, double backward)
        if step.step_keys is not None:
            step.step_keys.append(key)  # a profiling step's structure (NOTE [ Structure ])
        elif step.cursor >= 0:
            step.follow(key)
        capture = ex.capture
        if capture.possible and capture.capturing():  # NOTE [ No query while capturing ]
            self.warn("graphs", _GRAPHS_TEXT)
            return self.keep(t, step, prof)
        nr = _sequence_nr() if _sequence_nr is not None else -1
        if step.deferred and nr != step.deferred_at:
            self.flush_deferred(step, ex, prof)  # an op that made a node since: theirs has returned
        module = top.module if top is not None else OUTSIDE
        again = step.again
        if (
            again is not None
            and again[0] == nr
            and again[1] == id(t)
            and prof is None
            and t._version == again[2]
            and again[6] == get_ident()
        ):
            # The op packing ``t`` packed it already (``x * x``): NOTE [ Packed again ].
            dtensor = None
            local = t
            n, item = again[3], again[4]
            nbytes = n * item
            # (Its storage is asked for only where a kept record registers it; Executor.offload
            # asks for itself when given None.)
            st: torch.UntypedStorage | None = None
            maybe_recipe = False
        else:
            again = None
            dtensor = None
            local = t
            if type(t) is not torch.Tensor:  # a plain tensor, the common case, skips this
                if hasattr(t, "_local_tensor"):  # a DTensor: its shard
                    dtensor = (t.device_mesh, t.placements, t.shape, t.stride())  # type: ignore[attr-defined]
                    self.saw_dtensor = True
                local = local_tensor(t)
                if type(local) is not torch.Tensor and not _has_storage(local):
                    # A wrapper subclass without bytes of its own: nothing to copy. (One with
                    # bytes comes back as a plain tensor: so it does through any saved-tensor
                    # hooks, torch's save_on_cpu or an identity pair included.)
                    self.warn(
                        f"subclass:{type(local).__name__}",
                        _subclass_text(type(local).__name__),
                    )
                    return self.keep(t, step, prof)
            n = local.numel()
            item = local.element_size()
            nbytes = n * item
            if (
                (top is not None and top.kept)
                or (not local.is_cpu if self.on_cpu else local.device != self.device)
                or nbytes < self.min_offload_bytes
                or n == 0
                or local.layout is not torch.strided  # sparse: no one storage to copy
                or local.is_nested
                # At an address no multiple of its item size (``torch.frombuffer`` at an odd
                # offset): no view of a reload buffer can start there, and a copy placed
                # elsewhere would run other kernels' code paths (NOTE [ Alias handling ]).
                or local.data_ptr() % item
                or self.params.holds(local, (st := local.untyped_storage()))
                or (dtensor is not None and wraps_parameter(t))
            ):
                return self.keep(t, step, prof)
            if dtensor is None:
                # Recipes only come from a few nodes' outputs: the node is asked once here, not
                # by both recognisers (a DTensor's node is theirs to find).
                base = t._base
                fn = (t if base is None else base).grad_fn
                maybe_recipe = fn is not None and type(fn).__name__ in RECIPE_NODES
            else:
                maybe_recipe = True
            recipe = weight_cast(t, self.params) if maybe_recipe else None
            if recipe is not None:
                # NOTE [ Weight casts ] in _recipe.py: cast again at unpack, never stored or
                # copied.
                stats.records_rebuilt += 1
                stats.bytes_rebuilt += recipe.nbytes
                if prof is not None:
                    recipe.seq = prof.recorder.record_pack(t, parameter=True)
                return recipe
            if step.active is None and maybe_recipe:
                # Min-memory mode, a budget's profiling step included (NOTE [ Activation
                # recipes ]).
                rebuilt = self.activation_recipe(t, ex, step, prof)
                if rebuilt is not None:
                    return rebuilt
        active = step.active
        tier = None
        if active is not None:
            # The plan's decision and its size limit in one lookup; the recomputed calls are
            # asked only when the plan has some (a tuple per ask).
            tier, limit = active.decision.get(key, _UNPLANNED)
            recomputed = bool(active.recompute_calls) and (key[0], key[1]) in active.recompute_calls
            if key[0] != OUTSIDE:  # the loss's packs match whatever the model is
                step.keys_looked_up += 1
                if tier is not None or recomputed:
                    step.keys_matched += 1
            if step.diverged is not None:
                # Off the plan's sequence: the rest of the step is not the plan's to place
                # (NOTE [ Structure ]), save a storage it kept, which stays on the device anyway.
                tier = KEEP if step.kept_by_plan(local) else None
            elif tier is not None and (nbytes if local.is_contiguous() else _extent(local)) > limit:
                tier = None  # larger than planned (docs/design.md: Keys and signatures)
            if tier == REBUILD:
                # See NOTE [ Activation recipes ] in _recipe.py; if its conditions fail, the
                # record is not the plan's to place: to the first tier with room. (Packed
                # again, ``t`` is no output a recipe rebuilds: its first pack asked.)
                rebuilt = (
                    None if again is not None else self.activation_recipe(t, ex, step, prof, key)
                )
                if rebuilt is not None:
                    return rebuilt
                tier = None
            if tier is None and step.diverged is None and recomputed:
                # Non-reentrant checkpoint saves the recomputed call's inputs itself, as packs
                # of that call: kept, as the planner assumed (its inputs stay on the device).
                tier = KEEP
            if tier is None:
                stats.unplanned_records += 1  # to the first tier with room
            elif tier == KEEP:
                if step.cursor >= 0:
                    if st is None:
                        st = local.untyped_storage()
                    step.plan_kept[st._cdata] = weakref.ref(st)
                if prof is None and not maybe_recipe and dtensor is None:
                    step.again = (nr, id(t), t._version, n, item, None, get_ident())
                return self.keep(t, step, prof)
        # Reloaded when the backward of the module that saved it starts (and the look-ahead
        # window). Not a record the plan placed: that one reloads at its planned trigger, or at
        # its unpack, since a module's backward starts before its children's, and a parent
        # running ops of its own (the root, a block's residual) would bring it back before the
        # plan's kept tensors are freed. An unplanned record has no trigger.
        own = top.own if top is not None and (active is None or tier is None) else None
        if not t.requires_grad:
            # NOTE [ Fill after pack ]: no gradient, so possibly an op's buffer that the op
            # itself fills after saving it: copied once the op has returned.
            d = _Deferred(t, local, module, dtensor, tier, key, own)
            d.stream = ex.streams.current()  # the op's stream: its fill is queued there
            step.deferred.append(weakref.ref(d))
            if _sequence_nr is not None:
                step.deferred_at = nr
            if prof is not None:
                d.seq = prof.recorder.record_pack(t)
            return d
        if prof is None:
            # self.offload without its clock and record number (the common case: nothing is
            # recorded or timed).
            first = again[5] if again is not None else None
            member = None if first is None else ex.again(first, key)
            if member is None:
                member = ex.offload(local, module, dtensor, tier, None, key, st, n, item)
                if not maybe_recipe and dtensor is None:
                    # (The family's version is t's at this pack: one read of t less.)
                    step.again = (nr, id(t), member.family.version, n, item, member, get_ident())
            _joined(ex, active, key, own, member.family)
            return member
        member = self.offload(
            ex, step, prof, local, module, dtensor, tier, key, own, -1, None, (st, n, item)
        )
        if prof is not None:
            link = self.rebuild_link(t, ex) if maybe_recipe else -1
            member.seq = prof.recorder.record_pack(t, rebuild_from=link)
        return member

    def offload(
        self,
        ex: Executor,
        step: Step,
        prof: Profiler | None,
        local: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None,
        key: tuple[str, int, int],
        own: list[Any] | None,
        seq: int,
        stream: Any = None,
        facts: tuple[Any, int, int] | None = None,
    ) -> _Member:
        """Store ``local`` (a pack's tensor, or its DTensor's shard) and return its handle;
        ``stream``: the stream its op ran on, when not the current one (a deferred pack);
        ``facts``: its ``(untyped_storage(), numel(), element_size())`` read by the pack."""
        held = prof.compute_clock if prof is not None else None
        started = time.perf_counter() if held is not None else 0.0
        if facts is None:
            member = ex.offload(local, module, dtensor, tier, stream, key)
        else:
            member = ex.offload(local, module, dtensor, tier, stream, key, *facts)
        if held is not None:
            held.held_s += time.perf_counter() - started
        member.seq = seq
        _joined(ex, step.active, key, own, member.family)
        return member

    def flush_deferred(self, step: Step, ex: Executor | None, prof: Profiler | None) -> None:
        """Store the deferred packs (NOTE [ Fill after pack ]): their ops have returned."""
        if ex is not None and ex.capture.capturing():
            return  # no copy inside a CUDA graph: after the capture, or kept at unpack
        pending, step.deferred = step.deferred, []
        for ref in pending:
            d = ref()
            if d is None or d.tensor is None or ex is None or ex.step is None:
                continue  # its graph is gone already, or the step failed
            t, local = d.tensor, d.local
            assert local is not None
            if t._version != d.version:
                # Changed in place before its copy: autograd's check, as for any saved tensor.
                d.error = modified_after_save(f"a tensor saved by {d.module}", t, d.version)
                continue
            d.member = self.offload(
                ex, step, prof, local, d.module, d.dtensor, d.tier, d.key, d.own, d.seq, d.stream
            )
            d.tensor = d.local = None
            d.own = d.stream = None

    def activation_recipe(
        self,
        t: torch.Tensor,
        ex: Executor,
        step: Step,
        prof: Profiler | None,
        key: tuple[str, int, int] | None = None,
    ) -> ActivationRecipe | None:
        """An :class:`ActivationRecipe` for ``t`` if it is a GELU / SiLU / LayerNorm / RMSNorm
        output (or autocast's cast of a norm output) whose input this step offloaded, or (``key``:
        the plan rebuilds it) kept, else None (NOTE [ Activation recipes ] in _recipe.py)."""
        found = activation_output(t, self.norms)
        if found is None:
            return None
        parent, out = found.packed, found.out
        if type(parent) is _Deferred:  # an input without gradient, stored by now (this pack's
            parent = parent.member  # op came after its own)
        if isinstance(parent, _Member):
            if (
                parent.executor is not ex
                or not _same_layout(parent, out)
                or _member_spec(parent) != found.spec
            ):
                return None
            if prof is not None and key is None and not _whole_input(parent, out):
                return None  # stored: a trace links only an input stored whole (_rebuild_link)
            held: Any = ex.share(parent)
            if held is None:
                return None
            link = parent.seq
        elif key is not None and self.kept_input(step, parent, out, found.spec):
            held = parent
            link = step.kept_seq.get(id(parent), -1)
        else:
            return None
        ex_step = ex.step if key is not None else None  # whose trigger table the key is in
        shared = self.shared_rebuild(step, found.saved)
        recipe = ActivationRecipe(found, held, key=key, step=ex_step, shared=shared)
        step.stats.records_rebuilt += 1
        if shared.members == 1:  # the output's bytes, once however many packs save it
            step.stats.bytes_rebuilt += recipe.nbytes
        if prof is not None:
            # A planned step timed for refinement (NOTE [ Refinement ] in _planned.py).
            recipe.seq = prof.recorder.record_pack(t, rebuild_from=link)
        top = step.top
        if key is None and top is not None:
            # Min-memory mode: the module saving the output now needs the input first in
            # backward: its backward trigger starts the input's reload (else the rebuild would
            # stall on it). Under a plan the input's planned trigger does.
            own = top.own
            if held.family not in own:
                own.append(held.family)
        return recipe

    def shared_rebuild(self, step: Step, saved: torch.Tensor) -> SharedRebuild:
        """The rebuild of ``saved`` (an output another pack of this step already stored a
        recipe for, unchanged since), joined; else a new one."""
        got = step.rebuilds.get(id(saved))
        if got is not None and got[0]() is saved and got[1] == saved._version:
            got[2].members += 1
            return got[2]
        shared = SharedRebuild()
        step.rebuilds[id(saved)] = (weakref.ref(saved), saved._version, shared)
        return shared

    def kept_input(self, step: Step, parent: Any, out: torch.Tensor, spec: Any) -> bool:
        """Whether ``parent`` (what an activation's pack of its input returned) is a tensor this
        manager kept in this step, not a parameter, laid out as the activation's output ``out``
        (a DTensor's shard). ``spec``: ``(mesh, placements)`` where the activation ran on
        DTensors, whose input must then be a DTensor alike (NOTE [ DTensor activation
        recipes ]), else None (a plain input)."""
        if spec is None:
            if type(parent) is not torch.Tensor:
                return False
            local = parent
        elif dtensor_spec(parent) != spec:
            return False
        else:
            local = parent._local_tensor
            if type(local) is not torch.Tensor:
                return False
        ref = step.kept_refs.get(id(parent))
        if ref is None or ref() is not parent:
            return False  # packed by other hooks (only the innermost pair fires)
        return (
            local.device == out.device
            and local.dtype == out.dtype
            and local.shape == out.shape
            and local.stride() == out.stride()
            and not self.params.holds(local, local.untyped_storage())
        )

    def rebuild_link(self, t: torch.Tensor, ex: Executor) -> int:
        """The profiler's ``seq`` of the record ``t`` can be rebuilt from
        (``TensorRecord.rebuild_from``), or -1: ``t`` is an output :func:`activation_output`
        recognises whose input this recorded step offloaded whole, as ``lifecycle.Recorder``
        links them (NOTE [ Activation recipes ] in _recipe.py)."""
        found = activation_output(t, self.norms)
        if found is None:
            return -1
        parent, out = found.packed, found.out
        if type(parent) is _Deferred:
            parent = parent.member
        if (
            not isinstance(parent, _Member)
            or parent.executor is not ex
            or not _same_layout(parent, out)
            or _member_spec(parent) != found.spec
            or not _whole_input(parent, out)
        ):
            return -1
        return parent.seq


def _joined(ex: Executor, active: Any, key: Any, own: list[Any] | None, fam: Any) -> None:
    """A pack's ``fam`` (new, or joined by this member) goes where its reload starts: the
    trigger its plan names (``active``, None in min-memory mode), and its module's backward
    (``own``)."""
    if active is not None and fam.members == 1 and ex.step is not None:
        _planned_trigger(ex.step.triggers, active.trigger.get(key), fam)
    if own is not None and (not own or own[-1] is not fam):
        own.append(fam)


def _planned_trigger(triggers: dict[Any, Any], trigger: Any, fam: Any) -> None:
    """``fam``'s reload starts at ``trigger`` (its plan's, or None: none). An unpack's trigger
    names one family, itself; a backward trigger a list, which the module's post-hook shares
    (NOTE [ Objects per saved tensor ] in _executor.py: a list per family was one more object
    held per saved tensor)."""
    if trigger is None:
        return
    got = triggers.get(trigger)
    if got is None:
        triggers[trigger] = fam if trigger[0] == "unpack" else [fam]
    elif type(got) is list:
        got.append(fam)
    else:
        triggers[trigger] = [got, fam]


def _same_layout(parent: _Member, out: torch.Tensor) -> bool:
    """An activation's offloaded input ``parent`` has its output's shape and dtype, dense."""
    return (
        parent.size == tuple(out.shape)
        and parent.dtype == out.dtype
        and parent.stride == _contiguous_strides(parent.size)
    )


def _whole_input(parent: _Member, out: torch.Tensor) -> bool:
    """An activation's offloaded input ``parent`` was recorded by this step's profiler and is
    its family's whole storage, as ``lifecycle.Recorder`` links an output to its input."""
    return (
        parent.seq >= 0
        and parent.offset_bytes == 0
        and parent.family.span_start == 0
        and parent.family.nbytes == out.numel() * out.element_size()
    )


def _member_spec(parent: _Member) -> tuple[Any, tuple[Any, ...]] | None:
    """``(mesh, placements)`` of the DTensor ``parent`` was offloaded from, else None (as
    ``lifecycle._tensors.dtensor_spec``)."""
    return None if parent.dtensor is None else (parent.dtensor[0], tuple(parent.dtensor[1]))


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(size):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _extent(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t``'s elements span (an expanded view spans fewer bytes than
    its elements)."""
    start, end = span_of(t)
    return end - start


# NOTE [ Kept tensors keep autograd's check ]: under saved-tensor hooks autograd no longer
# compares a saved tensor's version at unpack; for one the manager leaves in place (parameters,
# small or kept tensors, KEEP entries of a plan) it would then read whatever an in-place change
# (an optimizer step before backward) left there: a wrong gradient where PyTorch raises. The
# detached tensor handed to autograd carries the version it was saved at, checked at unpack.


def _kept(t: torch.Tensor) -> torch.Tensor:
    d = t.detach()
    d._offload_saved_version = t._version  # type: ignore[attr-defined]
    return d


def _check_kept(d: torch.Tensor) -> None:
    saved = getattr(d, "_offload_saved_version", None)
    if saved is not None and d._version != saved:
        raise modified_after_save("a saved tensor", d, saved)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# NOTE [ Packed again ]
#     One op may save one tensor twice: ``x * x`` saves both of its inputs, and so does a
#     custom Function's ``save_for_backward(a, a)``. The second pack would find what the first
#     one found: the same eligibility and the same family. So a pack remembers what it decided
#     (``Step.again``: the thread's autograd sequence number, the tensor's id and version, its
#     numel and element size, and its member, or None where the plan kept it), and a
#     pack of the same tensor at the same version under the same sequence number starts from
#     there. The sequence number moves whenever an autograd node is made, and every op that
#     saves makes its node first, so an equal number means the same op's saves, with no user
#     code between them that could have changed what the tensor is (``t.data = ...`` keeps its
#     id and its version; test_offload_packed_again.py reassigns it between two ops): the id
#     then names the same live tensor, which the op holds. (The sequence number is the
#     thread's: a pack on another thread may meet an equal one by chance, so the thread is
#     compared too; there the id could name another tensor at the address of a dead one.)
#     What depends on the record key runs
#     again: under a plan the second record gets its own decision and, offloaded, a member of
#     its own (its key may name an unpack trigger). In a min-memory step no key tells the two
#     records apart, and the second pack returns the first one's member: one handle that two
#     saved variables hold (``_Member.holders``), counted twice in ``Family.members``, released
#     for both when autograd has dropped both, and whose second unpack gets its first view
#     again (``rebuild``, ``Family.view``). Stats count both records, the second one
#     deduplicated, as before. A recorded step (a profile, a timing step), a DTensor and a
#     tensor a recipe might rebuild always take the full path. The entry holds its member
#     until the next pack replaces it, a backward begins (``_on_backward_begin``) or the
#     step's block ends: held longer, the member of a graph's last pack would outlive
#     autograd's use of it, and its family's bytes with it. (A weak reference instead cost
#     an object per pack.)

# NOTE [ Fill after pack ]
#     An op may save a buffer it fills itself afterwards, in the same call: F.rrelu in training
#     saves its noise tensor (from empty_like) and then writes the noise into it, and the write
#     leaves the version counter as it was (torch 2.13). A copy started at pack holds the bytes
#     from before the fill (on CUDA, a D2H copy ordered after an event recorded at pack can run
#     before the fill kernel), and no version check can tell. So a pack of a tensor that needs
#     no gradient (such buffers, masks, indices, a batch's inputs) returns a _Deferred and is
#     stored once its op has returned, which is at the first of:
#       * the next pack after a new autograd node: every op that saves creates its node before
#         saving, and the thread's sequence number (torch._C._autograd._get_sequence_nr) moves
#         only then; rrelu's own later pack (its input, saved after the noise) sees none;
#       * a module boundary (forward pre- or post-hook), or the step's exit;
#     and the first unpack of one still waiting keeps them all: backward has reached the ops
#     that packed them (copied then, they would come back at once). An earlier step's backward
#     run inside this step unpacks only stored ones (its exit stored them) and keeps none. The
#     wait is one op long in a model and costs no device memory that autograd did not hold
#     anyway. An in-place change before the copy (a version bump) raises at unpack, as
#     autograd would; a copy that fails (a full tier) raises where it runs, the step's exit
#     included, which then fails the step as an exception in its block does. nn.RReLU modules
#     stay kept as well (lifecycle/_recorder.py). The copy is ordered after the stream current
#     at the pack (the op's: its fill is queued there), remembered with it, not after the
#     stream current at the flush: a pack under torch.cuda.stream(s2) flushed by the next op
#     on the default stream would otherwise be copied before s2 wrote it.


class _Deferred:
    """What a pack returns for a tensor whose copy waits until its op has returned (NOTE [ Fill
    after pack ]): the tensor until then, the stored member after."""

    __slots__ = (
        "__weakref__",
        "dtensor",
        "error",
        "key",
        "local",
        "member",
        "module",
        "own",
        "seq",
        "stream",
        "tensor",
        "tier",
        "version",
    )

    def __init__(
        self,
        t: torch.Tensor,
        local: torch.Tensor,
        module: str,
        dtensor: Any,
        tier: str | None,
        key: tuple[str, int, int],
        own: list[Any] | None,
    ) -> None:
        self.tensor: torch.Tensor | None = t.detach()
        self.local: torch.Tensor | None = local
        self.version = t._version
        self.module, self.dtensor, self.tier, self.key, self.own = module, dtensor, tier, key, own
        self.member: _Member | None = None
        self.error: RuntimeError | None = None
        self.seq = -1
        self.stream: Any = None  # the stream current at the pack (the op's), until stored


# The module hooks hold their manager weakly: the model outlives a manager dropped without
# close(), whose finalizer must still run (the hooks are removed then).
