"""Edge cases of the runtime, each against an oracle: tensor parallel (DTensor), aliases whose
bytes or versions change after pack, slices and alignment, compiled submodules, ``keep=`` types,
checkpointing, accumulation and interleaved steps, exceptions in backward, ``paused()``, several
managers, and late storage failures."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import gc
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import faults
import pytest
import torch
from models import ALL_MODELS, ModelCase, fail_backward_at, gpt_block, mlp, seeded_steps
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import lifecycle, storage
from offload._family import Life
from offload.lifecycle._calls import foreign_call

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


# -- tensor parallel -----------------------------------------------------------------------------


@pytest.fixture
def cpu_mesh(tmp_path) -> Iterator[Any]:
    """A one-rank gloo group and its CPU mesh (DTensors without a second process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.barrier()
        dist.destroy_process_group()


class TPBlock(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, hidden)
        # A ReLU, whose output is stored (a GELU's sharded output is rebuilt, and the LayerNorm
        # output that w1 saves too: tests/test_parallel_tp_fsdp.py), so DTensors reach the
        # executor.
        self.act = nn.ReLU()
        self.w2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(self.act(self.w1(self.ln(x))))


def tp_model(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(TPBlock(), TPBlock())
    for block in model:
        parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_parallel_dtensors_bitwise(cpu_mesh, engine: str) -> None:
    from torch.distributed.tensor import DTensor

    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    ref = tp_model(cpu_mesh)
    ref(x).pow(2).sum().backward()
    want = local_grads(ref)
    assert any(isinstance(p.grad, DTensor) for p in ref.parameters())

    model = tp_model(cpu_mesh)
    with manager(model, engine) as mgr:
        wrapped = []
        with mgr:
            ex = mgr._executor
            original = ex.offload

            def spy(
                t: torch.Tensor, module: str, dtensor: Any, tier: Any = None, stream: Any = None
            ) -> Any:
                wrapped.append(dtensor is not None)
                return original(t, module, dtensor, tier, stream)

            ex.offload = spy
            loss = model(x).pow(2).sum()
        loss.backward()
        del ex.offload
        assert any(wrapped), "no DTensor reached the executor"
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(local_grads(model), want)
        del loss
        gc.collect()
        assert_nothing_live(mgr)


def test_uneven_dtensor_shard_comes_back_with_its_global_shape(cpu_mesh) -> None:
    """One rank cannot shard unevenly, so the DTensor states a global shape its local tensor does
    not have (what rank 1 of 5 rows over 2 ranks sees); unpack must rebuild that shape, which
    ``from_local`` without ``shape=``/``stride=`` would not."""
    from torch.distributed.tensor import DTensor, Shard

    local = torch.randn(4, 3, requires_grad=True)
    seen: list = []
    model = nn.Identity()
    with manager(model) as mgr:
        with mgr:
            dt = DTensor.from_local(
                local * 2, cpu_mesh, [Shard(0)], run_check=False, shape=(5, 3), stride=(3, 1)
            )
            assert dt.shape == (5, 3)
            out = Saver.apply(seen, dt.to_local(), dt)
        assert mgr.stats.last.records_offloaded_cpu == 1  # the local bytes, stored once
        out.backward()
        ((_, plain), (_, rebuilt)) = seen[0]
        assert isinstance(rebuilt, DTensor)
        assert rebuilt.shape == (5, 3) and rebuilt.stride() == (3, 1)
        assert torch.equal(rebuilt.to_local(), local.detach() * 2)
        assert torch.equal(plain, local.detach() * 2)


# -- aliases: bytes and versions that change after pack ------------------------------------------


class ExpSavesOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g * y


@pytest.mark.parametrize("engine", ENGINES)
def test_data_reassignment_after_pack_changes_nothing(engine: str) -> None:
    """``out.data = ...`` after pack (Megatron's deallocate_output_tensor) must not change the
    bytes stored: the copy comes from ``t.detach()`` taken inside pack."""
    x0 = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))

    def run(mgr: Any) -> torch.Tensor:
        x = x0.clone().requires_grad_()
        ctx = mgr if mgr is not None else contextlib.nullcontext()
        with ctx:
            y = ExpSavesOutput.apply(x * 1.5)
            loss = y.sum()
            y.data = torch.zeros(1)  # frees the output's bytes, keeps its graph
        loss.backward()
        return x.grad

    want = run(None)
    assert torch.equal(want, (x0 * 1.5).exp() * 1.5)
    with manager(nn.Identity(), engine) as mgr:
        assert torch.equal(run(mgr), want)
        assert mgr.stats.last.bytes_offloaded_cpu >= x0.numel() * 4


def test_newer_version_starts_a_new_copy() -> None:
    seen: list = []
    with manager(nn.Identity()) as mgr:
        with mgr:
            x = torch.randn(64, 64, requires_grad=True) * 1.0
            dropped = Saver.apply([], x)  # version v, in a graph that is never run backward
            x.mul_(3)  # version v + 1
            after = x.detach().clone()
            b = Saver.apply(seen, x)
            c = Saver.apply(seen, x[:10])  # same version, inside the copy: deduplicated
        del dropped
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 2
        assert last.records_deduplicated == 1
        (c + b).backward()
        (got_c, got_b) = (s[0][1] for s in seen)
        assert torch.equal(got_b, after)
        assert torch.equal(got_c, after[:10])


class Pieces(nn.Module):
    """What a CPU GRU cell does: one storage split by ``unsafe_chunk`` (pieces that are not
    views, each with its own version counter), each piece changed in place and saved at version
    1. Equal versions of one storage, unrelated bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.fc(x).unsafe_chunk(3, 1)
        a, b, c = a.sigmoid_(), b.sigmoid_(), c.tanh_()
        return (a * 3 + b * 5 + c * 7).pow(2)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
def test_unsafe_chunk_pieces_changed_in_place_are_stored_apart(
    engine: str, tiers, tmp_path
) -> None:
    """Matching members on storage and version alone served one piece's bytes for another (a
    GRU's gradients were off by up to 2e-3, this model's by 115): versions of different counters
    do not compare (NOTE [ Alias handling ])."""
    torch.manual_seed(0)
    model = Pieces()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    trace = offload.profile(lambda: model(x).sum().backward(), model, warmup_steps=0)
    pieces = [r for r in trace.records if r.grad_fn in ("SigmoidBackward0", "TanhBackward0")]
    assert len(pieces) == 3 and len({r.storage_nbytes for r in pieces}) == 1
    assert len({r.family for r in pieces}) == 3  # the recorder keeps them apart too
    model.zero_grad(set_to_none=True)
    with manager(model, engine, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        with mgr:
            loss = model(x).sum()
        loss.backward()
        # Each piece copies its own span only (no sibling can join its family), as planned.
        last = mgr.stats.last
        assert last.records_deduplicated == 0
        assert last.bytes_offloaded_cpu + last.bytes_offloaded_nvme == trace.saved_bytes
    assert_bitwise(local_grads(model), want)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
def test_in_place_change_after_save_raises_like_autograd(engine: str, tiers, tmp_path) -> None:
    """Saved-tensor hooks switch off autograd's version check; offload keeps it."""

    def run(mgr) -> str:
        lin = nn.Linear(64, 64)
        h = lin(torch.randn(32, 64))
        ctx = mgr if mgr is not None else contextlib.nullcontext()
        with ctx:
            y = h.sigmoid()  # saves its output
            y.mul_(2)  # changes it afterwards
            loss = y.sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            loss.backward()
        return str(info.value)

    run(None)  # autograd itself raises
    kw = {"nvme_dir": tmp_path} if "nvme" in tiers else {}
    with manager(nn.Identity(), engine, tiers=tiers, **kw) as mgr:
        assert "version" in run(mgr)


class _FunctionalRReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rrelu(x, training=self.training)


