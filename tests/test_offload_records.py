"""Which saved tensors become records: alias families stored once, and the skip rules
(parameters, small tensors, ``keep=``)."""

from __future__ import annotations

from models import mlp, views_model
from runtime_util import step
from torch import nn

import offload


def test_alias_families_stored_once() -> None:
    case = views_model(seed=0)
    other = views_model(seed=0)
    trace = offload.profile(other.step, other.model, warmup_steps=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        step(case, mgr)
        last = mgr.stats.last
        fams = [f for f in trace.families() if not f.is_parameter]
        assert last.records_deduplicated == sum(len(f.records) - 1 for f in fams) > 0
        assert last.records_offloaded_cpu == len(fams)
        assert last.bytes_offloaded_cpu == trace.saved_bytes
    finally:
        mgr.close()


def test_skip_rules_parameters_small_and_keep() -> None:
    case = mlp(seed=0)
    # Everything >= 1 MiB by default: this model's activations are all smaller.
    mgr = offload.ActivationOffloader(case.model)
    try:
        step(case, mgr)
        assert mgr.stats.last.bytes_offloaded_cpu == 0
        assert mgr.stats.last.records_kept == mgr.stats.last.records
    finally:
        mgr.close()
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, keep=("fc2", nn.GELU))
    try:
        other = mlp(seed=0)
        trace = offload.profile(other.step, other.model, warmup_steps=0)
        step(case, mgr)
        moved_modules = {"fc1", "act2", "fc3", "<outside>"}
        expected_kept = [
            r for r in trace.records if r.is_parameter or r.module not in moved_modules
        ]
        assert mgr.stats.last.records_kept == len(expected_kept)
    finally:
        mgr.close()
