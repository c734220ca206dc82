"""Pipeline parallel: ``mgr.attach(schedule)`` under GPipe, 1F1B, interleaved 1F1B and
interleaved zero-bubble, on 2 gloo processes: gradients bitwise equal to the same pipeline
without offloading, and the stashed microbatches' bytes left the device."""

from __future__ import annotations

import os
import queue
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
MICROBATCHES = 4
WIDTH = 64
TIMEOUT_S = 90

pytestmark = pytest.mark.distributed


def _stage_module(index: int) -> torch.nn.Module:
    torch.manual_seed(100 + index)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )


def _run(rank: int, schedule_name: str, offloaded: bool) -> tuple[dict, dict]:
    from torch.distributed import pipelining as pp

    import offload

    multi = schedule_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
    n_stages = 2 * WORLD if multi else WORLD
    indices = [rank, rank + WORLD] if multi else [rank]
    modules = {i: _stage_module(i) for i in indices}
    stages = [pp.PipelineStage(modules[i], i, n_stages, torch.device("cpu")) for i in indices]
    cls = getattr(pp, schedule_name)
    loss_fn = lambda out, target: (out - target).pow(2).mean()  # noqa: E731
    schedule = cls(stages if multi else stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    managers = []
    handles = []
    if offloaded:
        for i in indices:
            mgr = offload.ActivationOffloader(modules[i], min_offload_bytes=0)
            managers.append(mgr)
        # One manager per stage module; a schedule with several stages on this rank gets each
        # stage attached to its own module's manager.
        for mgr, stage in zip(managers, stages, strict=True):
            handles.append(mgr.attach(stage))
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(MICROBATCHES * 4, WIDTH, generator=gen)
        y = torch.randn(MICROBATCHES * 4, WIDTH, generator=gen)
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        has_first = 0 in indices
        has_last = n_stages - 1 in indices
        if has_first and has_last:
            schedule.step(x, target=y)
        elif has_first:
            schedule.step(x)
        elif has_last:
            schedule.step(target=y)
        else:
            schedule.step()
    grads = {
        f"{i}.{n}": p.grad.clone()
        for i, m in modules.items()
        for n, p in m.named_parameters()
        if p.grad is not None
    }
    stats = {}
    for h in handles:
        h.detach()
    for i, mgr in zip(indices, managers, strict=False):
        stats[i] = mgr.stats.total.as_dict()
        mgr.close()
    restored = all(
        "forward_one_chunk" not in s.__dict__ and "backward_one_chunk" not in s.__dict__
        for s in stages
    )
    stats["restored"] = restored
    return grads, stats


SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
)


def _worker(rank: int, init_file: str, out: mp.SimpleQueue) -> None:
    # One pair of processes runs every schedule: spawning and importing torch is most of the
    # time of such a test on 2 cores.
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for name in SCHEDULES:
            try:
                want, _ = _run(rank, name, offloaded=False)
                got, stats = _run(rank, name, offloaded=True)
                same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
                out.put((name, rank, same, sorted(want), stats, None))
            except Exception:
                out.put((name, rank, False, [], {}, traceback.format_exc()))
                raise
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[tuple]]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    init_file = os.path.join(tmp_path_factory.mktemp("pp"), "pg_init")
    procs = mp.start_processes(
        _worker, args=(init_file, q), nprocs=WORLD, join=False, start_method="spawn"
    )
    out: dict[str, list[tuple]] = {}
    try:
        for _ in range(WORLD * len(SCHEDULES)):
            name, *rest = _get(q, TIMEOUT_S)
            out.setdefault(name, []).append(tuple(rest))
            if rest[-1] is not None:
                break  # a rank failed: its peer may be stuck; report what we have
    finally:
        for p in procs.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


def _get(q: mp.SimpleQueue, timeout: float):
    # SimpleQueue has no timeout: poll its reader.
    if not q._reader.poll(timeout):  # type: ignore[attr-defined]
        raise queue.Empty(f"no result from a rank within {timeout} s (a rank hung or died)")
    return q.get()


@pytest.mark.parametrize("schedule_name", SCHEDULES)
def test_pipeline_schedules_bitwise_with_offloaded_microbatches(schedule_name, results) -> None:
    got = sorted(results.get(schedule_name, []), key=lambda r: r[0])
    for rank, *_, error in got:
        assert error is None, f"rank {rank}:\n{error}"
    assert len(got) == WORLD, f"{schedule_name}: results from {len(got)} of {WORLD} ranks"
    for rank, same, names, stats, _ in got:
        assert names, f"rank {rank} has no gradients"
        assert same, f"rank {rank}: gradients differ from the pipeline without offloading"
        assert stats.pop("restored"), f"rank {rank}: detach() left wrapped stage methods"
        for stage, s in stats.items():
            # 2 steps x 4 microbatches, each with its forward activations offloaded: a
            # [16/4=4, 128] GELU input and output, and the two Linear inputs at least.
            per_mb = 4 * (WIDTH + 2 * WIDTH + 2 * WIDTH) * 4
            assert s["bytes_offloaded_cpu"] >= 2 * MICROBATCHES * per_mb, (stage, s)
            assert s["steps"] == 2 * MICROBATCHES, (stage, s)


def test_attach_rejects_other_objects_and_budgets() -> None:
    import offload

    model = torch.nn.Linear(4, 4)
    mgr = offload.ActivationOffloader(model)
    with pytest.raises(TypeError, match="PipelineStage"):
        mgr.attach(model)
    mgr.close()
    from lifecycle import HardwareModel

    hw = HardwareModel.cpu_only(
        copy_bytes_per_s=1e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    mgr = offload.ActivationOffloader(model, gpu_budget="1MiB", hardware=hw)

    class FakeStage:
        stage_index = 0

        def forward_one_chunk(self, *a): ...
        def backward_one_chunk(self, *a): ...
        def backward_weight_one_chunk(self, *a): ...

    with pytest.raises(offload.OffloadError, match="min-memory"):
        mgr.attach(FakeStage())
    mgr.close()
