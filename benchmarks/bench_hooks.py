"""Per-saved-tensor overhead of the lifecycle recorder and the offload manager, against an identity
saved-tensor hook pair.

Run:
    python benchmarks/bench_hooks.py [--tensors 2000] [--repeats 31] [--out benchmarks/results/cpu]
        [--baseline-rev REV] [--rounds 5] [--workload mul|tanh]

Both variants run in the same process on the same workload: a chain of ``x * x`` ops on small
CPU tensors, each of which saves its input twice (so packs dominate and compute is tiny; the two
packs of one tensor are one alias family). ``--workload tanh`` runs a chain of ``torch.tanh``
instead, each of which saves its output once: a family per saved tensor, as most of a real model's
saved tensors are (written to ``hooks-tanh.json`` / ``.md``). The figure is (median time with
hooks - median time without hooks) / number of packs, for

* identity: ``saved_tensors_hooks(lambda t: t, lambda t: t)``, the floor any hook pays;
* recorder: ``lifecycle.Recorder`` recording a step (module hooks included), as ``offload.profile``
  uses it: its module hooks are attached once, before the steps (on a second instance of the
  same model, so that the other variants run without them), and each step is recorded;
* offload min-memory: ``offload.ActivationOffloader(model, tiers=("cpu",), min_offload_bytes=0)``
  (on a third instance), every saved tensor offloaded to the host tier and reloaded;
* offload budget: the same with ``gpu_budget`` (half the step's saved bytes) and a CPU hardware
  model, timed after its profiling and refinement steps: the plan keeps some records, offloads
  the others and starts their reloads at planned triggers;
* copies: no hooks, and a plain torch loop doing the copies the manager does (per alias family
  one copy out into a host buffer, one reload buffer allocated and copied into), on the same
  number of 64-byte tensors: the torch share of the manager's figure, which leaves its Python.

With tensors this small the copies cost little, so the figures are the hooks' Python time: what
a step pays on the compute thread when copies overlap compute (a GPU). The manager's own cost is
its figure less the identity pair's (and less the copies' for its Python alone). Writes
``hooks.json`` and ``hooks.md``.

``--baseline-rev REV`` then compares this tree with git revision ``REV`` (its own
``bench_hooks.py`` and package, from ``git archive``; for ``--workload tanh``, this tree's script
on ``REV``'s package, which older scripts cannot run): ``--rounds`` rounds, each running both in
fresh processes, in ABBA order, and reports the median of each figure above the identity pair
and the ratio this/REV per round (a machine whose speed drifts moves both sides of a round).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
from torch import nn

import offload
from offload.lifecycle import HardwareModel, Recorder


class _MulBlock(nn.Module):
    """``n`` multiplications ``x * x``: each saves x twice (two saved tensors, one family)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * x
        return x


