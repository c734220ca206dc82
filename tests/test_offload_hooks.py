"""Module hooks: compiled submodules are leaves, a model compiled after its manager, the
thread check of the hooks, ``keep=`` by module type or list, and module calls from other
threads."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from models import mlp, seeded_steps
from offload_util import (
    CheckpointedBlocks,
    Res,
    assert_bitwise,
    manager,
    on_another_thread,
    reference_grads,
)
from torch import nn

import offload
from offload import lifecycle
from offload.lifecycle._calls import foreign_call


def three_blocks(compile_mode: str | None = None) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(Res(), Res(), Res())
    if compile_mode == "wrap":
        model[1] = torch.compile(model[1], backend="eager")
    elif compile_mode == "method":
        model[1].compile(backend="eager")
    return model


def inner_hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_compiled_submodule_is_a_leaf() -> None:
    want = seeded_steps(three_blocks("wrap"), n=2)[-1]
    model = three_blocks("wrap")
    with manager(model) as mgr:
        assert inner_hooks(model[1]._orig_mod) == 0  # nothing inside the compiled region
        assert len(model[1]._forward_pre_hooks) == 1  # the compiled module itself is a leaf
        got = seeded_steps(model, mgr, n=2)[-1]
        assert mgr.stats.last.bytes_offloaded_cpu > 0
    assert_bitwise(got, want)


def test_module_compile_method_is_a_leaf() -> None:
    model = three_blocks("method")
    compiled_call = model[1]._compiled_call_impl
    with manager(model):
        # Its hooks run around its compiled call, none inside it (NOTE [ Hooks of a compiled
        # call ] in lifecycle/_module_hooks.py).
        assert inner_hooks(model[1]) == 0
        assert model[1]._compiled_call_impl is not compiled_call
    assert model[1]._compiled_call_impl is compiled_call


def test_a_model_compiled_after_its_manager_warns_once() -> None:
    """torch.compile on a model after its manager was made traces the manager's module hooks,
    which dynamo cannot compile: 23 graph breaks in one step of these 3 blocks (none when
    compiled first). One RuntimeWarning says so and what to do (there was none); gradients stay
    exact. Compiled first (a submodule, ``.compile()``, or a compiled ``forward``, which was not
    a leaf before and took the same 23 breaks), nothing is said."""
    want = seeded_steps(three_blocks(), n=2)[-1]
    model = three_blocks()
    with manager(model) as mgr:
        compiled = torch.compile(model, backend="eager")
        with pytest.warns(RuntimeWarning, match="compiled with torch.compile after") as record:
            got = seeded_steps(compiled, mgr, n=2)[-1]
        assert mgr.stats.last.bytes_offloaded_cpu > 0
    assert len(record) == 1 and "Compile first" in str(record[0].message)
    assert record[0].filename == seeded_steps.__code__.co_filename  # the with statement's line
    assert_bitwise(plain_names(got), want)
    # Under fullgraph=True the first hook fails to compile, before anything runs: a note says why.
    torch._dynamo.reset()  # no cached graphs, no recompilation limit reached (it runs eager then)
    model = three_blocks()
    with manager(model) as mgr, pytest.raises(Exception) as failed:
        with mgr:
            torch.compile(model, backend="eager", fullgraph=True)(torch.randn(32, 64))
    if hasattr(failed.value, "add_note"):  # Python >= 3.11
        assert "compile first" in "".join(getattr(failed.value, "__notes__", ()))
    for mode in ("wrap", "method", "forward"):
        model = three_blocks(mode if mode != "forward" else None)
        if mode == "forward":
            model[1].forward = torch.compile(model[1].forward, backend="eager")
        with manager(model) as mgr, warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert inner_hooks(getattr(model[1], "_orig_mod", model[1])) == (mode == "forward") * 2
            assert_bitwise(plain_names(seeded_steps(model, mgr, n=2)[-1]), want)


def plain_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): g for n, g in grads.items()}


def test_the_thread_check_of_module_hooks_stays_out_of_dynamo() -> None:
    """A model compiled after its manager was made runs the manager's and its recorder's module
    hooks under dynamo. Their check that a call comes from the step's thread is skipped there:
    dynamo cannot trace ``threading.get_ident()`` (26 of this step's 40 graph breaks were there, and
    under ``fullgraph=True`` the check alone fails to compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = three_blocks()
    hardware = lifecycle.HardwareModel.cpu_only(
        copy_bytes_per_s=5e9, disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9
    )
    with manager(model, gpu_budget="64KiB", hardware=hardware) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # compiled after the manager was made
        compiled = torch.compile(model, backend="eager")
        with mgr:
            loss = compiled(torch.randn(32, 64)).sum()
            assert mgr._budget._profiler.recording
        loss.backward()
        assert mgr._step.calls.counts == {name: 1 for name, _ in model.named_modules()}
    breaks = [r for r in counters["graph_break"] if "get_ident" in r or "graph_task" in r]
    assert not breaks
    ident = threading.get_ident()
    check = torch.compile(
        lambda x: x if foreign_call(ident) else 2 * x, backend="eager", fullgraph=True
    )
    assert torch.equal(check(torch.ones(2)), torch.full((2,), 2.0))


def test_keep_a_module_type() -> None:
    want = reference_grads("mlp")
    case = mlp(seed=0)
    with manager(case.model, keep=(nn.GELU,)) as mgr:
        modules: list[str] = []
        with mgr:
            ex = mgr._executor
            original = ex.offload

            def spy(t: torch.Tensor, module: str, dtensor: Any, *args: Any) -> Any:
                modules.append(module)
                return original(t, module, dtensor, *args)

            ex.offload = spy
            loss = case.loss(case.batch())
        del ex.offload
        loss.backward()
        assert modules and "act1" not in modules
        assert {"fc1", "fc2", "act2"} <= set(modules)
        assert mgr.stats.last.records_kept > 0
        assert_bitwise(case.grads(), want)


def _moved_and_grads(
    make: Any, run: Any, keep: Any
) -> tuple[int, int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step of a fresh ``make()`` with ``keep=`` (bytes moved, records kept, grads) and
    the grads of a step without the manager."""
    ref = make()
    run(ref).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    model = make()
    with manager(model, keep=keep) as mgr:
        with mgr:
            loss = run(model)
        loss.backward()
        last = mgr.stats.last
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return last.bytes_offloaded_cpu, last.records_kept, got, want


def test_keep_a_module_list_keeps_what_its_children_save() -> None:
    """keep= naming an nn.ModuleList (which has no forward: its own hooks never run) keeps what
    its blocks save, as naming each block does (NOTE [ Keep covers the module tree ]): it kept
    nothing, and said nothing (examples/gpt.py: 96,660 B moved a step either way, naming the
    blocks 13,204 B)."""
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    def run(m: nn.Module) -> torch.Tensor:
        return m.loss(idx[:, :-1], idx[:, 1:])

    def make() -> nn.Module:
        return GPT(cfg)

    moved_all, _, _, _ = _moved_and_grads(make, run, ())
    moved_each, kept_each, _, _ = _moved_and_grads(make, run, ["blocks.0", "blocks.1"])
    moved, kept, got, want = _moved_and_grads(make, run, ["blocks"])
    assert moved_each < moved_all // 4
    assert (moved, kept) == (moved_each, kept_each)
    assert_bitwise(got, want)
    typed, _, _, _ = _moved_and_grads(make, run, [nn.ModuleList])
    assert typed == moved_each


def test_keep_a_transformers_module_list() -> None:
    """The same on a real transformers model: GPT-2's ``transformer.h`` (an nn.ModuleList) kept
    nothing (244,100 B moved a step, as without keep=; naming its blocks 13,188 B)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )  # fmt: skip
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    def run(m: nn.Module) -> torch.Tensor:
        return m(idx, labels=idx).loss

    moved_all, _, _, _ = _moved_and_grads(make, run, ())
    moved_each, _, _, _ = _moved_and_grads(make, run, ["transformer.h.0", "transformer.h.1"])
    moved, _, got, want = _moved_and_grads(make, run, ["transformer.h"])
    assert moved_each < moved_all // 4
    assert moved == moved_each
    assert_bitwise(got, want)


def test_keep_that_can_keep_nothing_warns() -> None:
    """A keep= type no module has, or a module inside a compiled one (a leaf to the manager),
    keeps nothing: said once, when the manager is made. An unknown name is refused."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
    with pytest.warns(RuntimeWarning, match=r"types \['Conv2d'\].*keep nothing") as said:
        offload.ActivationOffloader(model, keep=[nn.Conv2d, nn.GELU]).close()
    assert len(said) == 1 and said[0].filename == __file__
    model[1].compile(backend="eager")
    with pytest.warns(RuntimeWarning, match=r"keep=\['1.0'\] keeps nothing.*compiled module '1'"):
        offload.ActivationOffloader(model, keep=["1.0"]).close()
    with pytest.raises(ValueError, match=r"keep: no module named \['blocks'\].*named_modules"):
        offload.ActivationOffloader(model, keep=["blocks"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.ActivationOffloader(model, keep=["1", nn.Linear]).close()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_module_calls_of_a_backward_on_another_thread_count(use_reentrant: bool) -> None:
    """Module calls from other threads are not the step's, except from inside a backward (on
    CUDA backward runs on autograd's device thread): a checkpointed block recomputed by a
    backward run on another thread inside the step counts as when the step's thread runs it."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    calls, grads = [], []
    for elsewhere in (False, True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = CheckpointedBlocks(use_reentrant)
        with manager(model) as mgr:
            with mgr:
                loss = model(x).pow(2).sum()
                forward_calls = dict(mgr._step.calls.counts)
                on_another_thread(loss.backward) if elsewhere else loss.backward()
                calls.append(dict(mgr._step.calls.counts))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert calls[1] == calls[0] != forward_calls  # the recomputation's calls are counted
    assert_bitwise(grads[1], grads[0])
