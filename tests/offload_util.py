"""Helpers shared by the tests of the manager and the executor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from models import ALL_MODELS, ModelCase
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import storage

ENGINES = ("sync", "deferred")


def make_engine(kind: str, seed: int = 0) -> storage.CopyEngine | None:
    return storage.CopyEngine(deferred=True, seed=seed) if kind == "deferred" else None


@contextlib.contextmanager
def manager(model: nn.Module, engine: str = "sync", **kw: Any) -> Iterator[Any]:
    eng = make_engine(engine)
    kw.setdefault("min_offload_bytes", 0)
    mgr = offload.ActivationOffloader(model, _copy_engine=eng, **kw)
    try:
        yield mgr
    finally:
        mgr.close()
        if eng is not None:
            eng.close()


def nvme_kw(tiers: tuple[str, ...], tmp_path: Any) -> dict[str, Any]:
    """``nvme_dir=`` where ``tiers`` uses it (given without "nvme", it is ignored with a warning)."""
    return {"nvme_dir": tmp_path} if "nvme" in tiers else {}


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = getattr(g, "_local_tensor", g).detach().clone()
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for k in want:
        assert torch.equal(got[k], want[k]), k


def offloaded_step(case: ModelCase, mgr: Any, s: int = 0) -> dict[str, torch.Tensor]:
    case.model.zero_grad(set_to_none=True)
    with mgr:
        loss = case.loss(case.batch(s))
    loss.backward()
    return case.grads()


def reference_grads(name: str, s: int = 0) -> dict[str, torch.Tensor]:
    case = ALL_MODELS[name](seed=0)
    case.step(s)
    return case.grads()


def assert_nothing_live(mgr: Any) -> None:
    ex = mgr._executor
    assert ex.live_families() == 0
    assert ex.cpu_bytes == 0
    assert not ex._inflight and ex._inflight_bytes == 0


def settle(mgr: Any) -> None:
    """Wait for every copy out of the last step and retire it (sources dropped)."""
    ex = mgr._executor
    for fam in ex.step.families:
        if fam.handle is not None:
            fam.handle.wait()
    ex.poll()


def drain(mgr: Any) -> None:
    """Wait for every transfer the manager's tiers still run (deferred engines finish late)."""
    for tier in mgr._tiers:
        with tier._lock:
            inflight = list(tier._inflight)
        concurrent.futures.wait(inflight)


class Saver(torch.autograd.Function):
    """Saves its inputs as they are and hands them, as unpacked in backward, to ``seen``."""

    @staticmethod
    def forward(ctx: Any, seen: list, *xs: torch.Tensor) -> torch.Tensor:
        ctx.seen = seen
        ctx.save_for_backward(*xs)
        return sum(getattr(x, "_local_tensor", x).sum() for x in xs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        ctx.seen.append([(t.data_ptr(), t.detach().clone()) for t in saved])
        plain = (type(t) is torch.Tensor and t.requires_grad for t in saved)
        return (None, *(g.expand_as(t) if p else None for t, p in zip(saved, plain, strict=True)))


class Res(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.b = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.act(self.a(x)))


class CheckpointedBlocks(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Res() for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=self.use_reentrant) if i == 1 else block(x)
        return x


def on_another_thread(fn: Any) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def hand_family(data: torch.Tensor) -> Any:
    """A family of the whole of ``data``, made by hand."""
    from offload._family import Family

    return Family(
        fid=0,
        storage=data.untyped_storage(),
        root=data,
        version=0,
        span_start=0,
        nbytes=data.nbytes,
        storage_ptr=data.data_ptr(),
        module="m",
        order=0,
    )


def _grads(
    model: nn.Module,
    x: torch.Tensor,
    mgr: offload.ActivationOffloader | None = None,
    *,
    amp: Any = None,
    twice: bool = False,
) -> list[torch.Tensor]:
    """Parameter gradients of ``model(x).float().pow(2).sum()``, its forward inside ``mgr`` (and
    ``amp``, an autocast context) when given; ``twice``: a second backward of the same graph."""
    model.zero_grad(set_to_none=True)
    none = contextlib.nullcontext()
    with amp if amp is not None else none, mgr if mgr is not None else none:
        loss = model(x).float().pow(2).sum()
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()  # the saved tensors are unpacked (rebuilt) a second time
    return [p.grad.clone() for p in model.parameters()]


class _CastNorm(nn.LayerNorm):
    """A LayerNorm subclass whose forward is its own (here: a different eps): not rebuilt."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, 0.1)


class _CastRMSNorm(nn.RMSNorm):
    """An RMSNorm subclass whose forward is its own (here: a different eps): not rebuilt."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, self.normalized_shape, self.weight, 0.1)


class _NormNet(nn.Module):
    """Norm outputs saved by the next Linear: three ``nn.LayerNorm`` (``nn.RMSNorm``) modules
    (eps 1e-3, no affine, no bias or the default eps) whose outputs are rebuilt, and two that
    are stored: a subclass with its own forward and a functional call (no module says its
    eps)."""

    def __init__(self, kind: str = "layer_norm", width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        norms: list[nn.Module]
        if kind == "layer_norm":
            norms = [
                nn.LayerNorm(width, eps=1e-3),
                nn.LayerNorm(width, elementwise_affine=False),
                nn.LayerNorm(width, bias=False),
                _CastNorm(width),
            ]
        else:
            norms = [
                nn.RMSNorm(width, eps=1e-3),
                nn.RMSNorm(width, elementwise_affine=False),
                nn.RMSNorm(width),  # eps None: the dtype's own
                _CastRMSNorm(width),
            ]
        self.kind = kind
        self.norms = nn.ModuleList(norms)
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs, strict=False):
            x = x + fc(norm(x))
        if self.kind == "layer_norm":
            x = nn.functional.layer_norm(x, x.shape[-1:], eps=1e-4)
        else:
            x = nn.functional.rms_norm(x, x.shape[-1:], eps=1e-4)
        return self.fcs[-1](x)


@contextlib.contextmanager
def gc_pass_when_returning(fn: Any, **args: Any) -> Iterator[list[int]]:
    """Run a GC pass on this thread each time ``fn`` returns (with ``args`` among its locals):
    where an allocation would start one (on CUDA, ``torch.cuda.Event.query`` allocates). Yields
    a one-item list counting the passes run."""
    import sys

    code = fn.__code__
    passes = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "return" or frame.f_code is not code:
            return
        if all(frame.f_locals.get(k) == v for k, v in args.items()):
            passes[0] += 1
            gc.collect()

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield passes
    finally:
        sys.setprofile(before)


def garbage(*objs: Any) -> None:
    """Leave ``objs`` to the next GC pass only: in a reference cycle, with no other reference."""
    cycle: list[Any] = [*objs]
    cycle.append(cycle)


class _WaitForTier(torch.autograd.Function):
    """Identity whose backward waits until ``tier`` has no transfer running: the reloads the
    look-ahead started before it are read by then."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tier: Any) -> torch.Tensor:
        ctx.tier = tier
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        while ctx.tier.transfers_running:
            time.sleep(0.001)
        return grad, None
