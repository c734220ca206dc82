"""Pipeline parallel with offloaded microbatch activations (torch.distributed.pipelining).

    torchrun --nproc-per-node 2 examples/pipeline_offload.py [--schedule 1F1B] [--microbatches 8]
        [--gpu-budget 50%]
    python examples/pipeline_offload.py            # spawns 2 gloo processes itself on CPU

Each rank holds one stage (or two, for the interleaved schedules) of a small MLP stack. The same
schedule runs twice from the same weights and inputs: without offloading, then with an
``offload.ActivationOffloader`` per stage module attached to its stage (``mgr.attach(stage)``):
every forward chunk's saved tensors leave the device and come back before that microbatch's
backward chunk. Each rank prints what moved and exits nonzero if its gradients differ.

``--gpu-budget P%``: the rank's first stage instead gets a manager with a budget of P% of the
saved bytes the rank holds at most without offloading (profiled in the run without it): its first
schedule step is profiled, the next ones run the plan, in which each microbatch's tensors wait
where its wait for the backward allows (stage 0 of 1F1B stashes the most). Other stages of the
rank run in min-memory mode. On CPU the budget counts saved bytes only (no allocator); on GPUs it
bounds the whole device, so a budget of a share of the saved bytes would be infeasible there:
give an absolute budget (``--gpu-budget 6GiB``) under torchrun.

Order of wrapping: build the stage (and any tensor-parallel / FSDP2 wrapping of its module)
first, then the manager on the stage's module, then ``attach``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import offload
from offload.lifecycle._units import parse_bytes

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


def stage_module(index: int, width: int) -> nn.Module:
    torch.manual_seed(1000 + index)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def run(
    rank: int,
    world: int,
    args: argparse.Namespace,
    device: torch.device,
    offloaded: bool,
    stage_peak: int = 0,
):
    from torch.distributed import pipelining as pp

    multi = args.schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
    n_stages = 2 * world if multi else world
    indices = [rank, rank + world] if multi else [rank]
    modules = {i: stage_module(i, args.width).to(device) for i in indices}
    stages = [pp.PipelineStage(modules[i], i, n_stages, device) for i in indices]
    schedule = getattr(pp, f"Schedule{args.schedule}")(
        stages if multi else stages[0],
        n_microbatches=args.microbatches,
        loss_fn=lambda out, target: (out - target).pow(2).mean(),
    )
    managers = []
    if offloaded:
        for n, (stage, i) in enumerate(zip(stages, indices, strict=True)):
            budget = (
                stage_budget(args.gpu_budget, stage_peak) if n == 0 and args.gpu_budget else None
            )
            mgr = offload.ActivationOffloader(modules[i], min_offload_bytes=0, gpu_budget=budget)
            mgr.attach(stage)
            managers.append(mgr)
    gen = torch.Generator().manual_seed(0)
    first, last = 0 in indices, n_stages - 1 in indices
    saved_peak = 0
    for n in range(args.steps):
        x = torch.randn(args.microbatches * 8, args.width, generator=gen).to(device)
        y = torch.randn(args.microbatches * 8, args.width, generator=gen).to(device)
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        kwargs = {"target": y} if last else {}

        def step() -> None:
            if first:
                schedule.step(x, **kwargs)  # noqa: B023 (runs within this iteration)
            else:
                schedule.step(**kwargs)  # noqa: B023

        if n == 0 and not offloaded and args.gpu_budget:
            # What the rank's stages save at most in one schedule step, kept: the base of
            # --gpu-budget P% (recorded on the first stage's module; packs of a second stage of
            # the rank count too, as "<outside>" records).
            saved_peak = offload.profile(step, modules[indices[0]], warmup_steps=0).peak_saved_bytes
        else:
            step()
    grads = [p.grad.clone() for m in modules.values() for p in m.parameters()]
    moved = sum(mgr.stats.total.bytes_offloaded_cpu for mgr in managers)
    plan = managers[0].plan if managers else None
    for mgr in managers:
        mgr.close()
    return grads, moved, plan, saved_peak


def check_budget(ap: argparse.ArgumentParser, arg: str) -> None:
    """``--gpu-budget`` is "P%" with 0 < P <= 100, or a size; else a usage error."""
    if not arg.endswith("%"):
        try:
            parse_bytes(arg, name="--gpu-budget")
        except ValueError as e:
            ap.error(str(e))
        return
    try:
        share = float(arg[:-1])
    except ValueError:
        ap.error(f"--gpu-budget={arg!r} is neither a share (50%) nor a size (6GiB)")
    if not 0 < share <= 100:
        ap.error(f"--gpu-budget must be a share in (0%, 100%] or a size; got {arg!r}")


def stage_budget(arg: str, stage_peak: int) -> str | int:
    """``--gpu-budget``: "P%" of this stage's saved peak, or an absolute size ("6GiB")."""
    if arg.endswith("%"):
        return int(float(arg[:-1]) / 100 * stage_peak)
    return arg


def worker(rank: int, world: int, args: argparse.Namespace, init: str | None) -> int:
    # NCCL needs a GPU of its own per rank ("Duplicate GPU detected" otherwise): with fewer GPUs
    # than local ranks (the 2 spawned processes on a 1-GPU machine) the ranks run on CPU + gloo.
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    backend = "nccl" if cuda else "gloo"
    if init is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        want, _, _, stage_peak = run(rank, world, args, device, offloaded=False)
        got, moved, plan, _ = run(rank, world, args, device, offloaded=True, stage_peak=stage_peak)
        same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        planned = ""
        if plan is not None:
            by = plan.bytes_by_placement()
            planned = (
                f"; stage plan for a budget of {plan.gpu_budget_bytes / 2**20:.2f} MiB: predicted "
                f"peak {plan.predicted_peak_bytes / 2**20:.2f} MiB (keeping all: "
                f"{plan.anchors['keep_all'].peak_bytes / 2**20:.2f} MiB), kept "
                f"{by['keep'] / 2**20:.2f} MiB, moved {(sum(by.values()) - by['keep']) / 2**20:.2f} MiB"
            )
        # One write, newline included: the ranks share stdout, and unbuffered (PYTHONUNBUFFERED)
        # print's separate newline could land after the other rank's line.
        print(
            f"rank {rank}: {args.schedule}, {args.microbatches} microbatches x {args.steps} steps: "
            f"{moved / 2**20:.2f} MiB of saved activations left {device}{planned}; gradients "
            f"bitwise equal to no offloading: {'yes' if same else 'NO'}\n",
            end="",
            flush=True,
        )
        return 0 if same else 1
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    torch.set_num_threads(1)
    if worker(rank, world, args, init):
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument(
        "--gpu-budget",
        default=None,
        help="budget for the rank's first stage: P%% of its kept saved peak, or a size (6GiB)",
    )
    args = ap.parse_args(argv)
    if args.gpu_budget is not None:
        check_budget(ap, args.gpu_budget)  # before any process starts
    if "RANK" in os.environ:  # torchrun
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_spawned, args=(2, args, f"file://{d}/pg_init"), nprocs=2, join=True)
        except mp.ProcessExitedException:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