class _InlineRReLU(nn.Module):
    """F.rrelu between two functional linears of one module: no module boundary after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Parameter(torch.randn(4, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        return F.linear(F.rrelu(F.linear(x, self.a), training=self.training), self.b)


def _rrelu_model(act: str) -> nn.Module:
    torch.manual_seed(0)
    if act == "inline":
        return _InlineRReLU()
    if act == "last":
        return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    middle = nn.RReLU() if act == "module" else _FunctionalRReLU()
    return nn.Sequential(nn.Linear(16, 16), middle, nn.Linear(16, 4))


def _rrelu_loss(act: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(7)
    if act == "last":  # F.rrelu outside every module, the last op that saves before backward
        return torch.nn.functional.rrelu(model(x), training=True).sum()
    return model(x).pow(2).sum()


@pytest.mark.parametrize("backward", ["after", "inside"])
@pytest.mark.parametrize("act", ["module", "functional", "inline", "last"])
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
def test_rrelu_noise_filled_after_pack(act: str, tiers, backward: str, tmp_path) -> None:
    """F.rrelu(training=True) saves its noise tensor, then fills it in the same op: the bytes
    seen at pack are not the ones backward needs, and its version counter does not move. Its
    copy waits until the op has returned (NOTE [ Fill after pack ]): at the next module
    boundary, the next pack of a later op, the step's exit or backward's first unpack.
    Before, a bare F.rrelu gave wrong gradients (0.weight, 0.bias and 2.weight differed)."""

    def run(mgr: Any) -> tuple[dict[str, torch.Tensor], Any]:
        model = _rrelu_model(act)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        ctx = mgr(model) if mgr is not None else contextlib.nullcontext()
        with ctx as m:
            with m if m is not None else contextlib.nullcontext():
                loss = _rrelu_loss(act, model, x)
                if backward == "inside":
                    loss.backward()
            if backward == "after":
                loss.backward()
            stats = m.stats.last if m is not None else None
        return local_grads(model), stats

    want, _ = run(None)
    got, stats = run(lambda model: manager(model, tiers=tiers, **nvme_kw(tiers, tmp_path)))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert stats.records_offloaded_cpu + stats.records_offloaded_nvme > 0
    if act == "inline":
        # x and the noise (no gradient: deferred), h, rrelu's output and the model's output
        # (pow's): all five stored; b.t() kept (a parameter's view).
        stored = stats.records_offloaded_cpu + stats.records_offloaded_nvme
        assert (stored, stats.records_kept) == (5, 1)


def test_an_earlier_steps_backward_inside_a_step_keeps_none_of_its_packs() -> None:
    """A step's packs without gradient still waiting for their copy stay where they are when
    that step's backward begins (NOTE [ Fill after pack ]), not when the backward of an earlier
    step runs inside it (two forwards before their backwards). Before, each step whose block
    ran the previous step's backward kept its last op's mask (64 KiB) on the device until its
    own backward: 2 records kept and 2 stored instead of 1 and 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    xs = [torch.randn(256, 64) for _ in range(3)]
    masks = [torch.rand(256, 64) for _ in range(3)]

    def loss_of(i: int) -> torch.Tensor:
        return (model(xs[i]) * masks[i]).sum()  # mul saves the mask (no gradient) last

    for i in range(3):
        loss_of(i).backward()
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    with manager(model) as mgr:
        previous = None
        for i in range(3):
            with mgr:
                loss = loss_of(i)
                if previous is not None:
                    previous.backward()
            last = mgr.stats.last
            # Stored: x, the tanh output (saved twice), the mask; kept: the weight's view.
            assert (last.records_offloaded_cpu, last.records_kept) == (3, 1), i
            previous = loss
        assert previous is not None
        previous.backward()
    got = local_grads(model)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_deferred_pack_changed_in_place_raises_like_autograd() -> None:
    """A saved tensor without gradient changed in place before its deferred copy: backward
    raises autograd's error, as it does without offload, instead of using the new bytes."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.rand(4, 8).round()
            y = (x @ self.w) * mask  # saves mask (deferred)
            mask.add_(1)  # no node: the copy still waits
            return y

    x = torch.randn(4, 8)
    model = Scale()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with manager(model) as mgr:
        with mgr:
            loss = model(x).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("engine", ENGINES)
def test_slices_of_a_bigger_storage_keep_values_and_alignment(engine: str) -> None:
    """Members spanning less than their storage come back with their values and their original
    address modulo 64 (kernels pick code paths by alignment)."""
    seen: list = []
    with manager(nn.Identity(), engine) as mgr:
        with mgr:
            # A non-leaf of 160396 bytes; the family is bytes [4, 16000): under a quarter of the
            # storage, so only that span is copied.
            base = torch.randn(40099, requires_grad=True) * 1.0
            wide = base[1:4000]
            members = [
                wide,
                base[3:1000],
                base[5:2000:2],
                base[7:3007].view(100, 30).t(),
                base[2:3602].view(60, 60)[1:, 3:],
            ]
            ptrs = [m.data_ptr() for m in members]
            values = [m.detach().clone() for m in members]
            out = Saver.apply(seen, *members)
            del base, wide, members  # the original storage may go once copied
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 1
        assert last.records_deduplicated == 4
        assert last.bytes_offloaded_cpu == (4000 - 1) * 4  # the span, not the whole storage
        settle(mgr)  # the copy is done: backward reloads it instead of using the source
        out.backward()
        assert mgr.stats.last.reloads == 1
        back = seen[0]
        for i, ((ptr, got), want, orig) in enumerate(zip(back, values, ptrs, strict=True)):
            assert got.shape == want.shape and torch.equal(got, want), i
            assert ptr % 64 == orig % 64, i
        # The members are views of one reloaded buffer, as they were of one storage.
        assert back[1][0] - back[0][0] == ptrs[1] - ptrs[0]


# -- compiled submodules, keep= types, checkpointing -----------------------------------------------


class Res(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.b = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.act(self.a(x)))


def three_blocks(compile_mode: str | None = None) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(Res(), Res(), Res())
    if compile_mode == "wrap":
        model[1] = torch.compile(model[1], backend="eager")
    elif compile_mode == "method":
        model[1].compile(backend="eager")
    return model


def inner_hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_compiled_submodule_is_a_leaf() -> None:
    want = seeded_steps(three_blocks("wrap"), n=2)[-1]
    model = three_blocks("wrap")
    with manager(model) as mgr:
        assert inner_hooks(model[1]._orig_mod) == 0  # nothing inside the compiled region
        assert len(model[1]._forward_pre_hooks) == 1  # the compiled module itself is a leaf
        got = seeded_steps(model, mgr, n=2)[-1]
        assert mgr.stats.last.bytes_offloaded_cpu > 0
    assert_bitwise(got, want)


def test_module_compile_method_is_a_leaf() -> None:
    model = three_blocks("method")
    compiled_call = model[1]._compiled_call_impl
    with manager(model):
        # Its hooks run around its compiled call, none inside it (NOTE [ Hooks of a compiled
        # call ] in lifecycle/_module_hooks.py).
        assert inner_hooks(model[1]) == 0
        assert model[1]._compiled_call_impl is not compiled_call
    assert model[1]._compiled_call_impl is compiled_call


def test_a_model_compiled_after_its_manager_warns_once() -> None:
    """torch.compile on a model after its manager was made traces the manager's module hooks,
    which dynamo cannot compile: 23 graph breaks in one step of these 3 blocks (none when
    compiled first). One RuntimeWarning says so and what to do (there was none); gradients stay
    exact. Compiled first (a submodule, ``.compile()``, or a compiled ``forward``, which was not
    a leaf before and took the same 23 breaks), nothing is said."""
    want = seeded_steps(three_blocks(), n=2)[-1]
    model = three_blocks()
    with manager(model) as mgr:
        compiled = torch.compile(model, backend="eager")
        with pytest.warns(RuntimeWarning, match="compiled with torch.compile after") as record:
            got = seeded_steps(compiled, mgr, n=2)[-1]
        assert mgr.stats.last.bytes_offloaded_cpu > 0
    assert len(record) == 1 and "Compile first" in str(record[0].message)
    assert record[0].filename == seeded_steps.__code__.co_filename  # the with statement's line
    assert_bitwise(plain_names(got), want)
    # Under fullgraph=True the first hook fails to compile, before anything runs: a note says why.
    torch._dynamo.reset()  # no cached graphs, no recompilation limit reached (it runs eager then)
    model = three_blocks()
    with manager(model) as mgr, pytest.raises(Exception) as failed:
        with mgr:
            torch.compile(model, backend="eager", fullgraph=True)(torch.randn(32, 64))
    if hasattr(failed.value, "add_note"):  # Python >= 3.11
        assert "compile first" in "".join(getattr(failed.value, "__notes__", ()))
    for mode in ("wrap", "method", "forward"):
        model = three_blocks(mode if mode != "forward" else None)
        if mode == "forward":
            model[1].forward = torch.compile(model[1].forward, backend="eager")
        with manager(model) as mgr, warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert inner_hooks(getattr(model[1], "_orig_mod", model[1])) == (mode == "forward") * 2
            assert_bitwise(plain_names(seeded_steps(model, mgr, n=2)[-1]), want)


def plain_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): g for n, g in grads.items()}


def test_the_thread_check_of_module_hooks_stays_out_of_dynamo() -> None:
    """A model compiled after its manager was made runs the manager's and its recorder's module
    hooks under dynamo. Their check that a call comes from the step's thread is skipped there:
    dynamo cannot trace ``threading.get_ident()`` (26 of this step's 40 graph breaks were there, and
    under ``fullgraph=True`` the check alone fails to compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = three_blocks()
    hardware = lifecycle.HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    with manager(model, gpu_budget="64KiB", hardware=hardware) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # compiled after the manager was made
        compiled = torch.compile(model, backend="eager")
        with mgr:
            loss = compiled(torch.randn(32, 64)).sum()
            assert mgr._budget._profiler.recording
        loss.backward()
        assert mgr._step.calls.counts == {name: 1 for name, _ in model.named_modules()}
    breaks = [r for r in counters["graph_break"] if "get_ident" in r or "graph_task" in r]
    assert not breaks
    ident = threading.get_ident()
    check = torch.compile(
        lambda x: x if foreign_call(ident) else 2 * x, backend="eager", fullgraph=True
    )
    assert torch.equal(check(torch.ones(2)), torch.full((2,), 2.0))


def test_keep_a_module_type() -> None:
    want = reference_grads("mlp")
    case = mlp(seed=0)
    with manager(case.model, keep=(nn.GELU,)) as mgr:
        modules: list[str] = []
        with mgr:
            ex = mgr._executor
            original = ex.offload

            def spy(
                t: torch.Tensor, module: str, dtensor: Any, tier: Any = None, stream: Any = None
            ) -> Any:
                modules.append(module)
                return original(t, module, dtensor, tier, stream)

            ex.offload = spy
            loss = case.loss(case.batch())
        del ex.offload
        loss.backward()
        assert modules and "act1" not in modules
        assert {"fc1", "fc2", "act2"} <= set(modules)
        assert mgr.stats.last.records_kept > 0
        assert_bitwise(case.grads(), want)


def _moved_and_grads(
    make: Any, run: Any, keep: Any
) -> tuple[int, int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step of a fresh ``make()`` with ``keep=`` (bytes moved, records kept, grads) and
    the grads of a step without the manager."""
    ref = make()
    run(ref).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    model = make()
    with manager(model, keep=keep) as mgr:
        with mgr:
            loss = run(model)
        loss.backward()
        last = mgr.stats.last
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return last.bytes_offloaded_cpu, last.records_kept, got, want


def test_keep_a_module_list_keeps_what_its_children_save() -> None:
    """keep= naming an nn.ModuleList (which has no forward: its own hooks never run) keeps what
    its blocks save, as naming each block does (NOTE [ Keep covers the module tree ]): it kept
    nothing, and said nothing (examples/gpt.py: 96,660 B moved a step either way, naming the
    blocks 13,204 B)."""
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    def run(m: nn.Module) -> torch.Tensor:
        return m.loss(idx[:, :-1], idx[:, 1:])

    def make() -> nn.Module:
        return GPT(cfg)

    moved_all, _, _, _ = _moved_and_grads(make, run, ())
    moved_each, kept_each, _, _ = _moved_and_grads(make, run, ["blocks.0", "blocks.1"])
    moved, kept, got, want = _moved_and_grads(make, run, ["blocks"])
    assert moved_each < moved_all // 4
    assert (moved, kept) == (moved_each, kept_each)
    assert_bitwise(got, want)
    typed, _, _, _ = _moved_and_grads(make, run, [nn.ModuleList])
    assert typed == moved_each


def test_keep_a_transformers_module_list() -> None:
    """The same on a real transformers model: GPT-2's ``transformer.h`` (an nn.ModuleList) kept
    nothing (244,100 B moved a step, as without keep=; naming its blocks 13,188 B)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )  # fmt: skip
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    def run(m: nn.Module) -> torch.Tensor:
        return m(idx, labels=idx).loss

    moved_all, _, _, _ = _moved_and_grads(make, run, ())
    moved_each, _, _, _ = _moved_and_grads(make, run, ["transformer.h.0", "transformer.h.1"])
    moved, _, got, want = _moved_and_grads(make, run, ["transformer.h"])
    assert moved_each < moved_all // 4
    assert moved == moved_each
    assert_bitwise(got, want)


def test_keep_that_can_keep_nothing_warns() -> None:
    """A keep= type no module has, or a module inside a compiled one (a leaf to the manager),
    keeps nothing: said once, when the manager is made. An unknown name is refused."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
    with pytest.warns(RuntimeWarning, match=r"types \['Conv2d'\].*keep nothing") as said:
        offload.ActivationOffloader(model, keep=[nn.Conv2d, nn.GELU]).close()
    assert len(said) == 1 and said[0].filename == __file__
    model[1].compile(backend="eager")
    with pytest.warns(RuntimeWarning, match=r"keep=\['1.0'\] keeps nothing.*compiled module '1'"):
        offload.ActivationOffloader(model, keep=["1.0"]).close()
    with pytest.raises(ValueError, match=r"keep: no module named \['blocks'\].*named_modules"):
        offload.ActivationOffloader(model, keep=["blocks"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.ActivationOffloader(model, keep=["1", nn.Linear]).close()


class CheckpointedBlocks(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Res() for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=self.use_reentrant) if i == 1 else block(x)
        return x


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant: bool, backward_inside: bool) -> None:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return CheckpointedBlocks(use_reentrant)

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    ref = build()
    ref(x).pow(2).sum().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    want_x = x.grad.clone()
    x.grad = None
    model = build()
    with manager(model) as mgr:
        with mgr:
            loss = model(x).pow(2).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        del loss
        gc.collect()
        assert_nothing_live(mgr)
    assert_bitwise({n: p.grad for n, p in model.named_parameters()}, want)
    assert torch.equal(x.grad, want_x)


def on_another_thread(fn: Any) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_module_calls_of_a_backward_on_another_thread_count(use_reentrant: bool) -> None:
    """Module calls from other threads are not the step's, except from inside a backward (on
    CUDA backward runs on autograd's device thread): a checkpointed block recomputed by a
    backward run on another thread inside the step counts as when the step's thread runs it."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    calls, grads = [], []
    for elsewhere in (False, True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = CheckpointedBlocks(use_reentrant)
        with manager(model) as mgr:
            with mgr:
                loss = model(x).pow(2).sum()
                forward_calls = dict(mgr._step.calls.counts)
                on_another_thread(loss.backward) if elsewhere else loss.backward()
                calls.append(dict(mgr._step.calls.counts))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert calls[1] == calls[0] != forward_calls  # the recomputation's calls are counted
    assert_bitwise(grads[1], grads[0])


def test_a_second_thread_entering_a_running_step_is_told_why() -> None:
    """``with mgr:`` on another thread while a step runs: an error that says so (before, it
    said steps do not nest), and the running step goes on unharmed."""
    want = reference_grads("mlp")
    case = mlp(seed=0)
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with mgr:
                pass
        except offload.OffloadError as e:
            errors.append(e)

    with manager(case.model) as mgr:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            on_another_thread(enter)
            loss = case.loss(case.batch())
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
    (error,) = errors
    assert "running on another thread" in str(error) and "one step at a time" in str(error)


def test_a_pause_on_another_thread_leaves_the_running_step_alone() -> None:
    """``mgr.paused()`` entered on another thread while a step runs (an evaluation thread
    keeping its own work out of the manager): saved-tensor hooks are per thread, so nothing of
    that thread's reached the step anyway; counted, the pause turned the step's offloading off
    (0 bytes offloaded while it was held)."""
    want = reference_grads("mlp")
    case = mlp(seed=0)
    held, release = threading.Event(), threading.Event()

    def pause() -> None:
        with mgr.paused():
            held.set()
            release.wait(30)

    with manager(case.model) as mgr:
        case.model.zero_grad(set_to_none=True)
        other = threading.Thread(target=pause)
        with mgr:
            other.start()
            assert held.wait(30)
            loss = case.loss(case.batch())
            release.set()
        other.join(30)
        loss.backward()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
        with mgr.paused():  # on the step's thread, outside a step: as before
            assert mgr._paused == 1


# -- steps: accumulation, interleaving, exceptions -----------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_accumulation_over_two_micro_steps(engine: str) -> None:
    ref = gpt_block(seed=0)
    ref.model.zero_grad(set_to_none=True)
    for s in range(2):
        ref.loss(ref.batch(s)).backward()
    want = ref.grads()
    case = gpt_block(seed=0)
    with manager(case.model, engine) as mgr:
        case.model.zero_grad(set_to_none=True)
        for s in range(2):
            with mgr:
                loss = case.loss(case.batch(s))
            loss.backward()
        assert mgr.stats.total.steps == 2
        assert mgr.stats.total.records_offloaded_cpu > 0
        assert_bitwise(case.grads(), want)
        del loss
        assert_nothing_live(mgr)


def test_two_forwards_then_two_backwards() -> None:
    """Pipelining's shape: step 2 begins while step 1's copies are still in flight and before its
    backward. Step 1's copies must still be retired (their sources dropped) and its backward must
    prefetch its own families."""
    ref = gpt_block(seed=0)
    ref.model.zero_grad(set_to_none=True)
    losses = [ref.loss(ref.batch(s)) for s in range(2)]
    for loss in losses:
        loss.backward()
    want = ref.grads()

    case = gpt_block(seed=0)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=4)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, _copy_engine=engine, max_inflight_bytes=1 << 30
    )
    try:
        case.model.zero_grad(set_to_none=True)
        with engine.paused(), mgr:
            loss1 = case.loss(case.batch(0))
        ex = mgr._executor
        first = list(ex.step.families)
        assert first and all(f.life is Life.COPYING_OUT for f in first)
        with mgr:
            loss2 = case.loss(case.batch(1))
        for f in first:
            f.handle.wait()
        ex.poll()
        assert all(f.life is Life.OFF_DEVICE and f.source is None for f in first)
        ex.poll()
        for f in ex.step.families:
            f.handle.wait()
        ex.poll()
        loss1.backward()
        # Step 1's backward prefetched step 1's families, not step 2's.
        assert all(f.life is Life.OFF_DEVICE for f in ex.step.families)
        assert mgr.stats.last.stalls <= 1
        loss2.backward()
        assert_bitwise(case.grads(), want)
        del loss1, loss2
        gc.collect()
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_exception_in_backward_leaves_nothing_live(engine: str, backward_inside: bool) -> None:
    case = gpt_block(seed=0)
    with manager(case.model, engine) as mgr:
        offloaded_step(case, mgr)  # warm: the pool has its slab
        drain(mgr)  # the warm step's late transfers end first (else `used` raced them)
        mgr._executor.poll()
        pool = mgr._executor.pool
        used = pool.used_bytes
        with pytest.raises(RuntimeError, match="boom in backward") as info:
            with mgr:
                h = case.model(case.batch()[0])
                loss = (Explode.apply(h[:, :16]).sum() + h.pow(2).sum()) * 1.0
                if backward_inside:
                    loss.backward()
            loss.backward()
        del info, h, loss
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)  # reloads started before the error release their regions when they end
        assert pool.used_bytes == used
        # The manager keeps working, exactly.
        assert_bitwise(offloaded_step(case, mgr), reference_grads("gpt_block"))


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("mode", ["min_memory", "budget"])
def test_a_backward_that_raises_midway_leaves_host_and_file_as_before(
    mode: str, fault: type[BaseException], tmp_path
) -> None:
    """A gradient hook raises (or Ctrl-C arrives) in the middle of backward, after the MLP's
    unpacks, with records in pinned memory and on NVMe (a 64 KiB cpu_budget), in min-memory
    mode and under a plan. Once the loss is dropped (and the reads backward had started end),
    the host tier, the spill file's ranges and the open files are as before the step, and the
    next step is bitwise."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    failing = fail_backward_at(case.model.attn, fault)  # its gradient comes after the MLP's
    budget: dict[str, Any] = {}
    if mode == "budget":
        hw = lifecycle.HardwareModel.cpu_only(
            copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
        )
        budget = {"gpu_budget": "384KiB", "hardware": hw}  # keeps, cpu and nvme
    with manager(
        case.model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget="64KiB", **budget
    ) as mgr:
        for s in range(2):  # a budget's profiling step, then its plan
            assert_bitwise(offloaded_step(case, mgr, s), want[s])
        drain(mgr)
        ex, (host, nvme) = mgr._executor, mgr._tiers
        files = len(os.listdir("/proc/self/fd"))
        assert (ex.live_families(), host.used_bytes, nvme.used_bytes) == (0, 0, 0)
        failing.append(1)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(2))
        # Both tiers hold records (a refined plan may place them otherwise: some, at least).
        held = [host.used_bytes > 0, nvme.used_bytes > 0]
        assert all(held) if mode == "min_memory" else any(held)
        with pytest.raises(fault):
            loss.backward()
        failing.clear()
        del loss
        gc.collect()
        drain(mgr)
        assert (ex.live_families(), ex.cpu_bytes, host.used_bytes, nvme.used_bytes) == (0,) * 4
        assert len(os.listdir("/proc/self/fd")) == files
        assert not mgr._step.deferred and mgr._budget._profiling is None
        assert_bitwise(offloaded_step(case, mgr, 3), want[3])


def _interrupted_once(fn: Any) -> Any:
    """``fn``, except that its first call raises KeyboardInterrupt (Ctrl-C arriving there)."""
    calls: list[int] = []

    def wrapper(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return fn(*args, **kw)

    return wrapper


@pytest.mark.parametrize("where", ["release", "free", "tier"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_release_cut_short_by_an_interrupt_is_finished(engine: str, where: str, monkeypatch):
    """Ctrl-C while backward frees the graph: the KeyboardInterrupt is raised inside a saved
    tensor's handle's ``__del__`` (Python prints it and drops it) as it releases its family, on
    entry, before the bytes are freed, or inside the tier's ``free``. That family kept its 32 KiB
    in the host tier (and in ``cpu_bytes``, the cpu_budget count) until close(); now the next
    count of live families finishes the release, and the next steps are exact and leave nothing."""
    from offload import _release

    want = [reference_grads("gpt_block", s) for s in range(3)]
    case = gpt_block(seed=0)
    dropped: list[type[BaseException] | None] = []  # not the exceptions: their frames hold handles
    monkeypatch.setattr("sys.unraisablehook", lambda u: dropped.append(u.exc_type))
    with manager(case.model, engine) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        ex = mgr._executor
        host = mgr._tiers[0]
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        if where == "tier":
            monkeypatch.setattr(host, "free", _interrupted_once(host.free))
        elif where == "release":
            monkeypatch.setattr(type(ex), "release", _interrupted_once(type(ex).release))
        else:
            monkeypatch.setattr(_release, "free", _interrupted_once(_release.free))
        loss.backward()
        monkeypatch.undo()
        assert dropped == [KeyboardInterrupt]
        assert_bitwise(case.grads(), want[1])
        del loss
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)
        assert host.used_bytes == 0
        assert_bitwise(offloaded_step(case, mgr, 2), want[2])
        gc.collect()
        assert_nothing_live(mgr)
        drain(mgr)
        assert host.used_bytes == 0


# -- paused(), foreign hooks, reading saved tensors outside backward -----------------------------


def test_pack_while_paused_passes_through() -> None:
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with manager(model) as mgr:
        with mgr:
            with mgr.paused():
                y = torch.tanh(model(x))
            records = mgr.stats.last.records
            z = torch.tanh(model(x))
        assert records == 0
        assert mgr.stats.last.records > 0
        # The paused graph holds plain tensors, not offload handles.
        assert isinstance(y.grad_fn._saved_result, torch.Tensor)
        assert mgr._executor.live_families() == len(mgr._executor.step.families)
        (y.sum() + z.sum()).backward()


def test_a_step_that_ends_inside_paused_leaves_the_hook_stack_sound() -> None:
    """close() (or a step's exit) inside ``paused()`` used to pop a hook pair that paused() had
    taken off already: torch's internal assert on an empty stack. The stack stays balanced, and
    the next step offloads as usual."""
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with manager(model) as mgr:
        mgr.__enter__()
        paused = mgr.paused()
        paused.__enter__()
        mgr.__exit__(None, None, None)  # the step ends inside the paused region
        paused.__exit__(None, None, None)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        with mgr:
            loss = torch.tanh(model(x)).sum()
        assert mgr.stats.last.records > 0
        loss.backward()
        with mgr:
            with mgr.paused():
                mgr.close()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_paused_leaves_a_foreign_hook_alone() -> None:
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    foreign: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        foreign.append(t)
        return t

    with manager(model) as mgr:
        with mgr:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with mgr.paused():
                    y = torch.tanh(model(x))
            n_foreign = len(foreign)
            before = mgr.stats.last.records
            z = torch.tanh(model(x))  # ours again
        assert n_foreign > 0  # the innermost (foreign) pair kept firing inside paused()
        assert mgr.stats.last.records > before
        assert len(foreign) == n_foreign
        (y.sum() + z.sum()).backward()


def test_saved_tensor_read_outside_backward() -> None:
    """``grad_fn._saved_*`` unpacks outside any backward (no final callback can be queued)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    with manager(model) as mgr:
        with mgr:
            y = model(x)
        last = mgr.stats.last
        assert last.records_offloaded_cpu > 0 and last.records_rebuilt > 0  # mat1: rebuilt
        h = model[1](model[0](x))
        saved = y.grad_fn._saved_mat1
        assert torch.equal(saved, h)
        y.sum().backward()
        assert mgr.stats.last.step_s > 0


class _SparseAndNested(nn.Module):
    """A graph convolution (a sparse COO or CSR adjacency times a Linear's output: ``sparse.mm``
    saves the sparse matrix) and a strided nested tensor saved by a ``mul``."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        eye = torch.eye(64) + torch.diag(torch.ones(63), 1)
        self.adj = eye.to_sparse() if layout is torch.sparse_coo else eye.to_sparse_csr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(self.adj, self.lin(x))
        nested = torch.nested.as_nested_tensor([h[:20], h[20:]])
        out = nested * nested
        return sum(t.sum() for t in out.unbind())


@pytest.mark.filterwarnings("ignore:.*(nested|Sparse CSR).*")
@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)], ids=["cpu", "nvme"])
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_sparse_and_nested_saved_tensors_stay_where_they_are(
    layout: torch.layout, tiers, tmp_path
) -> None:
    """They have no one strided storage to copy (reading it raised NotImplementedError, or
    RuntimeError from a nested tensor's sizes): kept on the device, both by the manager and in
    a profile, where each is a record of 0 bytes; the dense tensors around them move."""
    torch.manual_seed(0)
    model = _SparseAndNested(layout)
    x = torch.randn(64, 16)
    model(x).backward()
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    with manager(model, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        with mgr:
            loss = model(x)
        loss.backward()
        stats = mgr.stats.last
        assert stats.records_kept >= 3  # the adjacency and the two nested tensors mul saves
        assert stats.records_offloaded_cpu + stats.records_offloaded_nvme >= 1
    assert_bitwise(local_grads(model), want)
    model.zero_grad(set_to_none=True)
    trace = offload.profile(lambda: model(x).backward(), model, warmup_steps=0)
    opaque = [r for r in trace.records if r.storage_nbytes == 0 and r.nbytes == 0]
    assert len(opaque) >= 3
    assert len({r.family for r in opaque}) == len(opaque)


# -- several managers, late failures --------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_two_managers_share_the_pool_and_stay_exact(engine: str) -> None:
    want_a = [reference_grads("gpt_block", s) for s in range(2)]
    want_b = [reference_grads("mlp", s) for s in range(2)]
    a, b = gpt_block(seed=0), mlp(seed=0)
    with manager(a.model, engine) as ma, manager(b.model, engine) as mb:
        for s in range(2):
            a.model.zero_grad(set_to_none=True)
            b.model.zero_grad(set_to_none=True)
            with ma:
                la = a.loss(a.batch(s))
            with mb:
                lb = b.loss(b.batch(s))
            lb.backward()
            la.backward()
            assert_bitwise(a.grads(), want_a[s])
            assert_bitwise(b.grads(), want_b[s])
        assert ma._executor.pool is mb._executor.pool
        assert ma.stats.total.bytes_offloaded_cpu > 0 and mb.stats.total.bytes_offloaded_cpu > 0
        del la, lb
        assert_nothing_live(ma)
        assert_nothing_live(mb)


def test_each_manager_gets_its_own_cpu_budget_from_the_shared_pool(monkeypatch) -> None:
    """Two managers on one rank (two pipeline stages, say), each with cpu_budget=4MiB, each
    holding 2.5 MiB at once: the shared pool has room for both (its cap used to be the larger
    budget, not the sum). When both have closed, its slabs are back with the host."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)) for _ in "ab"]
    x = torch.randn(512, 256)
    managers = [
        offload.ActivationOffloader(m, cpu_budget="4MiB", min_offload_bytes=0) for m in models
    ]
    losses = []
    for m, mgr in zip(models, managers, strict=True):
        with mgr:
            losses.append(m(x).sum())
    held = [mgr._executor.cpu_bytes for mgr in managers]
    assert held[0] == held[1] > 2 << 20
    pool = managers[0]._executor.pool
    assert managers[1]._executor.pool is pool and pool.capacity_bytes >= 8 << 20
    for loss in losses:
        loss.backward()
    for mgr in managers:
        mgr.close()
    assert pool.reserved_bytes == 0


class _SinChain(nn.Module):
    """``k`` sines in a row: each saves its input, a record of the input's bytes."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w
        for _ in range(self.k):
            x = torch.sin(x)
        return x


def test_cpu_budget_counts_the_host_regions_padding(tmp_path) -> None:
    """181 records of 5,000 bytes with cpu_budget=1MiB: the budget was checked against the
    records' bytes (905,000), while each took an 8 KiB region of the pool: the manager held
    1.41 MiB of host memory, and on a shared pool that was room another manager had claimed for
    its own budget (it then failed under its budget). Now the regions are what is counted: 128
    records stay in host memory (1 MiB), the rest go to NVMe; gradients are exact."""
    torch.manual_seed(0)
    model, x = _SinChain(180), torch.randn(1250)
    model(x).sum().backward()
    want = model.w.grad.clone()
    model.zero_grad(set_to_none=True)
    with manager(model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget="1MiB") as mgr:
        with mgr:
            loss = model(x).sum()
        host = mgr._tiers[0]
        assert mgr._executor.cpu_bytes == host.used_bytes <= 1 << 20
        assert mgr.stats.last.records_offloaded_cpu == 128
        assert mgr.stats.last.records_offloaded_nvme == 181 - 128
        loss.backward()
        assert torch.equal(model.w.grad, want)
        assert mgr._executor.cpu_bytes == host.used_bytes == 0


class _TwoSins(nn.Module):
    """Saves ``a + w`` then ``b + w`` (one record each, of ``a``'s and ``b``'s bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sin(a + self.w).sum() + torch.sin(b + self.w).sum()


def test_a_cpu_budget_of_no_power_of_two_holds_a_small_then_a_large_record(monkeypatch) -> None:
    """cpu_budget=3MiB, host tier only, a step saving 1 MiB then 2 MiB: the budget has room for
    both, but the pool (slabs are powers of two: 2 + 1 MiB) gave the 1 MiB record the 2 MiB slab
    and refused the 2 MiB one, so the step raised StorageFullError with 1 MiB of the budget
    never used. Now both are stored (3 MiB), gradients are exact, and the second step
    allocates nothing."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    model, a, b = _TwoSins(), torch.randn(1 << 18), torch.randn(1 << 19)
    model(a, b).backward()
    want = model.w.grad.clone()
    with manager(model, tiers=("cpu",), cpu_budget="3MiB") as mgr:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mgr:
                loss = model(a, b)
            loss.backward()
            assert torch.equal(model.w.grad, want)
            assert mgr.stats.last.bytes_offloaded_cpu == 3 << 20
            assert mgr.stats.last.records_offloaded_cpu == 2
        assert mgr.stats.last.host_allocations == 0
        assert mgr._executor.cpu_bytes == 0


def test_a_step_whose_nvme_tier_cannot_be_made_gives_its_pool_claim_back(
    tmp_path, monkeypatch
) -> None:
    """nvme_dir removed after the manager was made: each step fails building its tiers. The
    host tier made before it and the claim on the shared pool are given back (each failed step
    raised the pool's cap by its staging room and kept a claim until close()); once the
    directory is back, a step runs and its gradients are exact."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    want = reference_grads("mlp")
    case = mlp(seed=0)
    spill = tmp_path / "spill"
    spill.mkdir()
    # Another user of the pool (a second pipeline stage, say) holds a claim throughout.
    other = storage.claim_shared_host_pool(1 << 20, pin_memory=False)
    pool, claims = other.pool, storage._pool._shared_claims
    cap = pool.capacity_bytes
    with manager(case.model, tiers=("cpu", "nvme"), nvme_dir=spill, cpu_budget="4MiB") as mgr:
        spill.rmdir()
        for _ in range(3):
            with pytest.raises(ValueError, match="does not exist"):
                offloaded_step(case, mgr)
            assert claims[pool] == [other]
            assert pool.capacity_bytes == cap
        assert mgr._executor is None and mgr._resources == []
        spill.mkdir()
        assert_bitwise(offloaded_step(case, mgr), want)
        assert len(claims[pool]) == 2
    assert claims[pool] == [other] and pool.capacity_bytes == cap
    other.close()


@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",)])
def test_a_prefetch_without_memory_leaves_the_family_for_its_unpack(
    tiers, tmp_path, monkeypatch
) -> None:
    """A look-ahead reload whose buffer cannot be allocated (a device OOM) used to leave its
    family half-started (a later unpack could return an unfilled buffer); now the prefetch
    gives up, and the unpack reloads it (a stall), bitwise."""
    import sys

    import offload._reload as reload_module

    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    real = reload_module.aligned_buffer
    refused = []

    def short_for_prefetches(*args: Any, **kw: Any) -> Any:
        if sys._getframe(2).f_code.co_name == "begin_reload":  # fault injection: prefetch only
            refused.append(args[0])
            raise torch.OutOfMemoryError("injected: no memory for a prefetch")
        return real(*args, **kw)

    monkeypatch.setattr(reload_module, "aligned_buffer", short_for_prefetches)
    with manager(case.model, tiers=tiers, **nvme_kw(tiers, tmp_path)) as mgr:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(0))
        settle(mgr)  # backward reloads (a family still being written is served its source)
        loss.backward()
        del loss
        got = case.grads()
        last = mgr.stats.last
        assert refused and last.stalls == last.reloads > 0
        assert mgr._executor._ahead_bytes == 0
        assert_bitwise(got, want)
        assert_nothing_live(mgr)


def test_a_reload_that_failed_to_start_is_not_reused_on_retry(monkeypatch) -> None:
    """A reload whose read failed to start left its family pointing at the new, unfilled
    buffer (kept alive by the kept error's traceback): a retried backward reused it as a
    finished reload, a wrong gradient (off by 131). The retry reads the bytes again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(512, 64)
    model(x).square().sum().backward()
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    host = faults.install(monkeypatch, "cpu")["cpu"]
    error = storage.StorageError("injected: the read failed to start")
    host.fail("read", error, at="submit", calls={0})  # the first read fails to start
    with manager(model) as mgr:
        with mgr:
            loss = model(x).square().sum()
        with pytest.raises(offload.StorageError) as kept:  # the error is kept, as loggers do
            loss.backward(retain_graph=True)
        assert host.injected == 1
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert_bitwise(local_grads(model), want)
        del kept, loss


def hand_executor(nvme: storage.NvmeTier, pool: storage.HostPool) -> Any:
    """An executor on CPU over one NVMe tier, for driving its GPU + NVMe queue by hand."""
    from offload._executor import Executor

    return Executor(
        device=torch.device("cpu"),
        tiers=[nvme],
        cpu_budget_bytes=0,
        max_inflight_bytes=0,
        prefetch_bytes=0,
        pool=pool,
        staging_bytes=1 << 20,
    )


def assert_write_queue_drains(ex: Any, pool: storage.HostPool, nvme: storage.NvmeTier) -> None:
    """Once its one queued write ended, a poll empties the queue and gives every byte back."""
    ex._writing[0][1].wait()
    ex.poll()
    assert not ex._writing and ex._writing_bytes == 0
    assert pool.used_bytes == 0 and nvme.used_bytes == 0


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
        device=torch.device("cpu"),
        module="m",
        order=0,
    )


def test_a_family_freed_while_its_nvme_write_is_queued_keeps_the_queue_sound(tmp_path) -> None:
    """The GPU + NVMe queue of file writes (pinned copies awaiting their write), driven by hand
    on CPU, where it is not used otherwise: a family freed while queued (its members died, or
    its step failed) no longer breaks every later poll, and its pinned copy goes back once its
    write is done."""
    from offload import _release

    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    nvme = storage.NvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool)
    ex = hand_executor(nvme, pool)
    try:
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        region = pool.allocate(4096)
        fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
        fam.to(Life.COPYING_OUT)
        fam.to(Life.OFF_DEVICE)
        ex._writing.append((fam, fam.handle))  # as _retire queues it on CUDA
        ex._writing_bytes += 4096
        _release.free(ex, fam)  # before the queue was polled
        assert fam.handle is None and fam.life is Life.FREED
        assert_write_queue_drains(ex, pool, nvme)
    finally:
        ex.close()
        nvme.close()
        pool.close()


def test_a_family_released_while_its_nvme_write_runs_joins_the_write_queue(tmp_path) -> None:
    """GPU + NVMe, driven by hand on CPU: a family whose members died before its copy out was
    retired (backward ran ahead of the disk) waited unqueued for its file write, holding its
    device source and pinned copy, counted by neither the in-flight nor the staging bound. It
    now joins the queue of file writes: the staging bound counts it, its device source can go
    once D completed, and its pinned copy goes back when the write ends."""
    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    nvme = storage.NvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool, copy_engine=engine)
    ex = hand_executor(nvme, pool)
    try:
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        with engine.paused():  # the disk is behind
            region = pool.allocate(4096)
            fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
            fam.source, fam.members = data, 1
            fam.to(Life.COPYING_OUT)
            ex._inflight.append(fam)  # as _store leaves it
            ex._inflight_bytes += 4096
            ex.release(fam)  # its last member died before a poll retired the copy out
            assert fam.life is Life.FREED and fam.source is None
            assert [f for f, _ in ex._writing] == [fam] and ex._writing_bytes == 4096
            assert ex._inflight_bytes == 0 and pool.used_bytes == 4096  # the write reads it
        assert_write_queue_drains(ex, pool, nvme)
    finally:
        ex.close()
        nvme.close()
        engine.close()
        pool.close()


def test_writes_of_freed_families_count_toward_the_in_flight_bound() -> None:
    """Backward ran ahead of a slow tier: its families were freed while their writes still ran
    (reading their sources). Those writes count toward ``max_inflight_bytes`` until they end, so
    the next step waits for them; uncounted, they piled up without bound (a 1000-step soak with
    slow I/O grew by 150 MiB)."""
    case = mlp(seed=0)
    want = [reference_grads("mlp", s) for s in range(2)]
    with manager(case.model) as probe:
        with probe:
            loss = case.loss(case.batch(0))
        loss.backward()  # as below: the loss's target is stored at the step's exit
        step_bytes = probe.stats.last.bytes_offloaded_cpu
    assert step_bytes > 0
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, _copy_engine=engine, max_inflight_bytes=step_bytes
    )
    paused, waited, finished = threading.Event(), threading.Event(), threading.Event()

    def hold_the_writes() -> None:
        # Every copy waits until step 2 waits on step 1's writes; with no such wait (the bug),
        # until step 2 has finished (30 s at most, so that nothing can hang the suite).
        with engine.paused():
            paused.set()
            deadline = time.monotonic() + 30
            while not finished.is_set() and time.monotonic() < deadline:
                ex = mgr._executor  # made by the first step
                step = ex.step if ex is not None else None
                if step is not None and step.index == 2 and step.stats.backpressure_waits > 0:
                    waited.set()
                    break
                time.sleep(0.001)

    holder = threading.Thread(target=hold_the_writes)
    holder.start()
    try:
        paused.wait()
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(0))
        loss.backward()  # from the sources: no write has run
        assert_bitwise(case.grads(), want[0])
        ex = mgr._executor
        assert ex.live_families() == 0 and ex._orphan_bytes == step_bytes
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        finished.set()
        holder.join()
        loss.backward()
        assert_bitwise(case.grads(), want[1])
        assert waited.is_set() and mgr.stats.last.backpressure_waits > 0
        assert ex._inflight_bytes + ex._orphan_bytes <= step_bytes
    finally:
        finished.set()
        holder.join()
        mgr.close()
        engine.close()


def test_a_manager_finalized_on_an_io_thread_closes_from_a_thread_of_its_own(tmp_path) -> None:
    """A GC pass on an NVMe I/O thread, in the middle of a write, may finalize a dropped
    manager: closing waited for that very write (a deadlock). Now the finalizer hands the
    closing to a thread of its own, and everything is released."""
    case = gpt_block(seed=0)
    mgr = offload.ActivationOffloader(
        case.model, min_offload_bytes=0, tiers=("nvme",), nvme_dir=tmp_path
    )
    go, finalized, errors, calls = threading.Event(), threading.Event(), [], []
    with mgr:
        nvme = mgr._tiers[0]
        private, real = nvme.private_directory, nvme._file.write

        def write_then_finalize(*args: Any, **kw: Any) -> None:
            go.wait(10)  # once the step has ended (no pack runs after a real finalizer)
            real(*args, **kw)
            if not calls:
                calls.append(threading.current_thread().name)
                try:
                    mgr._finalizer()  # what a GC pass here runs for a dropped manager
                except BaseException as e:
                    errors.append(e)
                finalized.set()

        nvme._file.write = write_then_finalize
        loss = case.loss(case.batch())
    go.set()
    assert finalized.wait(10) and calls[0].startswith("storage-io")
    for t in threading.enumerate():
        if t.name == "storage-close":
            t.join(10)
    assert errors == []
    assert not os.path.exists(private)
    assert mgr._executor.live_families() == 0 and mgr._executor.cpu_bytes == 0
    with pytest.raises(offload.OffloadError, match="closed"):
        loss.backward()
    mgr.close()


def test_late_nvme_write_failure_falls_back_to_host_and_balances(tmp_path, monkeypatch) -> None:
    """An I/O error after pack returned: the record goes to the next tier from the held source;
    the host-tier accounting must come back to zero once the graph is gone."""
    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, tiers=("nvme", "cpu"), nvme_dir=tmp_path) as mgr:
        with mgr:
            nvme.fail("write", OSError(5, os.strerror(5)))  # every write, once it ran
            loss = case.loss(case.batch())
        # The failures surface when the I/O thread runs the writes: wait for them (an unsettled
        # check raced that thread, and failed under load).
        for fam in mgr._executor.step.families:
            if fam.handle is not None:
                with contextlib.suppress(storage.StorageError):
                    fam.handle.wait()
        mgr._executor.poll()
        assert mgr.stats.last.fallbacks > 0 and nvme.injected > 0
        assert mgr._executor.cpu_bytes > 0
        case.model.zero_grad(set_to_none=True)
        loss.backward()
        assert_bitwise(case.grads(), want)
        # Counted where the bytes went: the host tier.
        last = mgr.stats.last
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        assert last.bytes_offloaded_cpu > 0 and last.records_offloaded_cpu > 0
        del loss
        gc.collect()
        assert_nothing_live(mgr)


@pytest.mark.parametrize("tiers", [("nvme",), ("nvme", "cpu")])
@pytest.mark.parametrize("engine", ENGINES)
def test_nvme_writes_that_fail_late_are_not_counted_as_nvme_bytes(
    engine: str, tiers, tmp_path, monkeypatch
) -> None:
    """Every file write fails (EIO), each only once a gate opens: the NVMe bytes of a record
    count only if its write succeeded. Step 1: backward uses the sources still held and releases
    the records while their writes run; they fail after. Steps 2 and 3: two forwards, then the
    writes fail during step 3, and step 2's records go to the next tier (or stay) after step 2
    was added to the totals. A failed record counted as NVMe bytes (in ``last`` of step 1, or
    in the totals for step 2) whenever its failure came after its release or its step."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=tiers, nvme_dir=tmp_path) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        drain(mgr)
        mgr._executor.poll()
        stored = mgr.stats.last.bytes_offloaded_nvme
        assert stored > 0
        gate = threading.Event()
        nvme.fail("write", OSError(5, os.strerror(5)), gate=gate)

        def fail_the_writes() -> None:
            gate.set()
            drain(mgr)
            mgr._executor.poll()
            gate.clear()

        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        loss.backward()
        assert_bitwise(case.grads(), want[1])
        del loss
        fail_the_writes()
        assert_nothing_live(mgr)
        last = mgr.stats.last
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        assert last.bytes_offloaded_cpu == 0  # released before they failed: nothing to move
        before = mgr.stats.total

        losses = []
        for s in (2, 3):
            with mgr:
                losses.append(case.loss(case.batch(s)))
        fail_the_writes()
        for s, loss in zip((2, 3), losses, strict=True):
            case.model.zero_grad(set_to_none=True)
            loss.backward()
            assert_bitwise(case.grads(), want[s])
        del loss, losses
        gc.collect()
        assert_nothing_live(mgr)
        total = mgr.stats.total
        assert nvme.injected > 0
        assert total.bytes_offloaded_nvme == before.bytes_offloaded_nvme == stored
        assert total.records_offloaded_nvme == before.records_offloaded_nvme
        moved = total.bytes_offloaded_cpu - before.bytes_offloaded_cpu
        assert moved == (2 * stored if "cpu" in tiers else 0)


@pytest.mark.parametrize("read", ["after_backward", "before_backward"])
@pytest.mark.parametrize("tiers", [("nvme",), ("nvme", "cpu")])
@pytest.mark.parametrize("engine", ENGINES)
def test_stats_are_final_when_read_while_nvme_writes_still_run(
    engine: str, tiers, read: str, tmp_path, monkeypatch
) -> None:
    """``mgr.stats`` read while the step's NVMe writes still run (each fails with EIO, only
    after the read began): the read waits for them, so the numbers are final. Before, a read
    right after backward showed the step's 12 records (397312 bytes) as stored on NVMe, and
    kept showing them (nothing accounted for the failures until the next step, whose totals
    then dropped them). ``before_backward``: the records still live go to the host tier (or
    stay) and count as fallbacks in the step that packed them; gradients stay exact."""
    want = [reference_grads("gpt_block", s) for s in range(2)]
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=tiers, nvme_dir=tmp_path) as mgr:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])
        step0 = mgr.stats.last
        assert step0.bytes_offloaded_nvme > 0 and step0.fallbacks == 0
        gate = threading.Event()  # each write fails (EIO) once it opens: late, after pack
        nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)), gate=gate)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        if read == "after_backward":
            loss.backward()
            assert_bitwise(case.grads(), want[1])
        opener = threading.Timer(0.05, gate.set)  # the writes fail while stats waits for them
        opener.start()
        last = mgr.stats.last
        opener.join()
        assert last.bytes_offloaded_nvme == last.records_offloaded_nvme == 0
        if read == "after_backward":
            # Released before they failed: no tier takes them, nothing falls back.
            assert last.bytes_offloaded_cpu == last.records_offloaded_cpu == last.fallbacks == 0
        else:
            assert last.fallbacks == step0.records_offloaded_nvme
            moved = step0.bytes_offloaded_nvme if "cpu" in tiers else 0
            assert last.bytes_offloaded_cpu == moved
            loss.backward()
            assert_bitwise(case.grads(), want[1])
        del loss
        gc.collect()
        moved_fields = ("bytes_offloaded_nvme", "records_offloaded_nvme", "bytes_offloaded_cpu",
                        "records_offloaded_cpu", "fallbacks")  # fmt: skip
        again = mgr.stats.last  # and they stay so (backward, if it ran since, adds reloads)
        assert [getattr(again, f) for f in moved_fields] == [getattr(last, f) for f in moved_fields]
        assert_nothing_live(mgr)
        total = mgr.stats.total
        assert nvme.injected > 0
        assert total.bytes_offloaded_nvme == step0.bytes_offloaded_nvme
        assert total.bytes_offloaded_cpu == last.bytes_offloaded_cpu
        assert total.fallbacks == last.fallbacks


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_writes_that_fail_at_close_leave_the_totals_right(
    engine: str, backward: bool, tmp_path, monkeypatch
) -> None:
    """The last step's NVMe writes fail (EIO) only while ``close()`` waits for them. Its
    records were released by backward first (``backward``), or die with the closed manager:
    either way they stored nothing. Before, with backward first, ``stats.total`` after close
    still counted them: 24 records (794624 bytes) on NVMe where step 0's 12 (397312) were."""
    case = gpt_block(seed=0)
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(case.model, engine, tiers=("nvme", "cpu"), nvme_dir=tmp_path) as mgr:
        offloaded_step(case, mgr, 0)
        step0 = mgr.stats.last
        assert step0.bytes_offloaded_nvme > 0
        gate = threading.Event()  # each write fails (EIO) once it opens: late, after pack
        nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)), gate=gate)
        with mgr:
            loss = case.loss(case.batch(1))
        if backward:
            loss.backward()
            del loss
        opener = threading.Timer(0.05, gate.set)
        opener.start()
        mgr.close()
        opener.join()
        total = mgr.stats.total
        assert total.steps == 2 and nvme.injected > 0
        assert total.bytes_offloaded_nvme == step0.bytes_offloaded_nvme
        assert total.records_offloaded_nvme == step0.records_offloaded_nvme
        assert total.bytes_offloaded_cpu == total.records_offloaded_cpu == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_full_disk_is_logged_once_per_tier_and_counted_in_fallbacks(
    engine: str, tmp_path, monkeypatch, caplog
) -> None:
    """Every NVMe write fails with ENOSPC after pack returned; the host tier (64 KiB) takes
    some of the records and the others stay on the device. Each record that stayed was a
    warning (24 in these 4 steps); now the first failure is one warning that says where later
    ones are counted (``fallbacks``), and the rest go to the debug level. Gradients stay exact."""
    want = [reference_grads("gpt_block", s) for s in range(4)]
    case = gpt_block(seed=0)
    caplog.set_level(logging.DEBUG, logger="offload")
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(
        case.model, engine, tiers=("nvme", "cpu"), nvme_dir=tmp_path, cpu_budget="64KiB"
    ) as mgr:
        for s in range(4):
            case.model.zero_grad(set_to_none=True)
            with mgr:
                if s == 0:
                    nvme.fail("write", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
                loss = case.loss(case.batch(s))
            # Every failure is seen while its record lives (one seen after backward released
            # the record is no fallback, and says nothing).
            drain(mgr)
            mgr._executor.poll()
            loss.backward()
            assert_bitwise(case.grads(), want[s])
            del loss
        failed = [r for r in caplog.records if "No space left on device" in r.getMessage()]
        warned = [r for r in failed if r.levelno == logging.WARNING]
        assert len(warned) == 1
        assert "to the nvme tier failed" in warned[0].getMessage()
        assert "counted in stats.fallbacks" in warned[0].getMessage()
        assert len(failed) == mgr.stats.total.fallbacks > 4  # the others at the debug level
        assert nvme.injected >= len(failed)
        gc.collect()
        assert_nothing_live(mgr)


def test_spill_to_nvme_when_the_pool_is_as_big_as_cpu_budget(tmp_path, monkeypatch) -> None:
    """The first manager of a process sizes the shared pool at its ``cpu_budget``."""
    budget = 64 << 10
    pools: list[storage.HostPool] = []

    def private_pool(capacity_bytes: int | None = None, **kw: Any) -> storage.HostPool:
        pools.append(storage.HostPool(capacity_bytes or budget, slab_bytes=budget))
        return pools[-1]

    monkeypatch.setattr(storage, "shared_host_pool", private_pool)
    want = reference_grads("gpt_block")
    case = gpt_block(seed=0)
    try:
        with manager(
            case.model, tiers=("cpu", "nvme"), nvme_dir=tmp_path, cpu_budget=budget
        ) as mgr:
            assert_bitwise(offloaded_step(case, mgr), want)
            assert mgr.stats.last.bytes_offloaded_nvme > 0
    finally:
        for pool in pools:
            pool.close()


def test_sibling_views_share_one_copy_of_their_storage() -> None:
    """q, k and v of one qkv projection: none contains the others, one copy serves all three."""
    qkv = nn.Linear(64, 3 * 64)
    x = torch.randn(32, 64)

    def grads(mgr) -> list[torch.Tensor]:
        qkv.zero_grad(set_to_none=True)
        ctx = mgr if mgr is not None else contextlib.nullcontext()
        with ctx:
            q, k, v = qkv(x).chunk(3, dim=-1)
            loss = ((q @ k.t()).softmax(-1) @ v).sum()
        loss.backward()
        return [p.grad.clone() for p in qkv.parameters()]

    want = grads(None)
    with manager(qkv) as mgr:
        got = grads(mgr)
        last = mgr.stats.last
        # Saved: the Linear's input x; q, k.t() and v (one qkv storage); the softmax output
        # (saved by softmax and by the last matmul): three families, each stored once.
        assert last.records_offloaded_cpu == 3
        assert last.records_deduplicated == 3
        assert last.bytes_offloaded_cpu == 32 * 64 * 4 + 32 * 3 * 64 * 4 + 32 * 32 * 4
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _autocast_mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)
    )
    return model, torch.randn(64, 128, requires_grad=True)


