"""Verified recomputation: the first planned step that recomputes a module checks that
checkpoint's recomputation saves what the module's forward saved.

NOTE [ Verified recomputation ]
    Non-reentrant checkpoint runs a recomputed module's forward again in backward with the
    default generators' states put back, and nothing else. A module that draws from a
    ``torch.Generator`` of its own (noise, a dropout mask from ``torch.bernoulli(p,
    generator=g)``), or reads state that changed since its forward, recomputes other values, and
    the gradients would be silently wrong although the user asked only for less memory. So the
    first time a signature's plan recomputes a module, each of its calls runs under checkpoint
    with a :class:`VerifyTap` as checkpoint's forward context: a saved-tensor hooks pair under
    checkpoint's own that hands every pack on to checkpoint and keeps the original tensor (a
    detached reference). At each unpack the tensor checkpoint recomputed is compared with the
    original bit for bit (bytes viewed as integers: NaNs and signed zeros count), and the
    original is returned, so that step's gradients are exact whatever the comparison finds
    (a recomputation checkpoint refuses, tensors of other shapes or number, differs too).
    The ``torch.Generator`` attributes of the module and its submodules (``self.gen``) are
    replayed as checkpoint replays the default ones (their states at the forward are set again
    for the recomputation, and put back after it), so such a module recomputes its own draws
    and needs no exclusion; a generator held elsewhere (a list, a closure, a global) is not seen,
    and the recomputation that finds the difference advances it once more than a run without
    offload would. The rule, and why:
    - A module found to differ is never recomputed again by this manager: it is named in a
      warning (once), every later plan leaves it out (and any block holding it or inside it:
      the trace's ``recompute_mismatch_modules``), and the plans that recompute it are made
      again before the next step. Until then its calls run as they are (the manager's
      ``_recompute_this``).
    - A module whose compared unpacks all matched is verified for that signature: later steps
      recompute it with no tap (no copy kept, no comparison). One with no unpack yet (its
      backward did not run) is verified at its next call.
    - Verification costs memory on that first step only: it holds what the recomputation was to
      free until backward unpacks it (the budget holds from the next step). The originals are
      compared themselves, not a digest of them: the step holds them anyway to stay exact where
      the check fails, and with them the comparison is exact too (a digest could collide).
    Modules that cannot be recomputed at all are left out up front by the recorder (NOTE
    [ Model checkpoints ] in lifecycle/_recorder.py: the model's own checkpoints; modules
    writing their input in place; BatchNorm-like running statistics).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from offload.lifecycle._recorder_calls import PlannedCheckpoint

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values bit for bit (a NaN equals the same NaN;
    ``-0.0`` differs from ``0.0``). Tensors it cannot read so (sparse, a subclass) differ."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return False
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    as_int = _AS_INT.get(a.element_size())
    if as_int is None:
        return False
    return bool(torch.equal(a.view(as_int), b.view(as_int)))


class _Generators:
    """The ``torch.Generator`` attributes of a module and its submodules, with their states at
    the start of a checkpointed forward: the recomputation replays them (NOTE [ Verified
    recomputation ])."""

    def __init__(self, module: Any) -> None:
        mods = module.modules() if isinstance(module, torch.nn.Module) else ()
        self.generators = [
            v for m in mods for v in vars(m).values() if isinstance(v, torch.Generator)
        ]
        self.states: list[torch.Tensor] = []

    def stash(self) -> None:
        self.states = [g.get_state() for g in self.generators]


class _Forward:
    """Checkpoint's forward context: stashes the generators' states, then enters ``inner``."""

    def __init__(self, generators: _Generators, inner: Any) -> None:
        self.generators, self.inner = generators, inner

    def __enter__(self) -> None:
        self.generators.stash()
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)


class _Replay:
    """Checkpoint's recompute context: the generators' states at the forward, for the
    recomputation; their states before it, after."""

    def __init__(self, generators: _Generators) -> None:
        self.generators = generators
        self.before: list[torch.Tensor] = []

    def __enter__(self) -> None:
        gens = self.generators
        self.before = [g.get_state() for g in gens.generators]
        for g, state in zip(gens.generators, gens.states, strict=False):
            g.set_state(state)

    def __exit__(self, *exc: Any) -> None:
        for g, state in zip(self.generators.generators, self.before, strict=True):
            g.set_state(state)


class _Saved:
    """What a tapped pack returns: checkpoint's own object and the original tensor."""

    __slots__ = ("held", "original")

    def __init__(self, held: Any, original: torch.Tensor) -> None:
        self.held, self.original = held, original


