"""The device layer on CPU: a CUDA graph capture, simulated (NOTE [ No query while
capturing ])."""

from __future__ import annotations

import pytest
from models import mlp
from offload_util import assert_bitwise, assert_nothing_live, offloaded_step, reference_grads

import offload
from offload import storage


def test_a_step_inside_a_simulated_graph_capture_asks_no_completion_query() -> None:
    """CUDA forbids event queries while a stream captures a graph (one invalidates the
    capture). On CPU ``GraphCapture.simulate()`` says "capturing" to the checks a real capture
    meets: a step run inside it, with the last step's copies still in flight and that step's
    graph dropped meanwhile, asks no completion query (at the step's start, every module
    boundary, its backward's prefetches, the dropped graph's releases); its packs pass through,
    warned once. After it the waiting releases are done and steps offload as before, every
    gradient bitwise."""
    case = mlp(seed=0)
    want = [reference_grads("mlp", s) for s in range(4)]
    engine = storage.CopyEngine(deferred=True, max_delay_s=0.0005, seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, _copy_engine=engine)
    try:
        assert_bitwise(offloaded_step(case, mgr, 0), want[0])  # a warm-up step
        ex = mgr._executor
        with engine.paused():  # step 1's copies stay in flight through the capture
            case.model.zero_grad(set_to_none=True)
            with mgr:
                held = case.loss(case.batch(1))
            assert ex._inflight
            case.model.zero_grad(set_to_none=True)
            with (
                ex.capture.simulate(),
                pytest.warns(RuntimeWarning, match="CUDA graph capture: saved tensors"),
            ):
                with mgr:
                    loss = case.loss(case.batch(2))
                loss.backward()
                del held  # step 1's graph dies inside the capture: its releases wait
                assert ex._deferred_releases
            assert ex.capture.queries == 0  # what this test is about
            assert_bitwise(case.grads(), want[2])
        last = mgr.stats.last
        assert last.records_offloaded_cpu == 0 and last.records_kept == last.records > 0
        assert_bitwise(offloaded_step(case, mgr, 3), want[3])
        assert mgr.stats.last.records_offloaded_cpu > 0
        assert not ex._deferred_releases
        assert_nothing_live(mgr)
    finally:
        mgr.close()
        engine.close()
