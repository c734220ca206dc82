"""``offload.integrations.hf.OffloadCallback`` in a real ``transformers.Trainer`` on CPU.

Every test trains a tiny GPT-2 twice, the same seed and data order, with and without the
callback, and asserts the final weights bitwise equal (and that something was offloaded or
rebuilt, so equality is not vacuous). The DDP test runs this file under ``torchrun`` with 2 gloo
processes (``python -m torch.distributed.run --nproc-per-node 2 tests/test_integration_hf.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from offload.integrations.hf import OffloadCallback  # noqa: E402

STEPS = 3


def _train(callback: Any = None, out: str | None = None, **args: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    with tempfile.TemporaryDirectory() as d:
        targs = transformers.TrainingArguments(
            output_dir=out or d,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            **args,
        )
        trainer = transformers.Trainer(
            model=model,
            args=targs,
            train_dataset=data,
            callbacks=[callback] if callback is not None else [],
        )
        trainer.train()
    return model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.fixture(scope="module")
def plain() -> torch.nn.Module:
    return _train()


def test_weights_exact_without_budget(plain: torch.nn.Module) -> None:
    cb = OffloadCallback(min_offload_bytes=0)
    model = _train(cb)
    assert _same(model, plain)
    mgr = cb.manager
    assert mgr is not None and mgr.closed and not mgr.installed
    total = mgr.stats.total  # readable after training
    assert total.steps == STEPS and total.records_offloaded_cpu > 0


def test_weights_exact_under_budget_plan_runs(plain: torch.nn.Module) -> None:
    cb = OffloadCallback(min_offload_bytes=0, gpu_budget="300KiB")
    model = _train(cb)
    assert _same(model, plain)
    mgr = cb.manager
    assert mgr is not None and mgr.plan is not None
    total = mgr.stats.total
    assert total.steps == STEPS and total.records_offloaded_cpu > 0
    # The first step profiles; the later ones run the plan, every record matched by it.
    assert total.unplanned_records == 0 and mgr.stats.last.predicted_peak_bytes > 0
    assert total.min_memory_steps == 0


def test_gradient_accumulation_each_microbatch_a_step() -> None:
    plain = _train(gradient_accumulation_steps=2)
    cb = OffloadCallback(min_offload_bytes=0, gpu_budget="300KiB")
    model = _train(cb, gradient_accumulation_steps=2)
    assert _same(model, plain)
    mgr = cb.manager
    assert mgr is not None and mgr.plan is not None
    assert mgr.stats.total.steps == 2 * STEPS and mgr.stats.total.unplanned_records == 0


def test_model_gradient_checkpointing_exact() -> None:
    plain = _train(activation_checkpointing=True)
    cb = OffloadCallback(min_offload_bytes=0)
    model = _train(cb, activation_checkpointing=True)
    assert _same(model, plain)
    assert cb.manager is not None and cb.manager.stats.total.records_offloaded_cpu > 0


def test_composes_with_transformers_checkpoint_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    # activation_checkpointing_kwargs={"offload": True} wraps each checkpointed layer in
    # save_on_cpu(pin_memory=True) (transformers/modeling_utils.py, _activation_checkpointing_enable),
    # which raises on a machine with no accelerator: pinning is turned off here only.
    import transformers.modeling_utils as mu

    save_on_cpu = mu.save_on_cpu
    monkeypatch.setattr(
        mu, "save_on_cpu", lambda pin_memory, device_type: save_on_cpu(False, device_type)
    )
    ckpt = {"activation_checkpointing": True}
    both = {**ckpt, "activation_checkpointing_kwargs": {"offload": True}}
    plain = _train(**both)
    alone, together = OffloadCallback(min_offload_bytes=0), OffloadCallback(min_offload_bytes=0)
    _train(alone, **ckpt)
    assert _same(_train(together, **both), plain)
    a, t = alone.manager, together.manager
    assert a is not None and t is not None
    # Innermost hooks win: save_on_cpu takes the checkpointed layers' inputs, offload the rest.
    assert 0 < t.stats.total.records_offloaded_cpu < a.stats.total.records_offloaded_cpu


def test_bf16_autocast_exact(plain: torch.nn.Module) -> None:
    fp32, plain = plain, _train(bf16=True)
    assert not _same(plain, fp32)  # the Trainer's CPU autocast ran
    cb = OffloadCallback(min_offload_bytes=0)
    model = _train(cb, bf16=True)
    assert _same(model, plain)
    assert cb.manager is not None and cb.manager.stats.total.records_offloaded_cpu > 0


def test_train_twice_makes_a_manager_each_time() -> None:
    cb = OffloadCallback(min_offload_bytes=0)
    _train(cb)
    first = cb.manager
    _train(cb)
    assert cb.manager is not first and first is not None and first.closed
    assert cb.manager is not None and cb.manager.stats.total.steps == STEPS


def test_manager_on_the_module_under_a_wrapper() -> None:
    inner = torch.nn.Linear(4, 4)
    cb = OffloadCallback(min_offload_bytes=0)
    cb.on_train_begin(None, None, None, model=torch.nn.DataParallel(inner))
    try:
        assert cb.manager is not None and cb.manager._model_ref() is inner
        assert cb.manager.installed
    finally:
        cb.on_train_end(None, None, None)
    assert cb.manager.closed


@pytest.mark.distributed
def test_ddp_torchrun_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            __file__, str(tmp_path),
        ],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        words = (tmp_path / f"rank{rank}").read_text().split()
        assert words == ["exact", "offloaded", "world2"], (rank, words)


def _ddp_main(out: Path) -> None:
    """One torchrun rank: the Trainer joins the gloo group (``use_cpu``) and wraps the model in
    DDP; the callback's manager is on the inner module."""
    rank = int(os.environ["RANK"])
    ddp = {"ddp_backend": "gloo", "ddp_find_unused_parameters": False}
    plain = _train(**ddp)
    cb = OffloadCallback(min_offload_bytes=0)
    model = _train(cb, **ddp)
    offloaded = cb.manager is not None and cb.manager.stats.total.records_offloaded_cpu > 0
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1  # the Trainer joined the group
    words = [
        "exact" if _same(model, plain) else "differ",
        "offloaded" if offloaded else "none",
        f"world{world}",
    ]
    (out / f"rank{rank}").write_text(" ".join(words))


if __name__ == "__main__":
    _ddp_main(Path(sys.argv[1]))


def test_bad_arguments_and_manager_before_training() -> None:
    with pytest.raises(TypeError, match="gpu_budgt"):
        OffloadCallback(gpu_budgt="1GiB")
    assert OffloadCallback().manager is None
