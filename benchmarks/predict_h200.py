"""What the planner predicts for GPT- and Llama-style steps on an H200, next to its anchors.

Run (CPU, seconds):
    python benchmarks/predict_h200.py [--out benchmarks/results/cpu]

Nothing runs on a GPU here: every figure is a prediction, by ``lifecycle.plan`` and
``lifecycle.simulate`` with ``HardwareModel.h200()``, for ``lifecycle.transformer_trace`` steps
(bf16, flash attention; ``mlp="gelu"`` for GPT, ``"swiglu"`` for Llama without grouped-query
attention). Per trace and budget (``base`` 10 GiB of weights and optimizer state, plus a share of
the step's peak saved bytes; margin 0): the plan's predicted step time as a ratio to keeping
everything, the anchors' ratios (everything to pinned CPU memory; every block checkpointed) with
whether their simulated peaks fit the budget, and where the plan puts the saved bytes (shares of
the peak saved bytes). They are what ``bench_budget.py`` measures on a GPU, where one is lent.
Writes ``predict.json`` and ``predict.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from offload.lifecycle import (
    BudgetInfeasibleError,
    HardwareModel,
    plan,
    predict_anchors,
    transformer_trace,
)

_BASE_BYTES = 10 << 30
# (mlp, layers, hidden, tokens)
_TRACES = [
    ("gelu", 4, 4096, 4096),
    ("gelu", 8, 4096, 8192),
    ("gelu", 8, 2048, 8192),
    ("swiglu", 4, 4096, 4096),
    ("swiglu", 8, 4096, 8192),
    ("swiglu", 8, 2048, 8192),
]
_SHARES = (0.25, 0.5, 0.75)


def _one(mlp: str, layers: int, hidden: int, tokens: int, hw: HardwareModel) -> dict[str, Any]:
    trace = transformer_trace(
        layers=layers, hidden=hidden, tokens=tokens, mlp=mlp, base_bytes=_BASE_BYTES
    )
    saved = trace.peak_saved_bytes
    anchors = predict_anchors(trace, hw)
    keep_s = anchors["keep_all"].step_s
    rows = []
    for share in _SHARES:
        budget = _BASE_BYTES + int(share * saved)
        try:
            p = plan(trace, budget, hw, min_offload_bytes=0, margin=0)
        except BudgetInfeasibleError as e:  # below what any plan of the allowed tiers reaches
            rows.append(
                {
                    "share": share,
                    "gpu_budget_bytes": budget,
                    "infeasible": True,
                    "min_feasible_bytes": e.min_feasible_bytes,
                }
            )
            continue
        rows.append(
            {
                "share": share,
                "gpu_budget_bytes": budget,
                "plan_x_keep": p.predicted.step_s / keep_s,
                "plan_peak_bytes": p.predicted.peak_bytes,
                "placed_share": {k: v / saved for k, v in p.bytes_by_placement().items() if v},
                "recomputed_blocks": p.metadata["recomputed_blocks"],
                "rebuilt_families": p.metadata["rebuilt_families"],
                "anchors": {
                    name: {
                        "x_keep": s.step_s / keep_s,
                        "peak_bytes": s.peak_bytes,
                        "fits": s.peak_bytes <= budget,
                    }
                    for name, s in anchors.items()
                    if name != "keep_all"
                },
            }
        )
    return {
        "mlp": mlp,
        "layers": layers,
        "hidden": hidden,
        "tokens": tokens,
        "records": len(trace.records),
        "peak_saved_bytes": saved,
        "keep_all_step_s": keep_s,
        "budgets": rows,
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Planner predictions on an H200 model (benchmarks/predict_h200.py)",
        "",
        "Predictions only (no GPU ran): `lifecycle.plan` / `lifecycle.simulate` with "
        "`HardwareModel.h200()` on `lifecycle.transformer_trace` steps (bf16, flash attention; "
        "llama = SwiGLU MLP, f = 3.5h, no grouped-query attention). Budget = 10 GiB + share x "
        "peak saved bytes, margin 0. Step times as ratios to keeping everything; an anchor whose "
        "simulated peak exceeds the budget is marked (over).",
        "",
        "| model | layers x h, tokens | budget | plan | offload all | checkpoint blocks | "
        "plan places (share of peak saved bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result["traces"]:
        name = "gpt" if t["mlp"] == "gelu" else "llama"
        for row in t["budgets"]:
            if row.get("infeasible"):
                lines.append(
                    f"| {name} | {t['layers']} x {t['hidden']}, {t['tokens']} | "
                    f"+{row['share']:.0%} | infeasible (needs "
                    f"{row['min_feasible_bytes'] / (1 << 30):.2f} GiB) | | | |"
                )
                continue
            a = row["anchors"]

            def anchor(k: str, a: dict[str, Any] = a) -> str:
                return f"{a[k]['x_keep']:.3f}" + ("" if a[k]["fits"] else " (over)")

            placed = ", ".join(f"{k} {v:.2f}" for k, v in row["placed_share"].items())
            lines.append(
                f"| {name} | {t['layers']} x {t['hidden']}, {t['tokens']} | "
                f"+{row['share']:.0%} | {row['plan_x_keep']:.3f} | {anchor('offload_all')} | "
                f"{anchor('checkpoint_blocks')} | {placed} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu"))
    args = ap.parse_args(argv)
    hw = HardwareModel.h200()
    result = {
        "benchmark": "predict_h200",
        "hardware_model": "HardwareModel.h200()",
        "base_bytes": _BASE_BYTES,
        "traces": [_one(*spec, hw) for spec in _TRACES],
    }
    md = _markdown(result)
    os.makedirs(args.out, exist_ok=True)
    for ext, text in (("json", json.dumps(result, indent=2)), ("md", md)):
        Path(args.out, f"predict.{ext}").write_text(text)
    print(md)
    return result


if __name__ == "__main__":
    main()
