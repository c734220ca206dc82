"""The planner's and the simulator's outputs on synthetic traces, pinned.

Unlike tests/test_plan.py (oracles: every plan checked against the simulator and the trace),
these pin what ``plan()`` and ``simulate()`` return on traces with no clock in them
(``transformer_trace``, a pipeline stage of one), so that moving their code between modules is
seen to change nothing: each plan's decisions (as a digest), predicted peak and step and the
planner's counts, and the simulated peak and step of the plan and of the three anchors. A planner change that means to move a plan
updates ``PINNED`` (print it with ``python tests/test_plan_pinned.py``) and says why.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from offload.lifecycle import (
    BudgetInfeasibleError,
    HardwareModel,
    Plan,
    Simulation,
    Trace,
    pipeline_trace,
    plan,
    predict_anchors,
    simulate,
    transformer_trace,
)

SLOW = HardwareModel(
    h2d_bytes_per_s=5e9,
    d2h_bytes_per_s=5e9,
    duplex_bytes_per_s=8e9,
    disk_write_bytes_per_s=2e9,
    disk_read_bytes_per_s=2e9,
)
HARDWARE = {"h200": HardwareModel.h200(), "slow": SLOW}
SHARES = (0.2, 0.5, 0.8)  # budget: base + share x (keep-all peak - base)


def _traces() -> dict[str, Trace]:
    gpt = transformer_trace(layers=6, hidden=1024, tokens=2048, base_bytes=1 << 30)
    return {
        "gpt": gpt,
        "llama": transformer_trace(
            layers=4, hidden=1024, tokens=2048, mlp="swiglu", base_bytes=1 << 30
        ),
        "stage1": pipeline_trace(gpt, stage=1, stages=4, microbatches=4),
    }


def _g(x: float) -> str:
    return f"{x:.12g}"  # a last-bit difference in a sum is no change


def _sim(s: Simulation) -> str:
    return f"{s.peak_bytes} {_g(s.step_s)}"


def _plan(p: Plan) -> str:
    decisions = [
        (e.family, e.placement.value, e.reload_event, e.recompute_module) for e in p.entries
    ]
    digest = hashlib.sha256(
        json.dumps([decisions, p.recompute_calls, p.expected_keys]).encode()
    ).hexdigest()[:16]
    m = p.metadata
    counts = (
        f"m={m['recomputed_blocks']} k={m['offloaded_families']} "
        f"r={m['rebuilt_families']} lead={m['reload_lead']} scored={m['candidates_scored']}"
    )
    return f"{digest} {p.predicted_peak_bytes} {_g(p.predicted_step_s)} {counts}"


def _outputs(name: str, trace: Trace, hw_name: str) -> dict[str, str]:
    hw = HARDWARE[hw_name]
    keep = simulate(trace, hw)
    out = {f"{name}/{hw_name}/{k}": _sim(s) for k, s in predict_anchors(trace, hw).items()}
    base = trace.events[0].memory_bytes
    for share in SHARES:
        budget = base + int(share * (keep.peak_bytes - base))
        key = f"{name}/{hw_name}/{share}"
        try:
            p = plan(trace, budget, hw, min_offload_bytes=0, margin=0)
        except BudgetInfeasibleError as e:
            out[key] = f"infeasible {e.min_feasible_bytes}"
            continue
        out[key] = _plan(p)
        out[key + "/simulated"] = _sim(simulate(trace, hw, p.decisions()))
        model = plan(trace, budget, hw, min_offload_bytes=0, margin=0, simulate_records=0)
        out[key + "/model"] = _plan(model)
    return out


PINNED: dict[str, str] = {
    "gpt/h200/keep_all": "1476788224 0.00320176390144",
    "gpt/h200/offload_all": "1296367616 0.00457320832238",
    "gpt/h200/checkpoint_blocks": "1161887744 0.00426901853525",
    "gpt/h200/0.2": "infeasible 1157693440",
    "gpt/h200/0.5": "730bf117a37801cc 1271136256 0.00360784709404 m=2 k=6 r=12 lead=1.0 scored=17",
    "gpt/h200/0.5/simulated": "1271136256 0.00366692055234",
    "gpt/h200/0.5/model": "730bf117a37801cc 1271136256 0.00360784709404 m=2 k=6 r=12 lead=1.0 scored=18",
    "gpt/h200/0.8": "2e3c029f5ea16eb9 1342570496 0.00327726137344 m=0 k=0 r=18 lead=1.0 scored=18",
    "gpt/h200/0.8/simulated": "1342570496 0.00327726137344",
    "gpt/h200/0.8/model": "2e3c029f5ea16eb9 1342570496 0.00327726137344 m=0 k=0 r=18 lead=1.0 scored=19",
    "gpt/slow/keep_all": "1476788224 0.00320176390144",
    "gpt/slow/offload_all": "1338376192 0.0076667572133",
    "gpt/slow/checkpoint_blocks": "1161887744 0.00426901853525",
    "gpt/slow/0.2": "infeasible 1161887744",
    "gpt/slow/0.5": "bb97c937b8420312 1224867840 0.00409114276295 m=5 k=0 r=0 lead=1.0 scored=22",
    "gpt/slow/0.5/simulated": "1224867840 0.00409114276295",
    "gpt/slow/0.5/model": "bb97c937b8420312 1224867840 0.00409114276295 m=5 k=0 r=0 lead=1.0 scored=23",
    "gpt/slow/0.8": "e4c662a9a54a6ee9 1350828032 0.00373539121835 m=3 k=0 r=0 lead=1.0 scored=19",
    "gpt/slow/0.8/simulated": "1350828032 0.00373539121835",
    "gpt/slow/0.8/model": "e4c662a9a54a6ee9 1350828032 0.00373539121835 m=3 k=0 r=0 lead=1.0 scored=20",
    "llama/h200/keep_all": "1443102720 0.00265991574869",
    "llama/h200/offload_all": "1310916608 0.00396689049867",
    "llama/h200/checkpoint_blocks": "1178664960 0.00354655433159",
    "llama/h200/0.2": "infeasible 1178664960",
    "llama/h200/0.5": "e5af948ca0e0ddbc 1258422272 0.00332489468587 m=3 k=2 r=0 lead=1.0 scored=16",
    "llama/h200/0.5/simulated": "1258422272 0.00332489468587",
    "llama/h200/0.5/model": "e5af948ca0e0ddbc 1258422272 0.00332489468587 m=3 k=2 r=0 lead=1.0 scored=17",
    "llama/h200/0.8": "e5e3eed30cf03712 1350828032 0.00270605309269 m=0 k=0 r=12 lead=1.0 scored=18",
    "llama/h200/0.8/simulated": "1350828032 0.00270605309269",
    "llama/h200/0.8/model": "e5e3eed30cf03712 1350828032 0.00270605309269 m=0 k=0 r=12 lead=1.0 scored=19",
    "llama/slow/keep_all": "1443102720 0.00265991574869",
    "llama/slow/offload_all": "1334050816 0.0115091515346",
    "llama/slow/checkpoint_blocks": "1178664960 0.00354655433159",
    "llama/slow/0.2": "infeasible 1178664960",
    "llama/slow/0.5": "908771692cb87eda 1243742208 0.00344023804587 m=3 k=0 r=3 lead=1.0 scored=21",
    "llama/slow/0.5/simulated": "1243742208 0.00344023804587",
    "llama/slow/0.5/model": "908771692cb87eda 1243742208 0.00344023804587 m=3 k=0 r=3 lead=1.0 scored=22",
    "llama/slow/0.8": "2721c88c9dd8567a 1354956800 0.00310323504014 m=2 k=0 r=0 lead=1.0 scored=17",
    "llama/slow/0.8/simulated": "1354956800 0.00310323504014",
    "llama/slow/0.8/model": "2721c88c9dd8567a 1354956800 0.00310323504014 m=2 k=0 r=0 lead=1.0 scored=18",
    "stage1/h200/keep_all": "2282881024 0.0202778380425",
    "stage1/h200/offload_all": "1359347712 0.0459170079212",
    "stage1/h200/checkpoint_blocks": "1212219392 0.0245468565777",
    "stage1/h200/0.2": "985b60abe47ee5ec 1308884992 0.0235550994159 m=18 k=12 r=18 lead=1.0 scored=36",
    "stage1/h200/0.2/simulated": "1308884992 0.0236141728742",
    "stage1/h200/0.2/model": "985b60abe47ee5ec 1308884992 0.0235550994159 m=18 k=12 r=18 lead=1.0 scored=37",
    "stage1/h200/0.5": "bce7cb5b601c6745 1670250496 0.0219021708129 m=8 k=14 r=48 lead=1.0 scored=39",
    "stage1/h200/0.5/simulated": "1670250496 0.0219612442712",
    "stage1/h200/0.5/model": "bce7cb5b601c6745 1670250496 0.0219021708129 m=8 k=14 r=48 lead=1.0 scored=40",
    "stage1/h200/0.8": "cedc0933ce49ee59 1846673408 0.0205798279305 m=0 k=0 r=72 lead=1.0 scored=44",
    "stage1/h200/0.8/simulated": "1846673408 0.0205798279305",
    "stage1/h200/0.8/model": "cedc0933ce49ee59 1846673408 0.0205798279305 m=0 k=0 r=72 lead=1.0 scored=45",
    "stage1/slow/keep_all": "2282881024 0.0202778380425",
    "stage1/slow/offload_all": "1359347712 0.345050973325",
    "stage1/slow/checkpoint_blocks": "1212219392 0.0245468565777",
    "stage1/slow/0.2": "24454a533b9ab997 1275199488 0.0243689808054 m=23 k=0 r=0 lead=1.0 scored=22",
    "stage1/slow/0.2/simulated": "1275199488 0.0243689808054",
    "stage1/slow/0.2/model": "24454a533b9ab997 1275199488 0.0243689808054 m=23 k=0 r=0 lead=1.0 scored=23",
    "stage1/slow/0.5": "04e225c23d2423e7 1653080064 0.0231238503993 m=16 k=0 r=0 lead=1.0 scored=24",
    "stage1/slow/0.5/simulated": "1653080064 0.0231238503993",
    "stage1/slow/0.5/model": "04e225c23d2423e7 1653080064 0.0231238503993 m=16 k=0 r=0 lead=1.0 scored=25",
    "stage1/slow/0.8": "d3bcb35cbb38da4b 2030960640 0.0220565957655 m=10 k=0 r=0 lead=1.0 scored=52",
    "stage1/slow/0.8/simulated": "2030960640 0.0220565957655",
    "stage1/slow/0.8/model": "d3bcb35cbb38da4b 2030960640 0.0220565957655 m=10 k=0 r=0 lead=1.0 scored=53",
}


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    return _traces()


@pytest.mark.parametrize("hw_name", sorted(HARDWARE))
@pytest.mark.parametrize("name", ["gpt", "llama", "stage1"])
def test_plans_and_simulations_are_as_pinned(
    traces: dict[str, Trace], name: str, hw_name: str
) -> None:
    got = _outputs(name, traces[name], hw_name)
    want = {k: v for k, v in PINNED.items() if k.startswith(f"{name}/{hw_name}/")}
    assert got == want


if __name__ == "__main__":
    everything: dict[str, str] = {}
    for name, trace in _traces().items():
        for hw_name in sorted(HARDWARE):
            everything.update(_outputs(name, trace, hw_name))
    sys.stdout.write("PINNED: dict[str, str] = {\n")
    for k, v in everything.items():
        sys.stdout.write(f"    {k!r}: {v!r},\n")
    sys.stdout.write("}\n")