class _TanhBlock(nn.Module):
    """``n`` tanh: each saves its output once (a family of its own)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.tanh(x)
        return x


# Each workload's block (``--workload``), and the saved tensors one op of it makes.
_BLOCKS: dict[str, tuple[type[nn.Module], int]] = {"mul": (_MulBlock, 2), "tanh": (_TanhBlock, 1)}


class Chain(nn.Module):
    """``blocks`` submodules of workload ``op``, each applying its op ``per_block`` times."""

    def __init__(self, blocks: int, per_block: int, op: str = "mul") -> None:
        super().__init__()
        block = _BLOCKS[op][0]
        self.blocks = nn.ModuleList(block(per_block) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _chain(workload: str, tensors: int) -> tuple[nn.Module, int]:
    """``workload``'s model for about ``tensors`` saved tensors a step (20 ops per block for
    mul, 40 for tanh), and its alias families (one per op)."""
    saves = _BLOCKS[workload][1]
    per_block = 40 // saves
    blocks = max(1, tensors // saves // per_block)
    return Chain(blocks, per_block, workload), blocks * per_block


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


# As the tests' FAST model: host copies at 5 GB/s, a disk at 1 GB/s (no disk tier here).
_CPU_HARDWARE = HardwareModel.cpu_only(
    copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9, source="assumed"
)


def workload(
    mode: str, kind: str = "mul"
) -> tuple[nn.Module, torch.Tensor, offload.ActivationOffloader, int]:
    """This benchmark's model (``kind``: "mul" or "tanh", as ``--workload``, 2,000 saved
    tensors) and input with a manager in ``mode`` ("min-memory" or "budget"), and how many
    steps it takes to reach its steady state (profile_hooks.py, count_hooks.py)."""
    if kind not in _WORKLOADS:
        raise ValueError(f"kind must be one of {sorted(_WORKLOADS)}; got {kind!r}")
    model, families = _chain(kind, 2000)
    x0 = torch.full((16,), 0.999, requires_grad=True)
    if mode == "min-memory":
        return model, x0, offload.ActivationOffloader(model, tiers=("cpu",), min_offload_bytes=0), 1
    if mode != "budget":
        raise ValueError(f"mode must be 'min-memory' or 'budget'; got {mode!r}")
    mgr = offload.ActivationOffloader(
        model, tiers=("cpu",), min_offload_bytes=0, gpu_budget=families * 64 // 2,
        hardware=_CPU_HARDWARE,
    )  # fmt: skip
    return model, x0, mgr, 4  # profile, first planned step, refinement, refined plan


def _manager_step(mgr: offload.ActivationOffloader, model: nn.Module, x: torch.Tensor) -> None:
    with mgr:
        loss = model(x).sum()
    loss.backward()


def _copy_loop(sources: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    """The manager's copies of one step, without it: per family one copy out into a host
    buffer, then (backward) a reload buffer, 4 KiB longer for the alignment, copied into."""
    for src, host in zip(sources, hosts, strict=True):
        host.copy_(src)
    for host in reversed(hosts):
        n = host.numel()
        raw = torch.empty(n + 4096, dtype=torch.uint8)
        raw[:n].copy_(host)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000, help="saved tensors per forward (even)")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu"))
    ap.add_argument("--baseline-rev", default=None, help="also compare with this git revision")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the comparison")
    ap.add_argument(
        "--workload",
        choices=("mul", "tanh"),
        default="mul",
        help="x * x (a tensor saved twice) or tanh (saved once)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1; got {args.rounds}")
    torch.set_num_threads(1)
    model, families = _chain(args.workload, args.tensors)
    x0 = torch.full((16,), 0.999, requires_grad=True)

    def plain() -> None:
        model(x0).sum().backward()

    def identity() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(x0).sum().backward()

    rec = Recorder()
    hooked = _chain(args.workload, args.tensors)[0]  # no parameters: the same model

    def recorder() -> None:
        with rec.hooks():
            rec.begin_step()
            hooked(x0).sum().backward()
            rec.end_step()

    mm_model = _chain(args.workload, args.tensors)[0]
    mm = offload.ActivationOffloader(mm_model, tiers=("cpu",), min_offload_bytes=0)
    bd_model = _chain(args.workload, args.tensors)[0]
    saved_bytes = families * x0.numel() * x0.element_size()  # one family per op
    bd = offload.ActivationOffloader(
        bd_model,
        tiers=("cpu",),
        min_offload_bytes=0,
        gpu_budget=saved_bytes // 2,
        hardware=_CPU_HARDWARE,
    )
    for _ in range(4):  # profile, first planned step (timed for refinement), refined plan
        _manager_step(bd, bd_model, x0)
    sources = [torch.full((16,), 0.999).view(torch.uint8) for _ in range(families)]
    hosts = [torch.empty_like(s) for s in sources]

    def min_memory() -> None:
        _manager_step(mm, mm_model, x0)

    def budget() -> None:
        _manager_step(bd, bd_model, x0)

    def copies() -> None:
        plain()
        _copy_loop(sources, hosts)

    # Count packs once, then warm up every variant, then interleave the timed runs.
    rec_count = Recorder()
    with rec_count.attach(model), rec_count.hooks():
        rec_count.begin_step()
        model(x0).sum().backward()
        rec_count.end_step()
    packs = len(rec_count.trace().records)
    variants = {
        "none": plain,
        "identity": identity,
        "recorder": recorder,
        "copies": copies,
        "offload_min_memory": min_memory,
        "offload_budget": budget,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with rec.attach(hooked):
        for fn in variants.values():
            fn()
        for _ in range(args.repeats):
            for k, fn in variants.items():
                times[k] += _time(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    mm_last, bd_last = mm.stats.last, bd.stats.last
    if bd.plan is None or bd_last.unplanned_records or bd_last.min_memory_steps:
        raise RuntimeError(f"the budget variant did not run its plan: {bd_last.as_dict()}")
    mm.close()
    bd.close()

    def per_tensor(a: str, b: str) -> float:
        return (med[a] - med[b]) / packs * 1e6

    stem = "hooks" if args.workload == "mul" else f"hooks-{args.workload}"
    result = {
        "benchmark": "bench_hooks",
        "workload": args.workload,
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
            "identity_hooks": per_tensor("identity", "none"),
            "recorder": per_tensor("recorder", "none"),
            "recorder_minus_identity": per_tensor("recorder", "identity"),
            "copies": per_tensor("copies", "none"),
            "offload_min_memory": per_tensor("offload_min_memory", "none"),
            "offload_min_memory_minus_identity": per_tensor("offload_min_memory", "identity"),
            "offload_min_memory_python": per_tensor("offload_min_memory", "identity")
            - per_tensor("copies", "none"),
            "offload_budget": per_tensor("offload_budget", "none"),
            "offload_budget_minus_identity": per_tensor("offload_budget", "identity"),
        },
        "offload": {
            "min_memory": {
                "records": mm_last.records,
                "families_offloaded": mm_last.records_offloaded_cpu,
                "records_kept": mm_last.records_kept,
            },
            "budget": {
                "gpu_budget_bytes": saved_bytes // 2,
                "records": bd_last.records,
                "families_offloaded": bd_last.records_offloaded_cpu,
                "records_kept": bd_last.records_kept,
            },
        },
        "target_us_per_tensor": 10.0,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=2)
    us = result["us_per_tensor"]
    md = [
        "# Saved-tensor hook overhead (benchmarks/bench_hooks.py)",
        "",
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, torch {torch.__version__}, "
        f"1 intra-op thread, CPU tensors. {packs} saved tensors per step ({_WORKLOADS[args.workload]}), "
        f"median of {args.repeats}.",
        "",
        "| variant | step time (ms) | overhead per saved tensor (us) |",
        "|---|---|---|",
        f"| no hooks | {med['none'] * 1e3:.2f} | - |",
        f"| identity saved_tensors_hooks | {med['identity'] * 1e3:.2f} | {us['identity_hooks']:.2f} |",
        f"| lifecycle.Recorder | {med['recorder'] * 1e3:.2f} | {us['recorder']:.2f} |",
        f"| copies alone (torch loop, no hooks) | {med['copies'] * 1e3:.2f} | {us['copies']:.2f} |",
        f"| offload, min-memory | {med['offload_min_memory'] * 1e3:.2f} "
        f"| {us['offload_min_memory']:.2f} |",
        f"| offload, budget (planned) | {med['offload_budget'] * 1e3:.2f} | {us['offload_budget']:.2f} |",
        "",
        f"Recorder cost above the identity pair: {us['recorder_minus_identity']:.2f} us per saved tensor "
        "(target <= 10 us).",
        "",
        "Offload manager (forward + backward, per saved tensor, above the identity pair): "
        f"min-memory {us['offload_min_memory_minus_identity']:.2f} us, of which the copies' torch "
        f"work {us['copies']:.2f} us and Python {us['offload_min_memory_python']:.2f} us (the manager's, "
        "and the host tier's CPU path, which a GPU run does not take); "
        f"{mm_last.records_offloaded_cpu} families offloaded for {mm_last.records} saved tensors "
        f"({_SAVES[args.workload]}). Budget "
        f"{us['offload_budget_minus_identity']:.2f} us (gpu_budget {saved_bytes // 2} bytes: "
        f"{bd_last.records_offloaded_cpu} families offloaded, {bd_last.records_kept} saved tensors "
        "kept).",
        "",
        "Targets above the identity pair: min-memory <= 20 us "
        f"({_verdict(us['offload_min_memory_minus_identity'], 20.0)}), budget <= 15 us "
        f"({_verdict(us['offload_budget_minus_identity'], 15.0)}).",
        "",
    ]
    if args.baseline_rev:
        result["baseline"] = compare(args)
        md += baseline_markdown(result["baseline"])
        with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
            json.dump(result, f, indent=2)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return result


_WORKLOADS = {"mul": "a chain of x * x", "tanh": "a chain of tanh"}
_SAVES = {"mul": "each mul saves its input twice", "tanh": "each tanh saves its output once"}


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else f"not met: {value / target:.1f} x the target"


_COMPARED = ("offload_min_memory_minus_identity", "offload_budget_minus_identity")


def compare(args: argparse.Namespace) -> dict:
    """This tree against ``args.baseline_rev``: each round runs both, ABBA, in new processes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.baseline_rev],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    here = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    # Whether the tracked files differ from HEAD (the report says so only then); the reports
    # this run wrote already before the comparison do not count.
    dirty = (
        subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root,
        ).returncode
        != 0
    )
    with tempfile.TemporaryDirectory(prefix="bench_hooks-") as tmp:
        old = os.path.join(tmp, rev)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev], cwd=root, capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(old, filter="tar")
        trees = {"this": root, "baseline": old}
        runs: dict[str, list[dict]] = {"this": [], "baseline": []}
        for r in range(args.rounds):
            order = ("this", "baseline") if r % 2 == 0 else ("baseline", "this")
            for side in order:
                out = os.path.join(tmp, f"{side}-{r}")
                env = dict(os.environ, PYTHONPATH=trees[side])
                # Each tree's own script for the default workload; this tree's script, on the
                # other tree's package, for another (revisions before the option lack it).
                script = trees[side] if args.workload == "mul" else root
                cmd = [sys.executable, os.path.join(script, "benchmarks", "bench_hooks.py")]
                cmd += ["--tensors", str(args.tensors), "--repeats", str(args.repeats)]
                if args.workload != "mul":
                    cmd += ["--workload", args.workload]
                done = subprocess.run(
                    [*cmd, "--out", out], cwd=trees[side], env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"bench_hooks.py failed on {'this tree' if side == 'this' else rev}: "
                        f"{done.stderr[-2000:]}"
                    )
                stem = "hooks" if args.workload == "mul" else f"hooks-{args.workload}"
                with open(os.path.join(out, f"{stem}.json")) as f:
                    runs[side].append(json.load(f)["us_per_tensor"])
            print(f"  comparison round {r + 1}/{args.rounds} done", flush=True)
    out: dict = {"rev": rev, "this_rev": here, "dirty": dirty, "rounds": args.rounds, "figures": {}}
    for key in ("identity_hooks", *_COMPARED):
        this = [run[key] for run in runs["this"]]
        base = [run[key] for run in runs["baseline"]]
        out["figures"][key] = {
            "this_median_us": statistics.median(this),
            "baseline_median_us": statistics.median(base),
            "ratio_median": statistics.median(a / b for a, b in zip(this, base, strict=True)),
            "this_us": this,
            "baseline_us": base,
        }
    return out


def baseline_markdown(cmp: dict) -> list[str]:
    names = {
        "identity_hooks": "identity pair (above no hooks)",
        "offload_min_memory_minus_identity": "offload, min-memory",
        "offload_budget_minus_identity": "offload, budget (planned)",
    }
    changes = ", with its working-tree changes" if cmp.get("dirty", True) else ""
    lines = [
        f"## Against {cmp['rev']}",
        "",
        f"This tree ({cmp['this_rev']}{changes}) and {cmp['rev']}, each "
        f"{cmp['rounds']} times in fresh processes, ABBA; us per saved tensor above the "
        "identity pair (the identity pair: above no hooks), medians, and the median of the "
        f"rounds' ratios this / {cmp['rev']}.",
        "",
        f"| figure | {cmp['rev']} (us) | this (us) | this / {cmp['rev']} |",
        "|---|---|---|---|",
    ]
    for key, row in cmp["figures"].items():
        lines.append(
            f"| {names[key]} | {row['baseline_median_us']:.2f} | {row['this_median_us']:.2f} "
            f"| {row['ratio_median']:.2f} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    main()