def _autocast_step(model: torch.nn.Module, x: torch.Tensor, mgr: Any = None) -> list[torch.Tensor]:
    return _grads(model, x, mgr, amp=torch.autocast("cpu", dtype=torch.bfloat16))


def test_autocast_weight_casts_are_rebuilt_not_stored() -> None:
    """docs/design.md: autocast's weight casts never cross PCIe; they are cast again at unpack (NOTE
    [ Weight casts ]), bitwise, and hold no memory between forward and backward."""
    from offload._live import LiveBytes

    model, x = _autocast_mlp()
    want = _autocast_step(model, x)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    got = _autocast_step(model, x, mgr)
    last = mgr.stats.last
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    casts = 2 * 128 * 256 * 2  # both Linear weights in bf16, saved as views of their casts
    gelu_out = 64 * 256 * 2  # rebuilt from the GELU input too (NOTE [ Activation recipes ])
    # x's bf16 cast, the GELU input (bf16), and pow's fp32 input.
    activations = 64 * (128 + 256) * 2 + 64 * 128 * 4
    assert (last.records_rebuilt, last.bytes_rebuilt) == (3, casts + gelu_out)
    assert last.bytes_offloaded_cpu == activations, (last.bytes_offloaded_cpu, casts)
    # Between forward and backward nothing of the casts is alive (kept, they were 128 KiB).
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with mgr:
                loss = model(x).float().pow(2).sum()
        torch.zeros(1)  # the counter settles frees at its next op
        between = live.live
        loss.backward()
    mgr.close()
    assert between < casts // 2, between


