"""Module hooks that a copy of the model does not carry over."""

from __future__ import annotations

from typing import Any


class ModuleHook:
    """A module hook of a recorder or an offload manager, which a copy of the model does not
    carry over: ``copy.deepcopy(model)`` (an EMA or teacher copy) and ``torch.save(model)`` copy
    a module's hooks, but the copy is not the model they watch (its calls must not count as the
    model's), and what they hold (a weak reference, a lock) cannot be pickled. The copy gets a
    hook that does nothing."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[Any, ...]:
        return (InertHook, ())


class InertHook:
    """What a copy of the model holds in place of a :class:`ModuleHook`: nothing happens."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class BoundHook(ModuleHook):
    """A method as a :class:`ModuleHook`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)
