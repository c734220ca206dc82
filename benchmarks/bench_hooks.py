"""Per-saved-tensor overhead of the lifecycle recorder, against an identity saved-tensor hook pair.

Run:
    python benchmarks/bench_hooks.py [--tensors 2000] [--repeats 31] [--out benchmarks/results]

Both variants run in the same process on the same workload: a chain of ``torch.mul`` ops on small
CPU tensors, each of which saves its two inputs (so packs dominate and compute is tiny). The figure
is (median time with hooks - median time without hooks) / number of packs, for

* identity: ``saved_tensors_hooks(lambda t: t, lambda t: t)``, the floor any hook pays;
* recorder: ``lifecycle.Recorder`` recording a step (module hooks included), as ``offload.profile``
  uses it: its module hooks are attached once, before the steps (on a second instance of the
  same model, so that the other variants run without them), and each step is recorded.

The recorder's own cost is the difference of the two. Writes ``hooks.json`` and ``hooks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from lifecycle import Recorder


class MulChain(nn.Module):
    """``blocks`` submodules, each doing ``per_block`` multiplications (2 saved tensors each)."""

    def __init__(self, blocks: int, per_block: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MulBlock(per_block) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _MulBlock(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * x
        return x


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000, help="saved tensors per forward (even)")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    muls = args.tensors // 2
    model = MulChain(blocks=max(1, muls // 20), per_block=20)
    x0 = torch.full((16,), 0.999, requires_grad=True)

    def plain() -> None:
        model(x0).sum().backward()

    def identity() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(x0).sum().backward()

    rec = Recorder()
    hooked = MulChain(blocks=max(1, muls // 20), per_block=20)  # no parameters: the same model

    def recorder() -> None:
        with rec.hooks():
            rec.begin_step()
            hooked(x0).sum().backward()
            rec.end_step()

    # Count packs once, then warm up every variant, then interleave the timed runs.
    rec_count = Recorder()
    with rec_count.attach(model), rec_count.hooks():
        rec_count.begin_step()
        model(x0).sum().backward()
        rec_count.end_step()
    packs = len(rec_count.trace().records)
    variants = {"none": plain, "identity": identity, "recorder": recorder}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with rec.attach(hooked):
        for fn in variants.values():
            fn()
        for _ in range(args.repeats):
            for k, fn in variants.items():
                times[k] += _time(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "bench_hooks",
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "packs_per_step": packs,
        "median_step_s": med,
        "us_per_tensor": {
            "identity_hooks": (med["identity"] - med["none"]) / packs * 1e6,
            "recorder": (med["recorder"] - med["none"]) / packs * 1e6,
            "recorder_minus_identity": (med["recorder"] - med["identity"]) / packs * 1e6,
        },
        "target_us_per_tensor": 10.0,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hooks.json"), "w") as f:
        json.dump(result, f, indent=2)
    us = result["us_per_tensor"]
    md = [
        "# Saved-tensor hook overhead (benchmarks/bench_hooks.py)",
        "",
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, torch {torch.__version__}, "
        f"1 intra-op thread, CPU tensors. {packs} saved tensors per step, median of {args.repeats}.",
        "",
        "| variant | step time (ms) | overhead per saved tensor (us) |",
        "|---|---|---|",
        f"| no hooks | {med['none'] * 1e3:.2f} | - |",
        f"| identity saved_tensors_hooks | {med['identity'] * 1e3:.2f} | {us['identity_hooks']:.2f} |",
        f"| lifecycle.Recorder | {med['recorder'] * 1e3:.2f} | {us['recorder']:.2f} |",
        "",
        f"Recorder cost above the identity pair: {us['recorder_minus_identity']:.2f} us per saved tensor "
        "(target <= 10 us).",
        "",
    ]
    with open(os.path.join(args.out, "hooks.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return result


if __name__ == "__main__":
    main()
