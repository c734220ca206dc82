"""Module hooks that stay out of a ``mod.compile()``d module's compiled call."""

from __future__ import annotations

import copy
import weakref
from typing import Any

from torch import nn

# NOTE [ Hooks of a compiled call ]: ``mod.compile()`` sets ``mod._compiled_call_impl`` to a
# compiled ``mod._call_impl``, the function that runs ``mod``'s forward hooks, so dynamo traces
# every hook of that module. A recorder's or manager's hooks take locks, hold weak references
# and register grad_fn pre-hooks, none of which dynamo compiles: each broke the graph (2 breaks
# per compiled module), their guards on the manager's state recompiled its methods, and under
# ``fullgraph=True`` every step raised ``Unsupported``. On such a module the hooks run around
# the compiled call instead, in registration order (as ``nn.Module`` runs its own), eager; the
# module's own hooks (the user's) still run inside it. ``torch.compile(mod)`` (an
# OptimizedModule) and a compiled ``forward`` run their hooks outside dynamo already.
# ``mod.compile()`` again (new options, after ``torch._dynamo.reset()``) sets a new compiled call
# over ours, and the hooks stopped running for ``mod``, silently: a submodule's packs took its
# parent's keys (unplanned, over the budget), a root's left every step without a signature. No
# hook of ours sees that assignment, so whoever steps (the manager's ``__enter__``, the
# recorder's ``begin_step``) calls ``reinstate`` first: the hooks go back around the new call.
# Hooks registered on ``mod`` in between join its ``_OuterCall`` (found in ``_installed``), so a
# module never has two, one of them wrapping the other.


class _OuterCall:
    """Stands in for a module's ``_compiled_call_impl``: pre hooks, the compiled call, post
    hooks. Removing its last hook puts the compiled call back."""

    __slots__ = ("__weakref__", "compiled", "module", "post", "pre")

    def __init__(self, module: nn.Module, compiled: Any) -> None:
        self.module, self.compiled = module, compiled
        self.pre: list[tuple[Any, bool]] = []  # (hook, with_kwargs)
        self.post: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mod = self.module
        for hook, with_kwargs in list(self.pre):
            if with_kwargs:
                got = hook(mod, args, kwargs)
                if got is not None:
                    args, kwargs = got
            else:
                got = hook(mod, args)
                if got is not None:
                    args = got if isinstance(got, tuple) else (got,)
        out = self.compiled(*args, **kwargs)
        for hook in list(self.post):
            got = hook(mod, args, out)
            if got is not None:
                out = got
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A copy of the model (an EMA, a teacher) gets the compiled call as it was, not the
        # hooks (see lifecycle._inert).
        return copy.deepcopy(self.compiled, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_identity, (self.compiled,))

    def reinstate(self) -> bool:
        """Put this call back around the module's compiled call if ``mod.compile()`` replaced
        it. Returns False when the module has no compiled call any more (nothing to run
        around: its hooks do not run)."""
        current = self.module.__dict__.get("_compiled_call_impl")
        if current is None:
            return False
        if current is not self:
            self.compiled = current
            self.module._compiled_call_impl = self
        return True

    def drop(self, kind: str, entry: Any) -> None:
        hooks: list[Any] = self.pre if kind == "pre" else self.post
        for i, e in enumerate(hooks):
            if e is entry:
                del hooks[i]
                break
        if self.pre or self.post:
            return
        if self.module.__dict__.get("_compiled_call_impl") is self:
            self.module._compiled_call_impl = self.compiled
        ref = _installed.get(self.module)
        if ref is not None and ref() is self:
            del _installed[self.module]


def _identity(x: Any) -> Any:
    return x


class _OuterHandle:
    __slots__ = ("call", "entry", "kind")

    def __init__(self, call: _OuterCall, kind: str, entry: Any) -> None:
        self.call: _OuterCall | None = call
        self.kind, self.entry = kind, entry

    def remove(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            call.drop(self.kind, self.entry)


def outer_calls(handles: list[Any]) -> list[_OuterCall]:
    """The compiled calls that ``handles`` (from :func:`register_forward_hooks`) run hooks
    around, each once: what to ``reinstate`` at each step."""
    calls = {id(h.call): h.call for h in handles if isinstance(h, _OuterHandle) and h.call}
    return list(calls.values())


# A module -> its _OuterCall while that has hooks (the module's ``__dict__`` may no longer
# hold it: see NOTE [ Hooks of a compiled call ]); weakly both ways, as the _OuterCall holds
# the module (its hooks' handles keep it).
_installed: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_OuterCall]] = (
    weakref.WeakKeyDictionary()
)


def _outer_call(mod: nn.Module) -> _OuterCall | None:
    compiled = getattr(mod, "_compiled_call_impl", None)
    if compiled is None:
        return None
    ref = _installed.get(mod)
    call = ref() if ref is not None else None
    if call is not None and call.reinstate():
        return call
    call = _OuterCall(mod, compiled)
    mod._compiled_call_impl = call
    _installed[mod] = weakref.ref(call)
    return call


def register_forward_hooks(
    mod: nn.Module, pre: Any, post: Any, *, with_kwargs: bool = False
) -> list[Any]:
    """``mod.register_forward_pre_hook(pre, with_kwargs=...)`` and
    ``mod.register_forward_hook(post)``, or, on a ``mod.compile()``d module, the same hooks
    around its compiled call (NOTE [ Hooks of a compiled call ]). Returns their handles."""
    call = _outer_call(mod)
    if call is None:
        return [
            mod.register_forward_pre_hook(pre, with_kwargs=with_kwargs),
            mod.register_forward_hook(post),
        ]
    entry = (pre, with_kwargs)
    call.pre.append(entry)
    call.post.append(post)
    return [_OuterHandle(call, "pre", entry), _OuterHandle(call, "post", post)]