def test_parameter_changed_before_backward_fails_loudly() -> None:
    """A rebuilt cast of a parameter changed in place since forward would be another cast: the
    unpack raises instead of returning it."""
    model, x = _autocast_mlp()
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with mgr:
            loss = model(x).float().pow(2).sum()
    with torch.no_grad():
        model[2].weight.mul_(0.5)  # an optimizer step before the backward
    with pytest.raises(offload.OffloadError, match="changed in place"):
        loss.backward()
    mgr.close()


def test_planned_steps_leave_weight_casts_out_of_the_plan() -> None:
    """Budget mode profiles the casts as parameters: no plan entry places them, every planned
    step rebuilds them, and gradients stay bitwise. (The profiling step rebuilds the GELU
    output too, as min-memory mode does; this plan, with room, stores it.)"""
    model, x = _autocast_mlp()
    want = _autocast_step(model, x)
    hw = offload.HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, gpu_budget="200KiB", hardware=hw)
    for rebuilt in (3, 2, 2):
        got = _autocast_step(model, x, mgr)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert mgr.stats.last.records_rebuilt == rebuilt
    plan = mgr.plan
    assert plan is not None and mgr.stats.last.unplanned_records == 0
    # The plan holds the activations only: 64 x (128 + 256 + 256) bf16 + 64 x 128 fp32 bytes.
    assert sum(plan.bytes_by_placement().values()) == 64 * (128 + 256 + 256) * 2 + 64 * 128 * 4
    mgr.close()


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


