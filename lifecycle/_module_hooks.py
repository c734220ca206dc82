"""Module hooks that stay out of a ``mod.compile()``d module's compiled call."""

from __future__ import annotations

import copy
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

    def drop(self, kind: str, entry: Any) -> None:
        hooks: list[Any] = self.pre if kind == "pre" else self.post
        for i, e in enumerate(hooks):
            if e is entry:
                del hooks[i]
                break
        if (
            not self.pre
            and not self.post
            and self.module.__dict__.get("_compiled_call_impl") is self
        ):
            self.module._compiled_call_impl = self.compiled


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


def _outer_call(mod: nn.Module) -> _OuterCall | None:
    compiled = getattr(mod, "_compiled_call_impl", None)
    if compiled is None:
        return None
    if not isinstance(compiled, _OuterCall):
        compiled = _OuterCall(mod, compiled)
        mod._compiled_call_impl = compiled
    return compiled


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
