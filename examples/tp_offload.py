"""Tensor parallel (with sequence parallel) and activation offloading, on 2 ranks.

    python examples/tp_offload.py                       # spawns 2 processes itself
    torchrun --nproc-per-node 2 examples/tp_offload.py

With a CUDA device per rank the ranks use NCCL and the GPUs; otherwise gloo on CPU with tiny
sizes (on CPU the parameters' device is the compute device, so the whole path runs).

Order of wrapping: build the model, put it on its device, parallelise it (``parallelize_module``;
``fully_shard`` next, for 2-D), and make the ``ActivationOffloader`` last, on the finished model.
The manager reads the compute device and the module tree when it is made (a manager made on a
model later moved off the meta device or the CPU would watch the wrong device and move nothing);
it re-reads the parameters' storages at every step. Nothing else changes: pack receives DTensors,
the manager moves each rank's local shard and rebuilds the DTensor on reload with
``DTensor.from_local(..., run_check=False, shape=, stride=)``, so no collective is added.

Each rank trains a few steps twice from the same weights, without and with the manager, prints
its loss and what moved, and exits with status 1 if a local gradient shard differs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import offload

STEPS = 3


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 4 * dim), nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.ffn = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


def build(dim: int, device: torch.device, mesh) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and for both runs
    model = nn.Sequential(*(Block(dim) for _ in range(4))).to(device)
    for block in model:
        # torchtitan's plan: the norm runs on sequence shards (Shard(1)); its output is
        # all-gathered for the column-wise w1 and w3, and w2's row-wise partial sums are
        # reduce-scattered back to sequence shards.
        parallelize_module(
            block,
            mesh,
            {
                "norm": SequenceParallel(),
                "ffn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def train(model: nn.Module, batches, mgr=None) -> tuple[list[float], list[torch.Tensor]]:
    """SGD steps; the losses and, per step, this rank's local gradient shards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, grads = [], []
    for x in batches:
        opt.zero_grad()
        with mgr if mgr is not None else contextlib.nullcontext():  # one step: forward inside
            loss = model(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads += [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
    return losses, grads


def run(rank: int, world_size: int, init_method: str) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:  # bitwise comparison needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size
    )
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        dim, batch, seq = (1024, 4, 2048) if cuda else (64, 2, 32)
        # Sequence parallel: each rank feeds its slice of the sequence.
        gen = torch.Generator().manual_seed(1)
        batches = [
            torch.randn(batch, seq, dim, generator=gen).chunk(world_size, dim=1)[rank].to(device)
            for _ in range(STEPS)
        ]

        want_losses, want = train(build(dim, device, mesh), batches)

        model = build(dim, device, mesh)  # parallelised first ...
        mgr = offload.ActivationOffloader(model, min_offload_bytes=0)  # ... then the manager
        losses, got = train(model, batches, mgr)
        moved = mgr.stats.last
        mgr.close()

        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        print(
            f"rank {rank} ({device}): loss {losses[-1]:.6f} (reference {want_losses[-1]:.6f}); "
            f"last step moved {moved.bytes_offloaded_cpu / 2**20:.2f} MiB off the device in "
            f"{moved.records_offloaded_cpu} saved tensors ({moved.stalls} reload stalls); "
            f"gradients {'bitwise equal' if same else 'DIFFER'}\n",
            end="",  # one write, newline included: the ranks share stdout
            flush=True,
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not same:
        sys.exit(1)


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
        return
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(run, args=(2, f"file://{d}/rendezvous"), nprocs=2)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            sys.exit(f"a rank failed: {e}")


if __name__ == "__main__":
    main()