def _act_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.SiLU(),
        nn.Linear(64, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 8),
    )  # fmt: skip


@pytest.mark.parametrize("how", ["cpu", "nvme", "deferred", "retain_graph"], ids=lambda s: s)
def test_activation_outputs_are_rebuilt_from_their_inputs(how: str, tmp_path) -> None:
    """NOTE [ Activation recipes ]: in min-memory mode a GELU / SiLU output saved by the next
    Linear is not stored: rebuilt at unpack from the activation's input (offloaded once for
    both), bitwise, on every tier and copy engine, and again for a second backward."""
    from offload.storage import CopyEngine

    model = _act_mlp()
    x = torch.randn(4, 32, 64)  # 3-D: each Linear saves a 2-D view of its input

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        return _grads(model, x, mgr, twice=how == "retain_graph")

    want = grads(None)
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if how == "nvme":
        kw.update(tiers=("nvme",), nvme_dir=tmp_path)
    if how == "deferred":
        kw["_copy_engine"] = CopyEngine(deferred=True, max_delay_s=0.002, seed=3)
    mgr = offload.ActivationOffloader(model, **kw)
    try:
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(grads(mgr), want, strict=True))
            last = mgr.stats.last
            # Two GELU outputs and one SiLU output, 128 rows each: 256 + 64 + 64 floats wide.
            assert (last.records_rebuilt, last.bytes_rebuilt) == (3, 128 * (256 + 64 + 64) * 4)
            # Stored: the input x, the three activations' inputs, pow's input (all float32).
            stored = 128 * (64 + 256 + 64 + 64 + 8) * 4
            assert last.bytes_offloaded_cpu + last.bytes_offloaded_nvme == stored
            # A rebuild does not wait on its input's reload: the module saving the output starts
            # it. The one stall per backward is pow's input, unpacked first with nothing before
            # it (the second backward's too: the window no longer holds it between the two).
            assert last.stalls <= (2 if how == "retain_graph" else 1), last
        assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()
        if "_copy_engine" in kw:
            kw["_copy_engine"].close()


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


