"""Tensor parallel (DTensor) and FSDP2 (``fully_shard``) under the offloader, on 2 gloo ranks.

The tests share two CPU ranks (``distributed_util.RankPool``: ``file://`` rendezvous, a deadline
on every job). On each rank a job runs the same steps on identically built models: once without
offloading (the reference), then with an :class:`offload.ActivationOffloader` made on the
already-parallelised model, in min-memory mode (copies deferred to a worker thread, docs/design.md
"Stream ordering" testing rule (a)) and with a budget of half the profiled saved peak (the first
step profiles, the next ones carry out the plan). Oracles, per rank and step:

- the local gradient shards are bitwise equal to the reference's;
- ``stats.last.bytes_offloaded_cpu > 0``: saved bytes left the device;
- the collectives (the c10d functional ops DTensor issues, the c10d ops FSDP2 issues) are the same
  ops in the same numbers as the reference's: offloading adds none;
- TP: DTensors reached the executor (as their local shards);
- FSDP2: the pack hook is handed views of unsharded parameters (the all-gather outputs FSDP2
  frees after forward) and none of them reaches the executor; FSDP2's explicit forward and
  backward prefetches (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``) still run
  and issue their all-gathers, in the reference's order.

Under tensor parallelism the planner recomputes no block (its recomputation would issue the
block's collectives again). A DTensor whose local tensor is an ``AsyncCollectiveTensor`` (a
row-wise output fed straight into a column-wise layer) is waited for before it is stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed_util import RankPool
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from offload import storage
from offload.lifecycle import HardwareModel

pytestmark = pytest.mark.distributed

STEPS = 3
DIM, HEADS, HIDDEN, BATCH, SEQ = 32, 4, 64, 2, 16
HARDWARE = {
    # Copies about as fast as this CPU's memcpy: the planner offloads.
    "fast": HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    ),
    # Copies so slow that the planner checkpoints whole blocks instead.
    "slow": HardwareModel.cpu_only(
        copy_bytes_per_s=1e4, disk_write_bytes_per_s=1e4, disk_read_bytes_per_s=1e4
    ),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    """Two gloo ranks shared by this module's tests (starting them costs seconds)."""
    with RankPool(tmp_path_factory.mktemp("ranks")) as pool:
        yield pool


