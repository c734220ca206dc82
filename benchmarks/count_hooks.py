"""Instructions the saved-tensor hooks execute per saved tensor, counted by valgrind (callgrind).

Run (needs ``valgrind``; about 5 minutes per mode on 2 cores):
    python benchmarks/count_hooks.py [--mode min-memory|budget|identity] [--workload mul|tanh]

A count does not depend on how busy the machine is, so two commits compare exactly where timings
on a shared machine drift. bench_hooks.py's workload (2,000 saved tensors per step) runs under
``valgrind --tool=callgrind`` collecting only inside torch's calls of the pack and unpack hooks
and the destructor that drops a packed handle (``PySavedVariableHooks``: the manager's pack,
unpack and member release, whatever they call); twice, with 1 and with 3 measured steps after the
warm-up, so that the difference is two steady steps' worth. Prints the instructions per step and
per saved tensor. ``--workload`` as bench_hooks.py's (``tanh``: a family per saved tensor).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_HOOKS = "torch::autograd::PySavedVariableHooks::"
_TOGGLES = (
    f"{_HOOKS}call_pack_hook*",
    f"{_HOOKS}call_unpack_hook*",
    f"{_HOOKS}~PySavedVariableHooks*",
)


def _workload(mode: str, steps: int, kind: str = "mul") -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_hooks

    torch.set_num_threads(1)
    if mode == "identity":
        model = bench_hooks._chain(kind, 2000)[0]
        x0 = torch.full((16,), 0.999, requires_grad=True)
        mgr, warm = None, 1
    else:
        model, x0, mgr, warm = bench_hooks.workload(mode, kind)
    for _ in range(warm + steps):
        if mgr is None:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                model(x0).sum().backward()
        else:
            bench_hooks._manager_step(mgr, model, x0)


def _count(mode: str, steps: int, kind: str = "mul") -> int:
    with tempfile.TemporaryDirectory(prefix="count_hooks-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        cmd += [f"--toggle-collect={t}" for t in _TOGGLES]
        cmd += [sys.executable, os.path.abspath(__file__), "--run", mode, str(steps), kind]
        subprocess.run(cmd, check=True, capture_output=True)
        with open(out) as f:
            found = re.search(r"^summary: (\d+)", f.read(), re.M)
    if found is None:
        raise RuntimeError("callgrind wrote no summary")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run"]:
        _workload(argv[1], int(argv[2]), argv[3] if len(argv) > 3 else "mul")
        return {}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("min-memory", "budget", "identity"), default="min-memory")
    ap.add_argument("--workload", choices=("mul", "tanh"), default="mul", help="as bench_hooks'")
    args = ap.parse_args(argv)
    one, three = _count(args.mode, 1, args.workload), _count(args.mode, 3, args.workload)
    per_step = (three - one) / 2
    result = {
        "mode": args.mode,
        "workload": args.workload,
        "instructions_per_step": per_step,
        "per_saved_tensor": per_step / 2000,
    }
    print(
        f"{args.mode}: {per_step / 1e6:.1f} M instructions per step in the hooks, "
        f"{per_step / 2000 / 1e3:.1f} k per saved tensor"
    )
    return result


if __name__ == "__main__":
    main()
