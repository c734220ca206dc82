"""Pack and unpack, each against an oracle: aliases whose bytes or versions change after
pack, slices and alignment, sibling views, fills after pack, records still copying out, and
tensors with no one storage to copy."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from offload_util import ENGINES, Saver, assert_bitwise, local_grads, manager, nvme_kw, settle
from torch import nn

import offload
from offload import storage
from offload._family import Life


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


@pytest.mark.parametrize("engine", ENGINES)
def test_members_of_other_dtypes_come_back_as_saved(engine: str) -> None:
    """One family, members of two dtypes (a complex tensor and its ``view_as_real``): each
    comes back in its own dtype over the one reloaded buffer (whose view in one dtype the
    members of that dtype share)."""
    x0 = torch.randn(2048, dtype=torch.complex64, generator=torch.Generator().manual_seed(5))

    def run(mgr: Any) -> torch.Tensor:
        x = x0.clone().requires_grad_()
        with mgr if mgr is not None else contextlib.nullcontext():
            y = x * 1.0
            r = torch.view_as_real(y)  # float32, a view of y: one family with y
            loss = (r * r).sum() + (y * y).real.sum() + (r[1:] * y[1:].real.unsqueeze(-1)).sum()
        loss.backward()
        return x.grad

    want = run(None)
    with manager(nn.Identity(), engine) as mgr:
        assert torch.equal(run(mgr), want)
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 1 and last.records_deduplicated >= 3


def test_the_storage_index_forgets_families_whose_storage_died() -> None:
    """Families are found by ``id()`` of their storage, which the next storage often gets once
    one dies. A pack that finds families of dead storages under its id drops them: kept, the
    index grew all step long (here: one entry of 200 families) and every pack walked it."""
    x = torch.randn(64, 64, requires_grad=True)
    mgr = offload.ActivationOffloader(nn.Linear(4, 4), min_offload_bytes=0)
    try:
        with mgr:
            for i in range(200):
                u = (x * (i + 1)).exp()  # saves its output; its graph dies with ``u``
                del u
            step = mgr._executor.step
            assert len(step.families) == 200
            # Under one id: the family of its live storage and at most one dead one not looked
            # up since (whether ids are reused at all is CPython's allocator's business).
            sizes = [len(v) if type(v) is list else 1 for v in step.by_storage.values()]
            assert max(sizes) <= 2
    finally:
        mgr.close()