# -- a small transformer (torchtitan's Llama block, tiny) ---------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds HEADS / world_size of them.
        q, k, v = (
            w(x).view(bs, seq, -1, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.w3 = nn.Linear(DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_transformer() -> Transformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Transformer()


def batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: getattr(p.grad, "_local_tensor", p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != want.keys() or not want:
        return [f"names differ: {sorted(got.keys() ^ want.keys())}"]
    return [n for n in want if not torch.equal(got[n], want[n])]


# -- spies ---------------------------------------------------------------------------------------

_COLLECTIVE_WORDS = (
    "reduce",
    "gather",
    "scatter",
    "broadcast",
    "all_to_all",
    "alltoall",
    "send",
    "recv",
)


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives the dispatcher sees (forward and backward), by op.

    DTensor ops are let through (``NotImplemented``) so that DTensor turns them into the
    functional collectives it needs, which come back here, as in ``CommDebugMode``; unlike that
    mode, this one installs no module hooks, so the autograd graph is the model's own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented
        name = func._overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and any(
            w in name for w in _COLLECTIVE_WORDS
        ):
            self.counts[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Offload:
    """One ``Executor.offload`` call: the module, whether a DTensor was unwrapped, the probe."""

    module: str
    dtensor: bool
    probed: bool


@contextlib.contextmanager
def spy_offloads(probe: Callable[[torch.Tensor], bool] | None = None) -> Iterator[list[Offload]]:
    """Every ``Executor.offload`` call of this process, ``probe(tensor)`` taken at the call."""
    from offload._executor import Executor

    calls: list[Offload] = []
    original = Executor.offload

    def spy(self: Any, t: torch.Tensor, module: str, dtensor: Any, *args: Any) -> Any:
        calls.append(Offload(module, dtensor is not None, probe is not None and probe(t)))
        return original(self, t, module, dtensor, *args)

    Executor.offload = spy  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Executor.offload = original  # type: ignore[method-assign]


@contextlib.contextmanager
def spy_saved(probe: Callable[[torch.Tensor], bool]) -> Iterator[list[bool]]:
    """``probe`` of every tensor the pack hook is handed (managers made inside the block)."""
    seen: list[bool] = []
    original = offload.ActivationOffloader._pack

    def pack(self: Any, t: torch.Tensor) -> Any:
        seen.append(probe(t))
        return original(self, t)

    offload.ActivationOffloader._pack = pack  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        offload.ActivationOffloader._pack = original  # type: ignore[method-assign]


# -- steps ---------------------------------------------------------------------------------------


@dataclass
class Run:
    grads: list[dict[str, torch.Tensor]]
    comms: list[Counter[str]]
    stats: list[offload.StepStats]
    planned: bool = False


def run_steps(
    model: nn.Module,
    inputs: Callable[[int], torch.Tensor],
    mgr: offload.ActivationOffloader | None = None,
) -> Run:
    """STEPS steps of forward, backward and SGD; per step the local gradients, the collectives of
    forward and backward, and (with ``mgr``) the step's stats."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run([], [], [])
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with CollectiveCounter() as counter:
            with mgr if mgr is not None else contextlib.nullcontext():
                loss = model(inputs(s)).pow(2).sum()
            loss.backward()
        run.grads.append(local_grads(model))
        run.comms.append(counter.counts)
        if mgr is not None:
            run.stats.append(mgr.stats.last)
        opt.step()
    if mgr is not None:
        run.planned = mgr.plan is not None
    return run


def budget(
    model: nn.Module, inputs: Callable[[int], torch.Tensor], hardware: str
) -> dict[str, Any]:
    """Budget mode's arguments: half the profiled saved peak, planned for ``HARDWARE[hardware]``
    (the profiling step's gradients are dropped)."""
    step = lambda: model(inputs(0)).pow(2).sum().backward()  # noqa: E731
    trace = offload.profile(step, model, warmup_steps=0)
    model.zero_grad(set_to_none=True)
    return {"gpu_budget": trace.peak_saved_bytes // 2, "hardware": HARDWARE[hardware]}


@contextlib.contextmanager
def manager(model: nn.Module, rank: int, **kw: Any) -> Iterator[offload.ActivationOffloader]:
    """A manager made on the finished (parallelised) ``model``; without a budget, in min-memory
    mode with copies deferred to a worker thread."""
    engine = None if kw else storage.CopyEngine(deferred=True, seed=rank)
    mgr = offload.ActivationOffloader(
        model, min_offload_bytes=0, cpu_budget="64MiB", _copy_engine=engine, **kw
    )
    try:
        yield mgr
    finally:
        mgr.close()
        if engine is not None:
            engine.close()


def compare(run: Run, want: Run) -> dict[str, Any]:
    return {
        "differing": [differing(g, w) for g, w in zip(run.grads, want.grads, strict=True)],
        "comms": run.comms,
        "bytes_offloaded_cpu": [s.bytes_offloaded_cpu for s in run.stats],
        "bytes_recomputed": [s.bytes_recomputed for s in run.stats],
        "records_rebuilt": [s.records_rebuilt for s in run.stats],
        "planned": run.planned,
    }


def check(rank: int, mode: str, got: dict[str, Any], want_comms: list[Counter[str]]) -> str:
    where = f"rank {rank}, {mode}"
    assert got["differing"] == [[]] * STEPS, f"{where}: gradients differ: {got['differing']}"
    assert all(b > 0 for b in got["bytes_offloaded_cpu"]), (where, got["bytes_offloaded_cpu"])
    assert got["comms"] == want_comms, f"{where}: collectives {got['comms']} != {want_comms}"
    assert mode != "budget" or got["planned"], f"{where}: no plan was made"
    return where


# -- tensor parallel -----------------------------------------------------------------------------


def tp_transformer(mesh: Any, sequence_parallel: bool) -> Transformer:
    """torchtitan's plan: q/k/v and w1/w3 column-wise, wo and w2 row-wise; with sequence parallel
    the norms run on sequence shards (``Shard(1)``) and the attention and feed-forward inputs are
    all-gathered first, their outputs reduce-scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = build_transformer()
    for block in model.blocks:
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan |= {
                "attention_norm": SequenceParallel(),
                "attention": gather,
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": gather,
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan |= {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {"norm": SequenceParallel(use_local_output=True)})
    return model


def _tp_worker(
    rank: int, world_size: int, sequence_parallel: bool, modes: tuple[str, ...], hardware: str
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def inputs(step: int) -> torch.Tensor:
        x = batch(step)  # the same batch on every rank of the TP group
        return x.chunk(world_size, dim=1)[rank] if sequence_parallel else x

    def build() -> nn.Module:
        return tp_transformer(mesh, sequence_parallel)

    want = run_steps(build(), inputs)
    result: dict[str, Any] = {"want_comms": want.comms}
    for mode in modes:
        model = build()
        kw = budget(model, inputs, hardware) if mode == "budget" else {}
        with manager(model, rank, **kw) as mgr, spy_offloads() as calls:
            result[mode] = compare(run_steps(model, inputs, mgr), want)
        result[mode]["dtensor_offloads"] = sum(c.dtensor for c in calls)
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_gradients_bitwise_and_no_added_collectives(
    ranks: RankPool, sequence_parallel: bool
) -> None:
    modes = ("min_memory", "budget")
    for rank, r in enumerate(ranks.run(_tp_worker, sequence_parallel, modes, "fast")):
        want_comms = r["want_comms"]
        expected = (
            {"_c10d_functional.all_gather_into_tensor", "_c10d_functional.reduce_scatter_tensor"}
            if sequence_parallel
            else {"_c10d_functional.all_reduce"}
        )
        assert all(set(c) == expected for c in want_comms), want_comms
        for mode in modes:
            where = check(rank, mode, r[mode], want_comms)
            assert r[mode]["dtensor_offloads"] > 0, f"{where}: no DTensor shard was offloaded"
        # Rebuilt, not stored (NOTE [ DTensor activation recipes ]): per block the SiLU output
        # and, without sequence parallel, the two norm outputs that q, k, v and w1, w3 save
        # (``from_local`` of the plain norm output: 5 DTensors), and the final norm's output.
        # With sequence parallel the Linears save the all-gathered norm outputs (no function of
        # this rank's input) and the final norm's output is stored (see the NOTE).
        rebuilt = 2 if sequence_parallel else 13
        assert r["min_memory"]["records_rebuilt"] == [rebuilt] * STEPS, r["min_memory"]


def test_tensor_parallel_recompute_adds_no_collectives(ranks: RankPool) -> None:
    for rank, r in enumerate(ranks.run(_tp_worker, True, ("budget",), "slow")):
        got = r["budget"]
        # A link this slow makes the planner recompute on a plain model (see
        # test_offload_recompute.py); under TP it must not, or the block's collectives run again.
        assert not any(got["bytes_recomputed"]), (
            f"rank {rank}: recomputed {got['bytes_recomputed']}"
        )
        assert got["differing"] == [[]] * STEPS, f"rank {rank}: gradients differ"
        assert got["comms"] == r["want_comms"], f"rank {rank}: {got['comms']} != {r['want_comms']}"


def tp_mlps(mesh: Any) -> nn.Module:
    """Two TP MLPs chained with nothing between them: the first one's row-wise output (an
    all-reduce not yet waited for: an ``AsyncCollectiveTensor``) is the second one's column-wise
    input, which Linear saves as the local tensor of a DTensor."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
                for _ in range(2)
            )
        )
    for mlp in model:
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _tp_chained_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    want = run_steps(tp_mlps(mesh), batch)
    model = tp_mlps(mesh)
    try:
        with manager(model, rank) as mgr:
            got = run_steps(model, batch, mgr)
    except Exception:  # both ranks fail at the same pack: return it and keep the ranks
        return {"error": traceback.format_exc(limit=-4)}
    return compare(got, want) | {"want_comms": want.comms, "error": None}


def test_tensor_parallel_async_collective_local_tensor(ranks: RankPool) -> None:
    for rank, r in enumerate(ranks.run(_tp_chained_worker)):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        check(rank, "min_memory", r, r["want_comms"])


# -- FSDP2 ---------------------------------------------------------------------------------------


def fsdp_transformer(mesh: Any) -> Transformer:
    """``fully_shard`` on each block, then on the root (block parameters resharded after
    forward), with explicit prefetching: each block's forward all-gathers the next block's
    parameters, and each block's backward the previous one's."""
    from torch.distributed.fsdp import fully_shard

    model = build_transformer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    blocks = list(model.blocks)
    for earlier, later in itertools.pairwise(blocks):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])
    return model


def unsharded_storages(model: nn.Module) -> set[int]:
    """Addresses of the unsharded parameter storages FSDP2 holds now (the per-parameter
    all-gather outputs, which the unsharded parameters view); freed (empty) ones left out."""
    ptrs = set()
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in get_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                for t in fsdp_param.all_gather_outputs:
                    st = t.untyped_storage()
                    if st.nbytes():
                        ptrs.add(st.data_ptr())
    return ptrs


def is_unsharded_view(model: nn.Module) -> Callable[[torch.Tensor], bool]:
    def probe(t: torch.Tensor) -> bool:
        st = getattr(t, "_local_tensor", t).untyped_storage()
        return st.nbytes() > 0 and st.data_ptr() in unsharded_storages(model)

    return probe


@contextlib.contextmanager
def spy_prefetches() -> Iterator[list[tuple[str, str, bool]]]:
    """FSDP2's prefetches, explicit and implicit: (pass, target module, issued an all-gather)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    events: list[tuple[str, str, bool]] = []
    original = FSDPParamGroup.__dict__["_prefetch_unshard"]

    def prefetch(target: Any, pass_type: str) -> None:
        idle = target._all_gather_result is None and not target.is_unsharded
        original.__func__(target, pass_type)
        issued = idle and target._all_gather_result is not None
        events.append((pass_type, target._module_fqn, issued))

    FSDPParamGroup._prefetch_unshard = staticmethod(prefetch)  # type: ignore[method-assign]
    try:
        yield events
    finally:
        FSDPParamGroup._prefetch_unshard = original  # type: ignore[method-assign]


def _fsdp_worker(rank: int, world_size: int, modes: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def inputs(step: int) -> torch.Tensor:
        return batch(step, rank)  # data parallel: each rank its own batch

    def build() -> nn.Module:
        return fsdp_transformer(mesh)

    with spy_prefetches() as want_prefetches:
        want = run_steps(build(), inputs)
    result: dict[str, Any] = {"want_comms": want.comms, "want_prefetches": want_prefetches}
    for mode in modes:
        model = build()
        kw = budget(model, inputs, "fast") if mode == "budget" else {}
        probe = is_unsharded_view(model)
        with (
            spy_saved(probe) as saved,  # before the manager is made: it binds its pack hook
            spy_offloads(probe) as calls,
            spy_prefetches() as fetched,
            manager(model, rank, **kw) as mgr,
        ):
            result[mode] = compare(run_steps(model, inputs, mgr), want)
        result[mode] |= {
            "prefetches": fetched,
            "unsharded_saved": sum(saved),
            "unsharded_offloaded": [c.module for c in calls if c.probed],
        }
    return result


def test_fsdp2_gradients_bitwise_unsharded_views_stay_prefetch_runs(ranks: RankPool) -> None:
    modes = ("min_memory", "budget")
    for rank, r in enumerate(ranks.run(_fsdp_worker, modes)):
        want_comms, want_prefetches = r["want_comms"], r["want_prefetches"]
        assert all(
            set(c) == {"c10d._allgather_base_", "c10d._reduce_scatter_base_"} for c in want_comms
        ), want_comms
        issued = {p for p, _, issued in want_prefetches if issued}
        assert issued == {"forward", "backward"}, f"rank {rank}: prefetches {want_prefetches}"
        for mode in modes:
            got = r[mode]
            where = check(rank, mode, got, want_comms)
            # The hazard is real (pack is handed views of unsharded parameters, whose storage
            # FSDP2 frees after forward), and none of them reached the executor.
            assert got["unsharded_saved"] > 0, f"{where}: no unsharded view was saved"
            assert got["unsharded_offloaded"] == [], f"{where}: unsharded views moved"
            assert got["prefetches"] == want_prefetches, f"{where}: FSDP2 prefetches changed"
        # Rebuilt from their inputs per step, bitwise (NOTE [ Activation recipes ]): in each
        # block the attention norm's output (saved by wq, wk and wv), the feed-forward norm's
        # (by w1 and w3) and the SiLU output (by the product); and the final norm's (by pow).
        # The norms sit inside their block's FSDP unit (the final one in the root's), whose
        # unshard precedes their savers' backward.
        assert r["min_memory"]["records_rebuilt"] == [13] * STEPS, r["min_memory"]


class PostNormBlock(nn.Module):
    """A post-norm block (BERT's layout): it ends with its LayerNorm, whose output the next
    block's first Linear saves."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.w2(F.relu(self.w1(x))))


def fsdp_post_norm(mesh: Any) -> nn.Module:
    """Three post-norm blocks and a head, ``fully_shard`` per block (resharded after forward)
    and on the root; each norm's weight and bias made distinct."""
    from torch.distributed.fsdp import fully_shard

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*(PostNormBlock() for _ in range(3)), nn.Linear(DIM, DIM))
    with torch.no_grad():
        for i, block in enumerate(model[:3]):
            block.norm.weight.add_(0.5 * (i + 1))
            block.norm.bias.add_(0.25 * (i + 1))
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_post_norm_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def inputs(step: int) -> torch.Tensor:
        return batch(step, rank)

    reference = fsdp_post_norm(mesh)
    want = run_steps(reference, inputs)
    model = fsdp_post_norm(mesh)
    try:
        with manager(model, rank) as mgr:
            got = run_steps(model, inputs, mgr)
    except Exception:
        return {"error": traceback.format_exc(limit=-3)}
    params = [
        n
        for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
        if not torch.equal(p._local_tensor, q._local_tensor)
    ]
    return compare(got, want) | {"want_comms": want.comms, "error": None, "params": params}


def test_fsdp2_post_norm_output_saved_by_the_next_unit(ranks: RankPool) -> None:
    """Block i's norm output is saved by block i+1's first Linear, whose backward runs before
    block i's unshard: the norm weight FSDP2 freed after block i's forward is not read there
    (the rebuild uses a copy taken at the norm's forward); gradients and parameters after SGD
    are bitwise the reference's, and the norm outputs are still rebuilt, not stored."""
    for rank, r in enumerate(ranks.run(_fsdp_post_norm_worker)):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        check(rank, "min_memory", r, r["want_comms"])
        assert r["params"] == [], f"rank {rank}: parameters differ after SGD: {r['params']}"
        # Blocks 2 and 3 save the previous block's norm output (w1), the head the last one's.
        assert r["records_rebuilt"] == [3] * STEPS, r["records_rebuilt"]


class DTensorBlock(nn.Module):
    """A block whose norm and activation run on DTensors (sequence parallel; column-wise
    outputs kept DTensors) and whose DTensor outputs are saved as they are: the activation
    output (a hidden shard, ``Shard(2)``) by the product with ``w3``'s output, the norm output
    (a sequence shard, ``Shard(1)``) by the product with ``w2``'s."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w3 = nn.Linear(DIM, HIDDEN)
        self.act = act
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + 0.05 * (h * self.w2(self.act(self.w1(h)) * self.w3(h)))


class DTensorBlocks(nn.Module):
    """Two :class:`DTensorBlock` (GELU, then SiLU) on a sequence-sharded input."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh
        self.blocks = nn.Sequential(
            DTensorBlock(nn.GELU(approximate="tanh")), DTensorBlock(nn.SiLU())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        x = DTensor.from_local(x, self.mesh, (Shard(1),), run_check=False)
        return self.blocks(x).to_local()


def tp_dtensor_blocks(mesh: Any) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DTensorBlocks(mesh)
    colwise = ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    for block in model.blocks:
        plan = {
            "norm": SequenceParallel(use_local_output=False),
            "w1": colwise,
            "w3": colwise,
            "w2": RowwiseParallel(
                input_layouts=Shard(2), output_layouts=Shard(1), use_local_output=False
            ),
        }
        parallelize_module(block, mesh, plan)
    return model


def _tp_rebuild_worker(rank: int, world_size: int, name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def inputs(step: int) -> torch.Tensor:
        x = batch(step)
        return x if name == "tp" else x.chunk(world_size, dim=1)[rank].contiguous()

    def build() -> nn.Module:
        return tp_transformer(mesh, False) if name == "tp" else tp_dtensor_blocks(mesh)

    want = run_steps(build(), inputs)
    result: dict[str, Any] = {"want_comms": want.comms}
    for mode in ("min_memory", "budget"):
        model = build()
        trace = offload.profile(
            lambda m=model: m(inputs(0)).pow(2).sum().backward(), model, warmup_steps=0
        )
        model.zero_grad(set_to_none=True)
        # A link this slow makes the planner rebuild what it can rather than copy it.
        kw = {"gpu_budget": trace.peak_saved_bytes // 2, "hardware": HARDWARE["slow"]}
        with manager(model, rank, **(kw if mode == "budget" else {})) as mgr:
            result[mode] = compare(run_steps(model, inputs, mgr), want)
        result[mode]["links"] = sum(r.rebuild_from >= 0 for r in trace.records)
    return result


@pytest.mark.parametrize("name", ["tp", "dtensor"])
def test_tensor_parallel_activation_outputs_rebuilt(ranks: RankPool, name: str) -> None:
    """DTensor activation and norm outputs are rebuilt from their inputs at unpack (NOTE
    [ DTensor activation recipes ]), in min-memory mode and where a plan says so, with
    gradients bitwise the reference's and no collective added; ``offload.profile`` links the
    same records (``rebuild_from``) as the manager rebuilds. ``tp``: the transformer, whose
    norm outputs reach the Linears through ``from_local`` (13 per step, see the test above).
    ``dtensor``: :class:`DTensorBlocks`, whose GELU, SiLU and norms run on DTensors and save
    DTensors (4 per step)."""
    for rank, r in enumerate(ranks.run(_tp_rebuild_worker, name)):
        for mode in ("min_memory", "budget"):
            got = r[mode]
            where = check(rank, mode, got, r["want_comms"])
            assert got["links"] == (13 if name == "tp" else 4), f"{where}: {got['links']} links"
        assert r["min_memory"]["records_rebuilt"] == [r["min_memory"]["links"]] * STEPS, r
        assert all(n > 0 for n in r["budget"]["records_rebuilt"][1:]), r["budget"]


def tp_mlp(mesh: Any, dtensor_gelu: bool) -> nn.Module:
    """``Linear -> GELU -> Linear``, column-wise then row-wise. ``dtensor_gelu``: the column-wise
    output stays a DTensor (``Shard(2)``), so the GELU runs on DTensors and saves a DTensor
    input; else it runs on the plain local output."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    colwise = ColwiseParallel(use_local_output=not dtensor_gelu)
    return parallelize_module(model, mesh, {"0": colwise, "2": RowwiseParallel()})


def keep_inputs_rebuild_outputs(trace: offload.Trace) -> offload.Plan:
    """The planner's plan of ``trace`` with every family kept except the activation outputs it
    links to their inputs (``rebuild_from``), rebuilt: the inputs are kept."""
    from offload.lifecycle import Placement

    plan = offload.plan(trace, 4 * trace.peak_saved_bytes, HARDWARE["fast"], min_offload_bytes=0)
    rebuilt = {r.family for r in trace.records if r.rebuild_from >= 0}
    assert rebuilt, "the trace links no activation output to its input"
    entries = tuple(
        dataclasses.replace(
            e,
            placement=Placement.REBUILD if e.family in rebuilt else Placement.KEEP,
            reload=None,
            reload_event=-1,
        )
        for e in plan.entries
    )
    return dataclasses.replace(plan, entries=entries)


def _tp_kept_input_worker(rank: int, world_size: int, dtensor_gelu: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    want = run_steps(tp_mlp(mesh, dtensor_gelu), batch)
    model = tp_mlp(mesh, dtensor_gelu)
    trace = offload.profile(lambda: model(batch(0)).pow(2).sum().backward(), model, warmup_steps=0)
    model.zero_grad(set_to_none=True)
    with manager(model, rank, plan=keep_inputs_rebuild_outputs(trace)) as mgr:
        got = run_steps(model, batch, mgr)
    return compare(got, want) | {
        "want_comms": want.comms,
        "bytes_rebuilt": [s.bytes_rebuilt for s in got.stats],
        "unplanned_records": [s.unplanned_records for s in got.stats],
    }


@pytest.mark.parametrize("dtensor_gelu", [False, True], ids=["plain_gelu", "dtensor_gelu"])
def test_tensor_parallel_output_rebuilt_from_a_kept_input(
    ranks: RankPool, dtensor_gelu: bool
) -> None:
    """A plan that keeps a GELU's input and rebuilds its output (``Placement.REBUILD``, NOTE
    [ DTensor activation recipes ]): the output, which the row-wise Linear saves as a DTensor
    (its local shard: BATCH x SEQ x HIDDEN / 2 floats, 4096 bytes per rank), is rebuilt from the
    kept input at unpack, whether that input is a plain tensor or a DTensor; nothing is stored,
    gradients are bitwise the reference's and no collective is added."""
    shard_bytes = BATCH * SEQ * HIDDEN // 2 * 4
    for rank, r in enumerate(ranks.run(_tp_kept_input_worker, dtensor_gelu)):
        where = f"rank {rank}"
        assert r["differing"] == [[]] * STEPS, f"{where}: gradients differ: {r['differing']}"
        assert r["comms"] == r["want_comms"], f"{where}: {r['comms']} != {r['want_comms']}"
        assert r["records_rebuilt"] == [1] * STEPS, (where, r)
        assert r["bytes_rebuilt"] == [shard_bytes] * STEPS, (where, r)
        assert r["bytes_offloaded_cpu"] == [0] * STEPS, (where, r)
        assert r["unplanned_records"] == [0] * STEPS, (where, r)


def fsdp_tp_transformer(mesh: Any) -> Transformer:
    """FSDP2 over tensor parallel on a 2-D mesh ``(dp, tp)``: the transformer with sequence
    parallel (its norms' weights Replicate DTensors of ``tp``), then ``fully_shard`` per block
    and on the root over ``dp``. FSDP2's unsharded parameters are then DTensors (of ``tp``)
    that are Parameters, whose shards view its all-gather outputs."""
    from torch.distributed.fsdp import fully_shard

    model = tp_transformer(mesh["tp"], sequence_parallel=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def counting(
    probe: Callable[[torch.Tensor], bool], nbytes: list[int]
) -> Callable[[torch.Tensor], bool]:
    """``probe``, appending to ``nbytes`` the bytes of each tensor it holds for."""

    def counted(t: torch.Tensor) -> bool:
        if probe(t):
            nbytes.append(t.numel() * t.element_size())
            return True
        return False

    return counted


def _fsdp_tp_worker(rank: int, world_size: int, modes: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    # 2 ranks: data parallel of 1, tensor parallel of 2 (still FSDP2's all-gather and free).
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))

    def inputs(step: int) -> torch.Tensor:
        return batch(step).chunk(world_size, dim=1)[rank]  # sequence parallel: a sequence shard

    want = run_steps(fsdp_tp_transformer(mesh), inputs)
    result: dict[str, Any] = {"want_comms": want.comms}
    for mode in modes:
        model = fsdp_tp_transformer(mesh)
        kw = {}
        if mode == "budget":
            trace = offload.profile(
                lambda m=model: m(inputs(0)).pow(2).sum().backward(), model, warmup_steps=0
            )
            model.zero_grad(set_to_none=True)
            kw = {"gpu_budget": trace.peak_saved_bytes // 2, "hardware": HARDWARE["fast"]}
            result["traced_parameters"] = sum(r.is_parameter for r in trace.records)
        stored: list[int] = []
        with spy_offloads(counting(is_unsharded_view(model), stored)) as calls:
            if mode == "immediate":  # copies made in pack: the bytes can be counted safely
                mgr = offload.ActivationOffloader(model, min_offload_bytes=0, cpu_budget="64MiB")
                with contextlib.closing(mgr):
                    result[mode] = compare(run_steps(model, inputs, mgr), want)
            else:
                with manager(model, rank, **kw) as mgr:
                    result[mode] = compare(run_steps(model, inputs, mgr), want)
        result[mode] |= {
            "unsharded_offloaded": sorted({c.module for c in calls if c.probed}),
            "unsharded_bytes": sum(stored),
        }
    return result


def test_fsdp2_on_a_2d_mesh_unsharded_dtensor_parameters_stay(ranks: RankPool) -> None:
    """FSDP2 over tensor parallel (a ``(dp, tp)`` mesh): the unsharded parameters the norms and
    Linears save are DTensor Parameters (or their views), whose shards are plain views of
    FSDP2's all-gather outputs, freed after forward. They count as parameters, as on a 1-D mesh:
    none is copied (a deferred copy would read freed memory), gradients are bitwise the
    reference's and no collective is added."""
    modes = ("immediate", "min_memory", "budget")
    for rank, r in enumerate(ranks.run(_fsdp_tp_worker, modes)):
        for mode in modes:
            got = r[mode]
            where = check(rank, mode, got, r["want_comms"])
            assert got["unsharded_offloaded"] == [], f"{where}: {got}"
            assert got["unsharded_bytes"] == 0, f"{where}: {got}"
        # The profile records them as parameters too (the plan gives them no place): per block
        # 7 Linear weights and 2 norms' weight and bias, and the final norm's weight and bias.
        assert r["traced_parameters"] == 2 * (7 + 2 * 2) + 2, r["traced_parameters"]
