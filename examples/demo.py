"""The README demo: profile a small GPT's training step, plan it under a budget, train with it.

    python examples/demo.py [--steps 20] [--out offload-demo] [--tiers cpu|nvme|cpu,nvme]
                            [--budget-share 0.5]

What it does, in order:
1. builds the GPT from ``gpt.py`` and a synthetic next-token task (``train_gpt.py``'s Markov chain);
2. ``offload.profile`` records one training step after one warm-up step: every tensor autograd
   saves, the module that saved it, its bytes, when it was packed and when backward used it;
3. prints the trace's summary and writes ``trace.json``, a Perfetto trace and ``memory.png``
   into ``--out``;
4. ``offload.plan`` plans the step for a budget of the memory at the step's start plus
   ``--budget-share`` of its saved activations (on CPU the budget bounds the live saved bytes),
   with this machine's measured copy and disk speeds, and prints the plan next to the anchors
   (keep everything, offload everything as the manager's min-memory mode does, checkpoint every
   block): what running each of them instead would hold and take, and each one's step time
   over keeping everything's (``x keep all``);
5. trains for ``--steps`` steps with ``offload.ActivationOffloader(model, gpu_budget=...)``: its
   first step is profiled (everything offloaded), the later ones carry out its own plan; checks
   that a planned step's gradients are bitwise equal to the same step without offload, and
   prints the loss, what moved, and the peak measured beside the predicted one (on CUDA the
   allocator's peak; on CPU the saved bytes the manager held, which the budget bounds there).

On a CPU-only machine the CPU stands in for the device: the demo exercises the whole path
(profile, plan, copies out and reloads, bitwise gradients) but its "offloaded" bytes go from host
memory to host memory, so it saves no memory; on a CUDA device the same run frees GPU memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import MarkovChain  # noqa: E402

import offload  # noqa: E402
from offload._live import SavedBytes  # noqa: E402  (CPU: no allocator reports a peak)
from offload.lifecycle import write_memory_png, write_perfetto  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=20, help="training steps after profiling (default 20)"
    )
    ap.add_argument(
        "--out", default="offload-demo", help="where trace files go (default ./offload-demo)"
    )
    ap.add_argument("--tiers", default="cpu", help="offload tiers, comma separated (default cpu)")
    ap.add_argument(
        "--budget-share",
        type=float,
        default=0.5,
        help="budget = memory at the step's start + this share of its saved activations "
        "(default 0.5)",
    )
    args = ap.parse_args(argv)
    if not 0 < args.budget_share <= 1:
        ap.error(f"--budget-share must be in (0, 1]; got {args.budget_share}")
    tiers = tuple(t for t in args.tiers.split(",") if t)
    if args.steps < 0:
        ap.error(f"--steps must be >= 0; got {args.steps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)
    model = GPT(cfg, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    chain = MarkovChain(cfg.vocab_size, seed=0)
    gen = torch.Generator().manual_seed(1)

    def train_step() -> float:
        tokens = chain.sample(16, cfg.seq_len + 1, gen).to(device)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    print(f"offload demo: GPT with {model.num_parameters() / 1e6:.2f}M parameters on {device}")
    if device.type == "cpu":
        print(_CPU_NOTE)
    t0 = time.perf_counter()
    trace = offload.profile(train_step, model, warmup_steps=1)
    print(f"profiled in {time.perf_counter() - t0:.2f} s (one warm-up step, then one recorded)\n")
    print(trace.summary())
    os.makedirs(args.out, exist_ok=True)
    trace.save(os.path.join(args.out, "trace.json"))
    write_perfetto(trace, os.path.join(args.out, "trace.perfetto.json"))
    written = ["trace.json", "trace.perfetto.json"]
    try:
        write_memory_png(trace, os.path.join(args.out, "memory.png"))
        written.append("memory.png")
    except ImportError as e:
        print(f"(no PNG: {e})")
    print(f"\nwrote {', '.join(written)} into {args.out}/\n")

    nvme_dir = None
    if "nvme" in tiers:
        nvme_dir = os.path.join(args.out, "nvme")
        os.makedirs(nvme_dir, exist_ok=True)
    base = trace.events[0].memory_bytes
    budget = base + int(args.budget_share * (trace.peak_memory_bytes - base))
    hardware = offload.probe_hardware(device=device, nvme_dir=nvme_dir)
    # Saved tensors of this small model are tens of KiB to a few MiB: plan all of them.
    plan = offload.plan(trace, budget, hardware, tiers=tiers, min_offload_bytes=0)
    print(plan.summary(top=6))
    print(
        "  (peak: the most device memory the step holds, on CPU the saved activations the "
        "budget bounds; step: predicted step time; x keep all: that time over keeping "
        "everything on the device, 1.000 as fast, 1.250 25% slower)\n"
    )

    mgr = offload.ActivationOffloader(
        model,
        gpu_budget=budget,
        hardware=hardware,
        tiers=tiers,
        nvme_dir=nvme_dir,
        min_offload_bytes=0,
    )
    with contextlib.closing(mgr):
        # Exactness: the same batch and weights, twice with the manager (its profiling step,
        # then a planned step) and once without; the planned step's gradients must be equal.
        tokens = chain.sample(16, cfg.seq_len + 1, gen).to(device)
        grads = []
        for use in (True, True, False):
            opt.zero_grad(set_to_none=True)
            with mgr if use else contextlib.nullcontext():
                loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        same = all(torch.equal(a, b) for a, b in zip(grads[1], grads[2], strict=True))
        print(f"planned step's gradients bitwise equal to no offloading: {'yes' if same else 'NO'}")

        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with SavedBytes.on(mgr) as meter:  # the planned steps' saved bytes held on the device
            for step in range(1, args.steps + 1):
                tokens = chain.sample(16, cfg.seq_len + 1, gen).to(device)
                opt.zero_grad(set_to_none=True)
                with mgr:  # one step: forward inside, backward after
                    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                opt.step()
                if step % 10 == 0 or step == args.steps:
                    print(f"step {step:4d}  loss {loss.item():.4f}")
        if args.steps:
            print(
                f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s under a "
                f"{budget / 2**20:.2f} MiB budget, offloading to {'+'.join(tiers)}"
            )
        last = mgr.stats.last
        moved = last.bytes_offloaded_cpu + last.bytes_offloaded_nvme
        print(
            f"per step: {moved / 2**20:.2f} MiB of saved activations left the device "
            f"({last.records_offloaded_cpu + last.records_offloaded_nvme} stored once each, "
            f"{last.records_deduplicated} aliases deduplicated), "
            f"{last.bytes_rebuilt / 2**20:.2f} MiB rebuilt from their inputs "
            f"({last.records_rebuilt} records), "
            f"{last.bytes_recomputed / 2**20:.2f} MiB recomputed, {last.records_kept} kept "
            "(parameters included), "
            f"{last.reloads} reloads, {last.stalls} unprefetched, "
            f"{last.unplanned_records} unplanned"
        )
        if args.steps:
            measured, what = (
                (torch.cuda.max_memory_allocated(device), "device memory allocated (CUDA peak)")
                if device.type == "cuda"
                else (meter.peak_planned, "saved activations held on the device")
            )
            print(
                f"measured peak: {measured / 2**20:.2f} MiB of {what}, against a predicted "
                f"peak of {last.predicted_peak_bytes / 2**20:.2f} MiB and a budget of "
                f"{budget / 2**20:.2f} MiB"
            )
        if device.type == "cpu":
            print(_CPU_NOTE)
    return 0 if same else 1


_CPU_NOTE = (
    "(no CUDA device: the CPU stands in for it, so this run exercises the whole path but saves "
    "no memory: the offloaded bytes go from host memory to host memory)"
)


if __name__ == "__main__":
    sys.exit(main())
