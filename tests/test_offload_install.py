"""``mgr.install()``: steps found without ``with mgr:`` (NOTE [ Installed steps ] in
offload/_hooks.py). Each training forward with grad and the backward that consumes it is one
step, in min-memory and budget mode; evaluation forwards are left alone; gradients are bitwise
equal to a run without offloading."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch
from budget_util import FAST, assert_bitwise, keep_all_peak
from models import ALL_MODELS, ModelCase, Wrapper
from torch import nn

import offload
from offload import OffloadError


def _reference(name: str, steps: int, accumulate: int = 1) -> list[dict[str, torch.Tensor]]:
    case = ALL_MODELS[name](seed=0)
    return _train(case, steps, accumulate)


def _train(case: ModelCase, steps: int, accumulate: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` optimizer steps of ``accumulate`` micro-batches each, no ``with``: each
    step's gradients."""
    out = []
    for s in range(steps):
        case.model.zero_grad(set_to_none=True)
        for m in range(accumulate):
            case.loss(case.batch(s * accumulate + m)).backward()
        out.append(case.grads())
    return out


def _leak_free(mgr: offload.ActivationOffloader) -> None:
    gc.collect()
    assert mgr._executor is not None
    assert mgr._executor.live_families() == 0 and mgr._executor.cpu_bytes == 0


