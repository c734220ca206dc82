"""FSDP2 (``fully_shard``) and activation offloading, on 2 ranks.

    python examples/fsdp2_offload.py                       # spawns 2 processes itself
    torchrun --nproc-per-node 2 examples/fsdp2_offload.py

With a CUDA device per rank the ranks use NCCL and the GPUs; otherwise gloo on CPU with tiny
sizes (on CPU the parameters' device is the compute device, so the whole path runs).

Order of wrapping: build the model (on the meta device if it is large), ``parallelize_module``
first if there is tensor parallelism, then ``fully_shard`` on each block and on the root, set
FSDP2's prefetching, put the weights on their device (``to_empty`` + init, after meta), and make
the ``ActivationOffloader`` last, on the finished model. The manager reads the compute device and
the module tree when it is made (made on a meta or CPU model moved later, it would watch the
wrong device and move nothing); it re-reads the parameters' storages at every step, since FSDP2
swaps sharded and unsharded parameters.

What the manager does under FSDP2: Linear saves a view of its unsharded weight, whose storage
FSDP2 frees right after the block's forward (``reshard_after_forward``) and all-gathers again in
backward. Those views are weights to the manager (their base is a Parameter), so they are never
copied; only activations move. FSDP2's own forward and backward prefetches (set below) run as
they would without the manager, and it adds no collective.

Each rank trains a few steps twice from the same weights, without and with the manager, prints
its loss and what moved, and exits with status 1 if a local gradient shard differs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import offload

STEPS = 3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1, self.w3 = nn.Linear(dim, 4 * dim), nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def build(dim: int, device: torch.device, mesh) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and for both runs
    model = nn.Sequential(*(Block(dim) for _ in range(4)), nn.LayerNorm(dim)).to(device)
    blocks = list(model)[:-1]
    for block in blocks:
        fully_shard(block, mesh=mesh)  # each block: one all-gather, one reduce-scatter
    fully_shard(model, mesh=mesh)  # the root: the rest (the final norm)
    # Explicit prefetching: a block's forward all-gathers the next block's weights, its
    # backward the previous block's.
    for earlier, later in itertools.pairwise(blocks):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])
    return model


def train(model: nn.Module, batches, mgr=None) -> tuple[list[float], list[torch.Tensor]]:
    """SGD steps; the losses and, per step, this rank's local gradient shards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, grads = [], []
    for x in batches:
        opt.zero_grad()
        with mgr if mgr is not None else contextlib.nullcontext():  # one step: forward inside
            loss = model(x).float().pow(2).mean()
        loss.backward()  # FSDP2 reduce-scatters the gradients into sharded DTensors
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
        # Data parallel: each rank its own batches.
        gen = torch.Generator().manual_seed(1 + rank)
        batches = [torch.randn(batch, seq, dim, generator=gen).to(device) for _ in range(STEPS)]

        want_losses, want = train(build(dim, device, mesh), batches)

        model = build(dim, device, mesh)  # sharded first ...
        mgr = offload.ActivationOffloader(model, min_offload_bytes=0)  # ... then the manager
        losses, got = train(model, batches, mgr)
        moved = mgr.stats.last
        mgr.close()

        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        print(
            f"rank {rank} ({device}): loss {losses[-1]:.6f} (reference {want_losses[-1]:.6f}); "
            f"last step moved {moved.bytes_offloaded_cpu / 2**20:.2f} MiB off the device in "
            f"{moved.records_offloaded_cpu} saved tensors ({moved.stalls} reload stalls), "
            f"kept {moved.records_kept} (weights, unsharded ones included); "
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