@pytest.mark.parametrize("how", ["cpu", "nvme", "retain_graph", "autocast"], ids=lambda s: s)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "rms_norm_composite"])
def test_norm_outputs_are_rebuilt_with_their_modules_arguments(
    kind: str, how: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """NOTE [ Activation recipes ]: an ``nn.LayerNorm``'s or ``nn.RMSNorm``'s output saved by
    the next Linear is rebuilt at unpack from the input its node saved, with the module's eps,
    weight and bias (noted by its forward hook: the node does not save eps), bitwise; under
    autocast, the bf16 cast of it that the Linear saves is rebuilt and cast again. A subclass's
    or a functional call's output is stored. ``rms_norm`` runs RMSNorm as CUDA does, through
    ``_fused_rms_norm`` (the ``fused_rms_norm`` fixture); ``rms_norm_composite`` as CPU torch
    does, a chain of elementwise nodes, whose outputs are stored (still bitwise)."""
    if kind == "rms_norm":
        request.getfixturevalue("fused_rms_norm")
    model = _NormNet("layer_norm" if kind == "layer_norm" else "rms_norm")
    x = torch.randn(4, 32, 64)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast")

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        return _grads(model, x, mgr, amp=amp, twice=how == "retain_graph")

    want = grads(None)
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if how == "nvme":
        kw.update(tiers=("nvme",), nvme_dir=tmp_path)
    mgr = offload.ActivationOffloader(model, **kw)
    norms = 0 if kind == "rms_norm_composite" else 3
    try:
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(grads(mgr), want, strict=True))
            last = mgr.stats.last
            if how == "autocast":
                # The Linears save bf16 casts of the float32 norm outputs: three rebuilt (and
                # cast), besides the five Linear weights' casts (NOTE [ Weight casts ]).
                casts = 5 * 64 * 64 * 2
                want_rebuilt = (5 + norms, casts + norms * 128 * 64 * 2)
            else:
                want_rebuilt = (norms, norms * 128 * 64 * 4)
            assert (last.records_rebuilt, last.bytes_rebuilt) == want_rebuilt
            assert last.records_offloaded_cpu + last.records_offloaded_nvme > 0
            assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()