@pytest.mark.parametrize("name", ["gpt_block", "conv_net", "mlp"])
def test_installed_min_memory_steps_are_bitwise_and_offload(name: str) -> None:
    want = _reference(name, 3)
    case = ALL_MODELS[name](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        assert mgr.installed
        got = []
        for s in range(3):
            got += _train_one(case, s)
            last = mgr.stats.last
            assert last.bytes_offloaded_cpu > 0
            assert mgr.stats.total.steps == s + 1
        assert_bitwise(got, want)
        _leak_free(mgr)
    finally:
        mgr.close()


def _raised_hooks(model: nn.Module) -> list[object]:
    """The hooks install() added to ``model``'s modules."""
    from offload._hooks import ForwardRaised

    return [
        h
        for m in model.modules()
        for h in m._forward_hooks.values()
        if isinstance(h, ForwardRaised)
    ]


def _train_one(case: ModelCase, s: int) -> list[dict[str, torch.Tensor]]:
    case.model.zero_grad(set_to_none=True)
    case.loss(case.batch(s)).backward()
    return [case.grads()]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", ["gpt_block", "conv_net", "checkpointed"])
def test_installed_budget_mode_plans_and_runs_the_plan(name: str, accumulate: int) -> None:
    """The first micro-batch is profiled, the next planned; every later one runs the plan with
    no unplanned record, gradient accumulation included (each micro-batch is a step: a
    callback entering the manager per optimizer step left 168 of 600 records unplanned)."""
    steps = 4
    want = _reference(name, steps, accumulate)
    case = ALL_MODELS[name](seed=0)
    budget = int(0.6 * keep_all_peak(case))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = offload.ActivationOffloader(
            case.model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0
        )
        try:
            mgr.install()
            got = []
            for s in range(steps):
                case.model.zero_grad(set_to_none=True)
                for m in range(accumulate):
                    case.loss(case.batch(s * accumulate + m)).backward()
                    last = mgr.stats.last
                    micro = s * accumulate + m
                    assert mgr.stats.total.steps == micro + 1
                    if micro == 0:
                        assert last.bytes_offloaded_cpu > 0  # profiled in min-memory mode
                    else:
                        assert 0 < last.predicted_peak_bytes <= budget, micro
                        assert last.unplanned_records == 0, micro
                got.append(case.grads())
            plan = mgr.plan
            assert plan is not None and plan.predicted_peak_bytes <= plan.target_bytes
            assert mgr.stats.total.min_memory_steps == 0
            assert_bitwise(got, want)
            _leak_free(mgr)
        finally:
            mgr.close()


def test_evaluation_forwards_between_installed_steps_are_left_alone() -> None:
    want = _reference("gpt_block", 3)
    case = ALL_MODELS["gpt_block"](seed=0)
    budget = int(0.6 * keep_all_peak(case))
    mgr = offload.ActivationOffloader(
        case.model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0
    )
    try:
        mgr.install()
        got = []
        for s in range(3):
            got += _train_one(case, s)
            before = mgr.stats
            with torch.no_grad():
                case.loss(case.batch(100))
            with torch.inference_mode():
                case.loss(case.batch(101))
            after = mgr.stats
            assert after == before
            assert mgr._executor is not None and mgr._executor.live_families() == 0
        assert_bitwise(got, want)
        assert list(mgr.plans) == [mgr.plan.signature]  # type: ignore[union-attr]
        assert mgr.stats.last.unplanned_records == 0
    finally:
        mgr.close()


@pytest.mark.parametrize("mode", ["min_memory", "budget"])
@pytest.mark.parametrize("how", ["install", "with"])
def test_a_wrapper_whose_forward_is_never_called(mode: str, how: str) -> None:
    """``model.head(model.backbone(x))``: two top-level calls, one step; under a budget the
    step is planned (the signature is the backbone's) and later steps follow the plan."""
    torch.manual_seed(0)
    model = Wrapper()
    xs = [torch.randn(64, 32, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def loss(s: int) -> torch.Tensor:
        return model.head(model.backbone(xs[s])).pow(2).mean()

    want = []
    for s in range(4):
        model.zero_grad(set_to_none=True)
        loss(s).backward()
        want.append({n: p.grad.clone() for n, p in model.named_parameters()})
    peak = offload.profile(lambda: loss(0).backward(), model, warmup_steps=0).peak_saved_bytes
    kw = {} if mode == "min_memory" else {"gpu_budget": peak // 2, "hardware": FAST}
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, **kw)
    try:
        if how == "install":
            mgr.install()
        got = []
        for s in range(4):
            model.zero_grad(set_to_none=True)
            if how == "install":
                loss(s).backward()
            else:
                with mgr:
                    out = loss(s)
                out.backward()
                del out
            got.append({n: p.grad.clone() for n, p in model.named_parameters()})
            last = mgr.stats.last
            assert mgr.stats.total.steps == s + 1
            if mode == "min_memory" or s == 0:
                assert last.bytes_offloaded_cpu > 0
            else:
                assert mgr.plan is not None and last.predicted_peak_bytes > 0
                assert last.unplanned_records == 0
        assert_bitwise(got, want)
        if mode == "budget":
            plan = mgr.plan
            assert plan is not None and plan.signature.startswith("backbone(")
            assert {"backbone", "head"} <= {e.module.split(".")[0] for e in plan.entries}
        _leak_free(mgr)
    finally:
        mgr.close()


def test_uninstall_mid_run_then_training_without_offload() -> None:
    want = _reference("gpt_block", 4)
    case = ALL_MODELS["gpt_block"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        got = _train_one(case, 0)
        # A forward whose backward comes after uninstall: the step ends at uninstall, its
        # backward still runs.
        case.model.zero_grad(set_to_none=True)
        loss = case.loss(case.batch(1))
        mgr.uninstall()
        assert not mgr.installed
        loss.backward()
        del loss
        got.append(case.grads())
        steps = mgr.stats.total.steps
        assert steps == 2
        got += _train_one(case, 2) + _train_one(case, 3)
        assert mgr.stats.total.steps == steps  # no step without install or with
        assert_bitwise(got, want)
        _leak_free(mgr)
        mgr.uninstall()  # again: nothing
        assert not _raised_hooks(case.model)
    finally:
        mgr.close()


def test_close_uninstalls_and_an_open_step_ends() -> None:
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    mgr.install()
    assert _raised_hooks(case.model)
    loss = case.loss(case.batch(0))
    mgr.close()
    assert not mgr.installed and mgr.closed
    assert not _raised_hooks(case.model)
    with pytest.raises(Exception, match="closed"):
        loss.backward()  # its saved tensors went with the manager (as after `with`)
    del loss
    case.step(1)  # the model trains without the manager
    with pytest.raises(OffloadError, match="closed"):
        mgr.install()


def test_bad_use_raises_clearly() -> None:
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        with mgr:
            with pytest.raises(OffloadError, match=r"install\(\) inside `with mgr:`"):
                mgr.install()
            loss = case.loss(case.batch(0))
        loss.backward()
        del loss
        mgr.install()
        mgr.install()  # again on this thread: nothing
        failed: list[BaseException] = []

        def other() -> None:
            try:
                mgr.install()
            except OffloadError as e:
                failed.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(failed) == 1 and "another thread" in str(failed[0])
    finally:
        mgr.close()


def test_with_still_makes_one_step_while_installed() -> None:
    want = _reference("mlp", 3)
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        got = _train_one(case, 0)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch(1))
        loss.backward()
        del loss
        got.append(case.grads())
        assert mgr.stats.total.steps == 2
        got += _train_one(case, 2)
        assert mgr.stats.total.steps == 3
        assert_bitwise(got, want)
        _leak_free(mgr)
    finally:
        mgr.close()


def test_several_backwards_in_one_with_block_warn_once() -> None:
    """``with mgr: trainer.train()`` made the whole run one step, silently."""
    want = _reference("mlp", 4)
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        with pytest.warns(RuntimeWarning, match=r"mgr\.install\(\)") as got_warnings:
            got = []
            with mgr:
                for s in range(4):
                    got += _train_one(case, s)
        assert len([w for w in got_warnings if "install()" in str(w.message)]) == 1
        assert_bitwise(got, want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for s in range(2):  # one forward and its backward per block: nothing said
                with mgr:
                    loss = case.loss(case.batch(s))
                    loss.backward()
    finally:
        mgr.close()


def test_a_backward_that_raised_ends_its_step_at_the_next_forward() -> None:
    from models import fail_backward_at

    want = _reference("mlp", 3)
    case = ALL_MODELS["mlp"](seed=0)
    failing = fail_backward_at(case.model, RuntimeError)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        got = _train_one(case, 0)
        failing.append(1)
        with pytest.raises(RuntimeError, match="gradient check failed"):
            case.loss(case.batch(1)).backward()
        failing.clear()
        got += _train_one(case, 1) + _train_one(case, 2)
        assert mgr.stats.total.steps == 4
        assert_bitwise(got, want)
        _leak_free(mgr)
    finally:
        mgr.close()


def test_a_forward_that_raised_ends_its_step() -> None:
    want = _reference("mlp", 2)
    case = ALL_MODELS["mlp"](seed=0)
    last = list(case.model.modules())[-1]

    def fail(mod: nn.Module, args: object) -> None:
        raise ValueError("a forward failed")

    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        got = _train_one(case, 0)
        handle = last.register_forward_pre_hook(fail)
        with pytest.raises(ValueError, match="a forward failed"):
            case.loss(case.batch(1))
        handle.remove()
        assert not mgr._in_step  # ended, its hooks popped
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        got += _train_one(case, 1)
        assert mgr.stats.total.steps == 3
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        assert_bitwise(got, want)
        _leak_free(mgr)
    finally:
        mgr.close()


def test_an_evaluation_forward_with_grad_is_a_step_of_its_own() -> None:
    """Its backward never comes: the next training forward (inputs without a graph) ends it
    and begins its own step, which its backward ends."""
    want = _reference("mlp", 2)
    case = ALL_MODELS["mlp"](seed=0)
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
    try:
        mgr.install()
        got = _train_one(case, 0)
        case.loss(case.batch(50)).item()  # evaluation, grad left on
        got += _train_one(case, 1)
        assert mgr.stats.total.steps == 3
        assert not mgr._in_step
        assert_bitwise(got, want)
        _leak_free(mgr)
    finally:
        mgr.close()


def test_installed_budget_steps_go_as_with_blocks_do() -> None:
    """The same steps through install() and through ``with mgr:`` blocks holding their
    backward: the same signatures, the same plan states step by step, plans of the same
    modules' records (a ``with`` block also covers the loss computed outside the model)."""

    def steps(how: str) -> tuple[list[tuple[bool, int, int]], list[str], set[str]]:
        case = ALL_MODELS["gpt_block"](seed=0)
        budget = int(0.6 * keep_all_peak(case))
        mgr = offload.ActivationOffloader(
            case.model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0
        )
        try:
            if how == "install":
                mgr.install()
            seen = []
            for s in range(5):
                case.model.zero_grad(set_to_none=True)
                if how == "install":
                    case.loss(case.batch(s)).backward()
                else:
                    with mgr:
                        case.loss(case.batch(s)).backward()
                last = mgr.stats.last
                seen.append(
                    (last.predicted_peak_bytes > 0, last.unplanned_records, last.min_memory_steps)
                )
            plan = mgr.plan
            assert plan is not None
            modules = {e.module for e in plan.entries if e.module}
            return seen, list(mgr.plans), modules
        finally:
            mgr.close()

    installed, with_blocks = steps("install"), steps("with")
    assert installed[0] == with_blocks[0] == [(False, 0, 0)] + [(True, 0, 0)] * 4
    assert installed[1] == with_blocks[1]
    assert installed[2] == with_blocks[2] - {"<outside>"}
