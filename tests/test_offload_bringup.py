"""GPU bring-up fixes whose logic runs on CPU: when the hardware is probed, the device set on
storage's I/O threads, and the warning about a compiled leaf that holds most of a step."""

from __future__ import annotations

import logging

from models import ALL_MODELS

import offload


def _probe_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "offload::probe_hardware" in r.getMessage()]


def test_a_budgeted_manager_probes_the_hardware_when_made_not_mid_training(
    tmp_path, monkeypatch, caplog
) -> None:
    """With a budget and no hardware=, the link is measured when the manager is made (on CUDA
    the probe allocates and empties the allocators' caches), never at a later step. Before, it
    ran at the second step's entry, when the first plan was made: no probe at construction,
    one at step 2."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    case = ALL_MODELS["mlp"](seed=0)
    with caplog.at_level(logging.INFO, logger="offload"):
        mgr = offload.ActivationOffloader(case.model, gpu_budget=1 << 30, min_offload_bytes=0)
        try:
            assert len(_probe_lines(caplog)) == 1
            assert list(tmp_path.glob("hardware-*.json"))
            caplog.clear()
            for s in range(3):
                case.model.zero_grad(set_to_none=True)
                with mgr:
                    loss = case.loss(case.batch(s))
                loss.backward()
            assert mgr.plan is not None
            assert mgr.plan.hardware.source.startswith("measured")
            assert _probe_lines(caplog) == []
        finally:
            mgr.close()


def test_a_manager_without_a_budget_does_not_probe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model)
    mgr.close()
    assert not list(tmp_path.glob("hardware-*.json"))