class VerifyTap(torch.autograd.graph.saved_tensors_hooks):
    """Checkpoint's forward context for a call being verified (NOTE [ Verified
    recomputation ]): entered right after checkpoint pushed its pack hooks, it pushes a pair
    that hands each pack on to them and keeps the original."""

    def __init__(self, verifier: RecomputeVerifier, signature: str, module: str) -> None:
        self.verifier, self.signature, self.module = verifier, signature, module
        self.failed = False  # checkpoint refused the recomputation (see _unpack)
        self._outer: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> None:
        self._outer = _top_hooks(False) if _top_hooks is not None else None
        super().__enter__()

    def _pack(self, t: torch.Tensor) -> Any:
        if self._outer is None:
            return t  # no checkpoint pair under it: saved as it is, nothing recomputed
        return _Saved(self._outer[0](t), t.detach())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        assert self._outer is not None
        if self.failed:
            return saved.original
        try:
            recomputed = self._outer[1](saved.held)
        except torch.utils.checkpoint.CheckpointError:
            # Recomputed tensors of other shapes, dtypes or number (data-dependent control flow
            # on state that changed): a difference too, and the originals are all here.
            self.failed = True
            self.verifier.report(self, False)
            return saved.original
        self.verifier.report(self, same_bits(recomputed, saved.original))
        return saved.original


def is_tap_pack(fn: Any) -> bool:
    """Whether ``fn`` is a :class:`VerifyTap`'s pack hook (checkpoint's, not foreign)."""
    return isinstance(getattr(fn, "__self__", None), VerifyTap)


class RecomputeVerifier:
    """One manager's record of which recomputed modules were verified, per signature, and which
    differed (NOTE [ Verified recomputation ]). ``report`` may run on autograd's device thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verified: set[tuple[str, str]] = set()
        self._matched: set[tuple[str, str]] = set()  # compared equal since the last settle
        self.differing: dict[str, None] = {}  # modules found to differ, in the order found
        self._found: list[str] = []  # found since the last settle

    def context_fn(
        self, signature: str, module: str, instance: Any
    ) -> Callable[[], tuple[Any, Any]]:
        """Checkpoint's ``context_fn`` for a call of ``module`` (the module ``instance``) that a
        plan recomputes."""
        inner: Any = (
            PlannedCheckpoint()
            if (signature, module) in self._verified
            else VerifyTap(self, signature, module)
        )
        generators = _Generators(instance)
        if not generators.generators:
            return lambda: (inner, contextlib.nullcontext())
        return lambda: (_Forward(generators, inner), _Replay(generators))

    def report(self, tap: VerifyTap, same: bool) -> None:
        """An unpack of ``tap``'s call compared its recomputed tensor with the original."""
        with self._lock:
            if same:
                self._matched.add((tap.signature, tap.module))
            elif tap.module not in self.differing:
                self.differing[tap.module] = None
                self._found.append(tap.module)

    def settle(self) -> list[str]:
        """Between steps: mark the calls compared equal verified; return the modules found to
        differ since the last call."""
        with self._lock:
            self._verified |= {k for k in self._matched if k[1] not in self.differing}
            self._matched.clear()
            found, self._found = self._found, []
            return found