class _QKV(nn.Module):
    """One LayerNorm output saved three times, by separate q, k and v projections."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "retain_graph"])
def test_an_output_saved_by_several_ops_is_rebuilt_once_per_backward(
    twice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Activation recipes ]: the three packs of one LayerNorm output share one rebuild:
    the first unpack of a backward runs it, the other two reuse it (bitwise), and its bytes
    count once."""
    from offload._recipe import ActivationRecipe

    model, x = _QKV(), torch.randn(4, 32, 64)
    want = _grads(model, x, twice=twice)
    runs = []
    rebuild = ActivationRecipe.rebuild

    def counted(self: ActivationRecipe, parent: torch.Tensor) -> torch.Tensor:
        runs.append(self.kind)
        return rebuild(self, parent)

    monkeypatch.setattr(ActivationRecipe, "rebuild", counted)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    try:
        for _ in range(2):
            runs.clear()
            got = _grads(model, x, mgr, twice=twice)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            last = mgr.stats.last
            assert (last.records_rebuilt, last.bytes_rebuilt) == (3, 128 * 64 * 4)
            assert runs == ["layer_norm"] * (2 if twice else 1)
            assert mgr._executor is not None and mgr._executor.live_families() == 0
    finally:
        mgr.close()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_weight_changed_before_backward_fails_loudly(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A norm output rebuilt with a weight changed in place since forward would be another
    output: the unpack raises instead of returning it."""
    if kind == "rms_norm":
        request.getfixturevalue("fused_rms_norm")
    model = _NormNet(kind)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    with mgr:
        loss = model(torch.randn(4, 32, 64)).pow(2).sum()
    with torch.no_grad():
        model.norms[0].weight.mul_(0.5)  # an optimizer step before the backward
    name = "LayerNorm" if kind == "layer_norm" else "RMSNorm"
    with pytest.raises(offload.OffloadError, match=f"weight or bias of a {name} over"):
        loss.backward()
    mgr.close()


def test_budget_mode_rebuilds_activation_outputs_as_planned() -> None:
    """Under a budget the plan decides (NOTE [ Rebuilt outputs ] in lifecycle/_planner.py): with
    room for everything the outputs are stored; on a tight budget with dear copies the plan
    rebuilds them, and every planned step rebuilds exactly the plan's records, none unplanned."""
    model = _act_mlp()
    x = torch.randn(4, 32, 64)
    hw = offload.HardwareModel.cpu_only(
        copy_bytes_per_s=5e8, disk_write_bytes_per_s=1e8, disk_read_bytes_per_s=1e8
    )
    rebuilt_by_budget = {}
    for budget in ("1MiB", "400KiB"):
        mgr = offload.ActivationOffloader(
            model, gpu_budget=budget, hardware=hw, min_offload_bytes=0
        )
        for step in range(4):
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
            if step >= 1:  # planned steps
                plan = mgr.plan
                keys = [e.keys for e in plan.entries if e.placement is lifecycle.Placement.REBUILD]
                assert mgr.stats.last.records_rebuilt == sum(map(len, keys))
                assert mgr.stats.last.unplanned_records == 0
        rebuilt_by_budget[budget] = mgr.stats.last.records_rebuilt
        mgr.close()
    assert rebuilt_by_budget["1MiB"] == 0 and rebuilt_by_budget["400KiB"] == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_calls_a_checkpoint_recomputation_leaves_unfinished_end_with_its_backward(engine: str):
    """Non-reentrant checkpoint stops recomputing once backward has what it needs, so the
    recomputed calls' forward hooks never come. Their stack entries stayed, and a second
    forward in the same ``with mgr:`` block ran under them: kept whole under a kept module
    (0 bytes offloaded by the second forward and backward, 24,576 by the first). Now the end of
    the backward drops them; both pairs offload alike, gradients bitwise."""
    from models import Checkpointed

    def two_pairs(model: nn.Module, x: torch.Tensor, mgr: Any | None) -> list[int]:
        moved: list[int] = []
        for _ in range(2):
            model(x).pow(2).sum().backward()
            if mgr is not None:
                assert mgr._step.calls.frames == []
                moved.append(mgr.stats.last.bytes_offloaded_cpu - sum(moved))
        return moved

    torch.manual_seed(0)
    model = Checkpointed(checkpointed=(0, 1, 2))
    x = torch.randn(32, 64, requires_grad=True)
    two_pairs(model, x, None)
    want = local_grads(model)
    model.zero_grad(set_to_none=True)
    with manager(model, engine, min_offload_bytes=0, keep=["blocks.0"]) as mgr:
        with mgr:
            moved = two_pairs(model, x, mgr)
        assert moved[0] > 0 and moved[1] == moved[0], moved
        assert_bitwise(local_grads(model), want)


class _SanitizerWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """The addresses each op writes, read from its schema as torch's CUDA sanitizer reads them
    (``ArgumentHandler`` in torch/cuda/_sanitizer.py): a mutable argument (``Tensor(a!)``), and a
    return of a non-factory op that is not a read-only alias. The sanitizer checks CUDA tensors
    only; this sees CPU ones, so its rule can be checked here."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.cuda._sanitizer import FACTORY_FUNCTION_REGEX

        schema = func._schema
        for arg, value in zip(schema.arguments, args, strict=False):
            mutable = arg.alias_info is not None and arg.alias_info.is_write
            if mutable and isinstance(value, torch.Tensor):
                self.writes.append((str(func), value.data_ptr()))
        out = func(*args, **(kwargs or {}))
        if not FACTORY_FUNCTION_REGEX.match(schema.name):
            ret = schema.returns[0] if schema.returns else None
            written = ret is not None and (ret.alias_info is None or ret.alias_info.is_write)
            if written and isinstance(out, torch.Tensor):
                self.writes.append((str(func), out.data_ptr()))
        return out


def test_unpack_of_a_record_still_copying_out_writes_nothing_the_copy_reads() -> None:
    """While a record's copy out is in flight, unpack hands back a view of the source the copy
    reads (NOTE [ Stream ordering ] rule 3). It builds that view from views only: an op the CUDA
    sanitizer counts as a write to those bytes (``set_``, whose return is ``Tensor(a!)``) on the
    compute stream, against the D2H stream's unfinished read, is reported as a data race."""
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, _copy_engine=engine)
    try:
        with engine.paused():
            with mgr:
                out = model(torch.randn(32, 64))
            (fam,) = [
                f for f in mgr._executor.step.families if f.storage_ref() is out.untyped_storage()
            ]
            assert fam.life is Life.COPYING_OUT and fam.source is not None
            first, last = fam.source.data_ptr(), fam.source.data_ptr() + fam.nbytes
            with _SanitizerWrites() as seen:
                saved = out.grad_fn._saved_result  # tanh's output: unpacked from its source
            assert fam.life is Life.COPYING_OUT
        assert torch.equal(saved, out)
        assert [(op, p) for op, p in seen.writes if first <= p < last] == []
        del out, saved
    finally:
        mgr.close()
        engine.close()


def test_a_second_family_of_a_storage_writes_nothing_the_first_copy_reads() -> None:
    """Two slices of one storage, each under a quarter of it, are two families. The second is
    packed while the first's copy out still reads the storage: building its byte view must
    issue no op the CUDA sanitizer counts as a write there (``set_``'s ``Tensor(a!)`` return on
    the compute stream, against the D2H stream's unfinished read, is reported as a data race)."""
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    torch.manual_seed(0)
    x = torch.randn(1024, 64, requires_grad=True)
    mgr = offload.ActivationOffloader(nn.Linear(4, 4), min_offload_bytes=0, _copy_engine=engine)
    try:
        with engine.paused():
            with mgr:
                h = x * 2  # saves nothing of x: a scalar product
                a = h[:64].sin()  # saves h[:64]: the first family, from byte 0 of h's storage
                (fam,) = mgr._executor.step.families
                assert fam.life is Life.COPYING_OUT and fam.source is not None
                first, last = fam.source.data_ptr(), fam.source.data_ptr() + fam.nbytes
                with _SanitizerWrites() as seen:
                    b = h[64:128].sin()  # a second family of the same storage
                assert len(mgr._executor.step.families) == 2
                assert fam.life is Life.COPYING_OUT
        assert [(op, p) for op, p in seen.writes if first <= p < last] == []
        (a.sum() + b.sum()).backward()
        got = x.grad
        x.grad = None
        h = x * 2
        (h[:64].sin().sum() + h[64:128].sin().sum()).backward()
        assert torch.equal(got, x.grad)
        del a, b, h
    finally:
        mgr.close()
        engine.close()


_LAYOUT_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.complex32,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_storage_bytes_is_every_byte_of_the_storage_for_any_layout() -> None:
    """``storage_bytes`` is the old ``torch.empty(0, dtype=uint8).set_(storage)`` (same address,
    length, bytes and storage) for any dtype, conjugate or negative view, storage offset, shape
    and stride, odd storage lengths included, built from views alone: no op the CUDA sanitizer
    counts as a write (torch/cuda/_sanitizer.py, ArgumentHandler)."""
    from offload._family import storage_bytes

    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> int:
        return int(torch.randint(0, n, (), generator=g))

    kinds: set[tuple[str, bool, bool]] = set()
    for _ in range(600):
        dtype = _LAYOUT_DTYPES[rand(len(_LAYOUT_DTYPES))]
        item = dtype.itemsize
        nbytes = rand(200) if rand(8) else 0  # odd lengths too: a byte storage viewed as dtype
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        st = raw.untyped_storage()
        room = nbytes // item
        dims = rand(4)
        size = [rand(4) + 1 for _ in range(dims)]
        stride = [rand(5) for _ in range(dims)]
        extent = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if extent > room:  # nothing fits: an empty tensor at any offset within the storage
            size, stride, extent = [0, *size[1:]] if dims else [0], [1] * max(dims, 1), 0
        offset = rand(room - extent + 1)
        t = torch.empty(0, dtype=dtype).set_(st, offset, size, stride)
        if dtype.is_complex and rand(2):
            t = t.conj()
        if (dtype.is_complex or dtype.is_floating_point) and item > 1 and rand(3) == 0:
            t = torch._neg_view(t)
        kinds.add((str(dtype), t.is_conj(), t.is_neg()))
        want = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        with _SanitizerWrites() as seen:
            got = storage_bytes(t)
        assert seen.writes == [], (dtype, size, stride, offset, seen.writes)
        assert got.dtype is torch.uint8 and not got.is_conj() and not got.is_neg()
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, (1,), 0)
        assert got.data_ptr() == want.data_ptr() and got.numel() == nbytes
        assert got.untyped_storage()._cdata == st._cdata
        assert torch.equal(got, want) and torch.equal(got, raw)
    # every dtype was drawn, and conjugate and negative views of several
    assert {k[0] for k in kinds} == {str(d) for d in _LAYOUT_DTYPES}
    assert sum(k[1] for k in kinds) >= 2 and sum(k[2] for k in kinds) >= 4


# -- releases from a GC pass inside the executor (NOTE [ Re-entrant release ]) -------------------


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


def test_a_release_while_poll_asks_about_a_copy_retires_no_running_copy() -> None:
    """A GC pass inside poll's query of the oldest copy out (a dropped graph's finalizer
    released that family) made poll retire the next family instead, whose copy was still
    running: its source was dropped (on CUDA, device memory the D2H copy still read; on CPU the
    retire raised TimeoutError asking the unfinished write for its error). Poll now retires
    only the family it asked about."""
    from offload._executor import Executor

    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    mgr = offload.ActivationOffloader(nn.Linear(2, 2), min_offload_bytes=0, _copy_engine=engine)
    hold = threading.Event()
    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(32, 32, requires_grad=True)
    gc.collect()
    gc.disable()  # only the pass below may finalize the dropped graph
    try:
        with engine.paused():  # nothing is copied before the step's last poll
            with mgr:
                y1 = Saver.apply(seen, x1 * 1)  # family a
                blocker = engine.submit(hold.wait)  # the copy worker stops after a's copy
                y2 = Saver.apply(seen, x2 * 1)  # family b: copied once the blocker returns
        ex = mgr._executor
        a, b = ex.step.families
        a.handle.wait()
        assert not b.handle.done() and list(ex._inflight) == [a, b]
        garbage(y1)
        del y1
        with gc_pass_when_returning(Executor._copy_out_done) as passes:
            ex.poll()
        assert passes[0] >= 1 and a.life is Life.FREED  # what this test is about
        assert b.life is Life.COPYING_OUT and b.source is not None
        assert list(ex._inflight) == [b] and ex._inflight_bytes == b.nbytes
        hold.set()
        blocker.result(timeout=30)
        y2.backward()
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert_nothing_live(mgr)
    finally:
        gc.enable()
        hold.set()
        mgr.close()
        engine.close()


def test_a_release_while_a_prefetch_allocates_stops_that_reload() -> None:
    """A GC pass at the allocation of a prefetch's buffer (a dropped graph's finalizer released
    the family being reloaded) left the reload going on a freed family: an illegal move from
    'freed' to 'copying in' raised out of the backward that prefetched it. The reload stops."""
    from offload._family import aligned_buffer

    mgr = offload.ActivationOffloader(nn.Linear(2, 2), min_offload_bytes=0)
    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(16, 16, requires_grad=True)
    gc.collect()
    gc.disable()  # only the pass below may finalize the dropped graph
    try:
        with mgr:
            y1 = Saver.apply(seen, x1 * 1)  # family a: its graph is dropped below
            y2 = Saver.apply(seen, x2 * 1)  # family b: its backward's look-ahead reaches a
        ex = mgr._executor
        a, b = ex.step.families
        assert a.life is Life.OFF_DEVICE and b.life is Life.OFF_DEVICE
        garbage(y1)
        del y1
        with gc_pass_when_returning(aligned_buffer, nbytes=a.nbytes) as passes:
            y2.backward()
        assert passes[0] == 1 and a.life is Life.FREED and a.resident is None
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert ex._ahead_bytes == 0
        assert_nothing_live(mgr)
    finally:
        gc.enable()
        mgr.close()


# -- prefetch under memory pressure (NOTE [ Prefetch under memory pressure ]) -------------------


