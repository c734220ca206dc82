"""Where the offload manager's hook time goes, per function: bench_hooks' workload under cProfile.

Run:
    python benchmarks/profile_hooks.py [--mode min-memory|budget] [--steps 10] [--top 25]
        [--workload mul|tanh]

Runs ``benchmarks/bench_hooks.py``'s model (2,000 saved tensors per step in 1,000 alias families;
``--workload tanh``: in 2,000) through ``offload.ActivationOffloader`` in min-memory mode or under
its planned budget (after the profiling and refinement steps), profiles ``--steps`` steps, and
prints per function its share of
the profiled time spent inside it (``tottime``), its calls per saved tensor, and the Python
function calls per saved tensor in all. cProfile adds a fixed cost to every call, so the shares
lean towards functions called often; the call counts are exact, and the same on any machine.
``--json PATH`` also writes the rows. bench_hooks.py gives the timings.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_hooks


def _label(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a builtin: {method 'copy_' of ...}
    parts = path.replace(os.sep, "/").split("/")
    for root in ("offload", "torch", "benchmarks"):
        if root in parts:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
            break
    return f"{path}:{line}({name})"


# Stages of the manager's work, as the inclusive (cumulative) share of the functions that enter
# them: (label, file, function name).
# Each stage: its label, the file, and the functions whose inclusive times add up to it (entry
# points that never call one another).
STAGES = (
    ("pack hook", "offload/_hooks.py", ("_pack",)),
    ("unpack hook", "offload/_hooks.py", ("_unpack",)),
    ("member released (finalizer)", "offload/_family.py", ("__del__",)),
    ("cpu tier write", "offload/storage/_host_tier.py", ("write",)),
    ("cpu tier read", "offload/storage/_host_tier.py", ("read",)),
    ("host pool allocate", "offload/storage/_pool.py", ("allocate",)),
    ("look-ahead (per unpack and trigger)", "offload/_lookahead.py", ("prefetch", "after_unpack")),
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("min-memory", "budget"), default="min-memory")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--workload", choices=("mul", "tanh"), default="mul", help="as bench_hooks'")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, x0, mgr, _ = bench_hooks.workload(args.mode, args.workload)
    for _ in range(5):  # profile, refinement (budget), then steady steps
        bench_hooks._manager_step(mgr, model, x0)
    packs = mgr.stats.last.records
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        bench_hooks._manager_step(mgr, model, x0)
    prof.disable()
    mgr.close()
    stats = pstats.Stats(prof)
    saved = packs * args.steps
    rows = []
    total = 0.0
    python_calls = 0
    for func, (_, ncalls, tottime, _cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if func[0] != "~":
            python_calls += ncalls
        rows.append((tottime, ncalls, _label(func)))
    rows.sort(reverse=True)
    stages = {}
    for label, path, names in STAGES:
        cum = sum(
            c
            for (fpath, _, fname), (_, _, _, c, _) in stats.stats.items()  # type: ignore[attr-defined]
            if fname in names and fpath.replace(os.sep, "/").endswith(path)
        )
        stages[label] = cum / total
    out = {
        "mode": args.mode,
        "saved_tensors_per_step": packs,
        "steps": args.steps,
        "python_calls_per_saved_tensor": python_calls / saved,
        "stages": stages,
        "functions": [
            {"function": name, "share": t / total, "calls_per_saved_tensor": n / saved}
            for t, n, name in rows[: args.top]
        ],
    }
    print(
        f"{args.mode}: {packs} saved tensors per step, {args.steps} steps profiled; "
        f"{out['python_calls_per_saved_tensor']:.1f} Python function calls per saved tensor"
    )
    for label, share in stages.items():
        print(f"{share * 100:5.1f}%  {label} (inclusive)")
    print(f"{'share':>6}  {'calls/tensor':>12}  function")
    for row in out["functions"]:
        print(
            f"{row['share'] * 100:5.1f}%  {row['calls_per_saved_tensor']:12.2f}  {row['function']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