@pytest.mark.parametrize("name", ["mlp", "gpt_block"])
def test_a_prefetch_without_room_on_the_device_is_left_to_its_unpack(name: str) -> None:
    """A room probe that says the device has no room for a reload: no prefetch is tried (on
    CUDA each try would OOM, and the allocator empty its cache, a device synchronization),
    each is counted, every family is reloaded by its unpack instead, and the gradients are
    bitwise those without offloading. With room, the same steps prefetch."""
    from offload._family import ALIGN_BYTES

    want = [reference_grads(name, s) for s in range(2)]
    asked: list[int] = []

    def no_room(nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    for room, prefetched in ((no_room, False), (lambda n: True, True)):
        case = ALL_MODELS[name](seed=0)
        with manager(case.model, _room=room) as mgr:
            for s in range(2):
                assert_bitwise(offloaded_step(case, mgr, s), want[s])
                last = mgr.stats.last
                assert last.reloads == last.records_offloaded_cpu > 0
                if prefetched:
                    assert last.stalls < last.reloads and last.prefetches_skipped == 0
                else:
                    assert last.stalls == last.reloads  # each at its unpack
                    assert last.prefetches_skipped > 0
                    # asked for a family's bytes and the buffer's alignment slack
                    sizes = {f.nbytes + ALIGN_BYTES for f in mgr._executor.step.families}
                    assert asked and set(asked) <= sizes
            assert_nothing_live(mgr)


# -- CUDA graph capture, simulated on CPU (NOTE [ No query while capturing ]) ---------------------


def test_a_step_inside_a_simulated_graph_capture_asks_no_completion_query() -> None:
    """CUDA forbids event queries while a stream captures a graph (one invalidates the
    capture). On CPU ``GraphCapture.simulate()`` says "capturing" to the checks a real capture
    meets: a step run inside it, with the last step's copies still in flight and that step's
    graph dropped meanwhile, asks no completion query (at the step's start, every module
    boundary, its backward's prefetches, the dropped graph's releases); its packs pass through,
    warned once. After it the waiting releases are done and steps offload as before, every
    gradient bitwise."""
    case = mlp(seed=0)
    want = [reference_grads("mlp", s) for s in range(4)]
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, _copy_engine=engine)
    try:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])  # a warm-up step
        ex = mgr._executor
        with engine.paused():  # step 1's copies stay in flight through the capture
            case.model.zero_grad(set_to_none=True)
            with mgr:
                held = case.loss(case.batch(1))
            assert ex._inflight
            case.model.zero_grad(set_to_none=True)
            with (
                ex.capture.simulate(),
                pytest.warns(RuntimeWarning, match="CUDA graph capture: saved tensors"),
            ):
                with mgr:
                    loss = case.loss(case.batch(2))
                loss.backward()
                del held  # step 1's graph dies inside the capture: its releases wait
                assert ex._deferred_releases
            assert ex.capture.queries == 0  # what this test is about
            assert_bitwise(case.grads(), want[2])
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 0 and last.records_kept == last.records > 0
        assert_bitwise(offloaded_step(case, mgr, 3), want[3])
        assert mgr.stats.last.records_offloaded_cpu > 0
        assert not ex._deferred_releases
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()


def test_a_release_while_a_failed_write_goes_to_the_next_tier_frees_the_new_copy(
    tmp_path, monkeypatch
) -> None:
    """A late write failure sends the record to the next tier from its held source, inside
    poll; a GC pass at that write (a dropped graph's finalizer released the family) left poll
    moving a freed family back 'off device' (an illegal move raised out of the pack or module
    boundary that polled) and its new copy held for good. The new copy is freed instead."""
    from offload._tiers import cpu_charge

    seen: list[Any] = []
    x1 = torch.randn(32, 32, requires_grad=True)
    x2 = torch.randn(32, 32, requires_grad=True)
    kw = {"tiers": ("nvme", "cpu"), "nvme_dir": tmp_path}
    nvme = faults.install(monkeypatch, "nvme")["nvme"]
    with manager(nn.Linear(2, 2), "deferred", **kw) as mgr:
        gc.collect()
        gc.disable()  # only the pass below may finalize the dropped graph
        try:
            with mgr._engine.paused(), mgr:  # no write fails before the step's last poll
                nvme.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)))
                y1 = Saver.apply(seen, x1 * 1)  # family a: its graph is dropped below
                y2 = Saver.apply(seen, x2 * 1)
            ex = mgr._executor
            a, b = ex.step.families
            for fam in (a, b):
                with contextlib.suppress(storage.StorageError):
                    fam.handle.wait()  # failed, on the I/O thread
            garbage(y1)
            del y1
            with gc_pass_when_returning(storage.HostTier.write) as passes:
                ex.poll()
            assert passes[0] == 2 and a.life is Life.FREED  # what this test is about
            assert nvme.injected == 2
            assert b.life is Life.OFF_DEVICE and b.tier.name == "cpu"
            assert ex.cpu_bytes == cpu_charge(b.nbytes) == mgr._tiers[1].used_bytes
            y2.backward()
        finally:
            gc.enable()
        assert torch.equal(seen[-1][0][1], x2) and torch.equal(x2.grad, torch.ones_like(x2))
        assert_nothing_live(mgr)
        assert [t.used_bytes for t in mgr._tiers] == [0, 0]


@pytest.mark.parametrize("host_room", [True, False], ids=["to_host", "stays_pinned"])
def test_a_release_while_a_failed_nvme_write_goes_elsewhere_frees_its_copy(
    tmp_path, monkeypatch, host_room: bool
) -> None:
    """GPU + NVMe, driven by hand on CPU: a file write from pinned staging failed late, so
    poll adopts the pinned copy into the host tier (or, with no room there, keeps it as the
    record's copy); a GC pass at that write (or at the log line saying so) finalized the
    family's last member and freed the family first, and the copy was then kept for good (in
    the host tier, counted in ``cpu_bytes``; or the pinned region). It is freed with its
    family."""
    from offload import _faults
    from offload._executor import Executor, _Member

    pool = storage.HostPool(1 << 22, slab_bytes=1 << 20)
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0)
    nvme = faults.FailingNvmeTier(tmp_path, capacity_bytes=1 << 22, pool=pool, copy_engine=engine)
    host = storage.HostTier(pool)
    ex = Executor(
        device=torch.device("cpu"),
        tiers=[nvme, host],
        cpu_budget_bytes=1 << 20 if host_room else 0,
        max_inflight_bytes=0,
        prefetch_bytes=0,
        pool=pool,
        staging_bytes=1 << 20,
    )
    where = storage.HostTier.write if host_room else _faults.say_write_failed
    gc.collect()
    gc.disable()  # only the pass below may finalize the member
    try:
        nvme.faults.fail("write", OSError(errno.EIO, os.strerror(errno.EIO)))
        data = torch.zeros(4096, dtype=torch.uint8)
        fam = hand_family(data)
        region = pool.allocate(4096)
        fam.tier, fam.handle, fam.spill = nvme, nvme.write(region, 4096), region
        fam.to(Life.COPYING_OUT)
        fam.to(Life.OFF_DEVICE)
        ex._writing.append((fam, fam.handle))  # as _retire queues it on CUDA
        ex._writing_bytes += 4096
        ex._live[fam] = None
        member = _Member(ex, fam, data, None)
        fam.members = 1
        fam.member_refs.append(weakref.ref(member))
        garbage(member)
        del member
        with contextlib.suppress(storage.StorageError):
            ex._writing[0][1].wait()  # failed
        with gc_pass_when_returning(where) as passes:
            ex.poll()
        assert passes[0] == 1 and fam.life is Life.FREED  # what this test is about
        assert nvme.faults.injected == 1
        assert fam.handle is None and fam.spill is None and ex.cpu_bytes == 0
        assert not ex._writing and host.used_bytes == 0 and pool.used_bytes == 0
    finally:
        gc.enable()
        ex.close()
        host.close()
        nvme.close()
        engine.close()
        pool.close()


def test_a_full_pool_waits_for_the_copies_in_flight_before_it_refuses(
    tmp_path, monkeypatch
) -> None:
    """tiers=("cpu", "nvme"), cpu_budget="2MiB", and another user of the process-wide pool
    holding all but 2 MiB of the staging room the manager claimed: the host tier takes the
    first two 1 MiB records, NVMe staging the next two, and with their copies still in flight
    (the deferred engine held back) the fifth found the pool full and the step raised
    StorageFullError, though the first file write to end gives its staging back. Now the pack
    waits for the oldest copies out (counted in backpressure_waits) and goes on; gradients
    bitwise, every record stored, nothing left held."""
    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(1024, 1024), nn.Tanh())])
    x = torch.randn(256, 1024)  # 1 MiB records: x and each Tanh output
    model(x).sum().backward()
    want = local_grads(model)
    pool = storage.shared_host_pool(pin_memory=False)
    staging_claim = 2 * (256 << 20)  # the least a manager with NVMe claims (_make_executor)
    other = pool.allocate(staging_claim - (2 << 20))  # a slab of 512 MiB, 2 MiB of it free
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.001, seed=5)
    mgr = offload.ActivationOffloader(
        model,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget="2MiB",
        max_inflight_bytes="64MiB",  # back-pressure never waits here: only the full pool does
        min_offload_bytes=0,
        _copy_engine=engine,
    )
    waited, done = threading.Event(), threading.Event()

    def hold_copies_back() -> None:
        # Every copy and file write waits until the manager waits for one, or its step failed
        # (which waits for them too, to release their regions).
        with engine.paused():
            waited.set()
            while not done.is_set():
                step = mgr._executor.step if mgr._executor is not None else None
                if step is not None and (step.stats.backpressure_waits or step.failed):
                    break
                time.sleep(0.001)

    holder = threading.Thread(target=hold_copies_back)
    try:
        holder.start()
        waited.wait()
        model.zero_grad(set_to_none=True)
        try:
            with mgr:
                loss = model(x).sum()
        finally:
            done.set()
            holder.join()
        loss.backward()
        assert_bitwise(local_grads(model), want)
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 2 and last.records_offloaded_nvme == 4
        assert last.backpressure_waits > 0
        del loss
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()
        other.release()
        pool.close()


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


def test_a_prefetched_nvme_reload_lands_before_its_unpack(tmp_path) -> None:
    """NVMe tier, min-memory mode, a window holding every family, every file write done before
    backward: the look-ahead starts every reload when backward begins, and the first half's
    file reads are done before that half's backward begins (the op between the halves waits
    for them). The copy to the device was issued only at each unpack (on CUDA: behind all the
    compute queued before it, a bubble per record); now the first poll that sees a read done
    issues it (NOTE [ NVMe reloads land early ]), so each of the first half's families (the
    input, 3 Tanh outputs) had landed before its unpack ran. Gradients bitwise."""

    def half() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(256, 256), nn.Tanh())])

    torch.manual_seed(0)
    a, b = half(), half()
    x = torch.randn(256, 256)
    model = nn.ModuleList([a, b])

    def forward(tier: Any) -> torch.Tensor:
        h = a(x)
        return b(_WaitForTier.apply(h, tier) if tier is not None else h.clone()).sum()

    forward(None).backward()
    want = local_grads(model)
    with manager(model, tiers=("nvme",), nvme_dir=tmp_path, max_inflight_bytes="64MiB") as mgr:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with mgr:
                tier = mgr._tiers[0]
                loss = forward(tier)
            assert mgr.stats.last.records_offloaded_nvme == 8  # waits for every file write
            ex = mgr._executor
            landed = getattr(ex, "landed_early", 0)
            loss.backward()
            assert_bitwise(local_grads(model), want)
            last = mgr.stats.last
            assert last.reloads == 8 and last.stalls == 0
            assert getattr(ex, "landed_early", 0) - landed >= 4  # before: 0


def test_a_member_released_after_its_unpack_leaves_its_family_reloaded_once() -> None:
    """Attention on views of one qkv output saves three members of one family: v (by att @ v)
    and q, k (by q @ k^T). Backward unpacks v, frees it with its node, then unpacks k and q.
    The family counted v's unpack after v was gone, so the unpack of k looked like its last
    one: its buffer was dropped and q's unpack reloaded the family a second time while k's
    view still held the first buffer (2 reloads, 2 x 6,144 bytes held, where 1 and 6,144
    are due)."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    qkv = nn.Linear(32, 96)
    x = torch.randn(2, 8, 32)

    def attend() -> torch.Tensor:
        q, k, v = qkv(x).view(2, 8, 3, 32).unbind(2)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return (att @ v).sum()

    attend().backward()
    want = qkv.weight.grad.clone()
    qkv.zero_grad(set_to_none=True)
    with manager(qkv, keep=()) as mgr:
        with SavedBytes.on(mgr) as saved:
            with mgr:
                loss = attend()
            settle(mgr)
            families = [f for f in mgr._executor.step.families if f.nbytes == 2 * 8 * 96 * 4]
            assert len(families) == 1 and families[0].members == 3
            del families
            loss.backward()
        assert mgr.stats.last.reloads == mgr.stats.last.records_offloaded_cpu
        assert torch.equal(qkv.weight.grad, want)
        # The qkv output's buffer once (with the softmax output's beside it), not twice.
        assert saved.peak_planned < 2 * (2 * 8 * 96 * 4), saved.peak_planned
