"""OffloadConfig and the argument checks: bad arguments name the value and what would be
accepted; nvme_dir, tiers and the model's device checked when the manager is made."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from models import mlp
from runtime_util import step
from torch import nn

import offload


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"tiers": ("gpu",)}, ValueError, "tiers"),
        ({"tiers": ()}, ValueError, "tiers"),
        ({"tiers": ("cpu", "cpu")}, ValueError, "twice"),
        ({"tiers": ("nvme",)}, ValueError, "nvme_dir"),
        ({"tiers": ("nvme",), "nvme_dir": "/definitely/not/here"}, ValueError, "nvme_dir"),
        ({"cpu_budget": "lots"}, ValueError, "cpu_budget"),
        ({"cpu_budget": 1.5}, TypeError, "cpu_budget"),
        ({"min_offload_bytes": -1}, ValueError, "min_offload_bytes"),
        ({"max_inflight_bytes": "2 parsecs"}, ValueError, "max_inflight_bytes"),
        ({"keep": ("nonexistent",)}, ValueError, "keep"),
        ({"keep": (3,)}, TypeError, "keep"),
        ({"on_infeasible": "shrug"}, ValueError, "on_infeasible"),
        ({"gpu_budget": "85%"}, ValueError, "gpu_budget"),
        ({"gpu_budget": "lots"}, ValueError, "gpu_budget"),
        ({"gpu_budget": -1}, ValueError, "gpu_budget"),
        # 0 was taken, and the step after the profiling one raised BudgetInfeasibleError.
        ({"gpu_budget": 0}, ValueError, r"gpu_budget must be more than 0 bytes.*got 0$"),
        ({"gpu_budget": "0GiB"}, ValueError, r"more than 0 bytes.*got '0GiB' \(0 bytes\)"),
        ({"plan": object()}, TypeError, "plan"),
        ({"hardware": 3}, TypeError, "hardware"),
        # A missing or wrong file named the argument nowhere (a bare "[Errno 2] No such file").
        ({"hardware": "/definitely/not/here.json"}, FileNotFoundError, r"hardware=.*not/here"),
        ({"plan": "/definitely/not/here.json"}, FileNotFoundError, r"plan=.*not/here"),
        ({"hardware": __file__}, ValueError, r"hardware=.*test_offload_config.py.*not valid JSON"),
        ({"plan": __file__}, ValueError, r"plan=.*test_offload_config.py.*not valid JSON"),
        ({"tiers": None}, TypeError, "tiers"),
        ({"tiers": ("nvme",), "nvme_dir": 5}, TypeError, "nvme_dir"),
        ({"tiers": ("nvme",), "nvme_dir": __file__}, ValueError, r"nvme_dir.*not a directory"),
        ({"cpu_budget": 0}, ValueError, "cpu_budget 0"),
        ({"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be more than 0 bytes"),
        # Each said "is not a size" for a size out of range.
        ({"cpu_budget": "-5GiB"}, ValueError, r"cpu_budget must be >= 0 bytes; got '-5GiB' \("),
        ({"gpu_budget": "-5GiB"}, ValueError, r"gpu_budget must be more than 0 bytes.*'-5GiB'"),
        ({"min_offload_bytes": "-1MB"}, ValueError, r"min_offload_bytes must be >= 0 bytes"),
        # '' was the working directory, until the first step failed.
        ({"tiers": ("nvme",), "nvme_dir": ""}, ValueError, r"nvme_dir '': is empty.*directory"),
        # "is not writable (No such file or directory)", of a directory that exists.
        pytest.param(
            {"tiers": ("nvme",), "nvme_dir": "/proc"},
            ValueError,
            r"nvme_dir '/proc': is not writable: .*\(ENOENT: .*virtual file system",
            marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc"),
        ),
        # Bytes are iterable: "tiers: 99 is not a tier".
        ({"tiers": b"cpu"}, TypeError, r"tiers must be 'cpu', 'nvme' or a sequence.*got bytes"),
    ],
)
def test_bad_arguments(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        offload.ActivationOffloader(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        # Each raised "TypeError: cannot create weak reference to 'NoneType' object" (or 'str',
        # 'list'): the model is a key of the managers' cache.
        ({"model": None}, TypeError, r"^model must be a torch.nn.Module; got NoneType$"),
        ({"model": "model"}, TypeError, r"^model must be a torch.nn.Module; got str$"),
        ({"model": [nn.Linear(2, 2)]}, TypeError, r"^model must be a torch.nn.Module; got list$"),
        # "'NoneType' object is not iterable", and realpath's "expected str, bytes or ...".
        ({"tiers": None}, TypeError, r"^tiers must be 'cpu', 'nvme' or a sequence of them"),
        ({"tiers": "nvme", "nvme_dir": 5}, TypeError, r"^nvme_dir must be a directory path"),
        ({"tiers": "nvme", "nvme_dir": ""}, ValueError, r"^nvme_dir '': is empty"),
    ],
)
def test_bad_arguments_to_activations(kwargs, exc, match) -> None:
    kwargs.setdefault("model", nn.Linear(2, 2))
    with pytest.raises(exc, match=match):
        offload.activations(**kwargs)


@pytest.mark.parametrize(
    ("name", "none_means"),
    [("gpu_budget", "min-memory mode"), ("max_inflight_bytes", "twice the largest record")],
)
def test_sizes_that_take_no_zero_say_so_for_negative_values(name: str, none_means: str) -> None:
    """``gpu_budget=-1`` and ``max_inflight_bytes=-5`` said "must be >= 0 bytes", though 0 is
    refused too (with another message). Negative, 0 and '0GiB' now get one message: more than 0
    bytes, or None and what it means."""
    for value in (-5, -1, 0, "0GiB"):
        with pytest.raises(ValueError) as info:
            offload.ActivationOffloader(nn.Linear(2, 2), **{name: value})
        message = str(info.value)
        assert f"{name} must be more than 0 bytes, or None" in message, message
        assert none_means in message and ">= 0" not in message, message
        assert f"got {value!r}" in message, message


@pytest.mark.parametrize("where", ["a directory", "nowhere"])
def test_nvme_dir_without_nvme_in_tiers_is_ignored_with_a_warning(where: str, tmp_path) -> None:
    """``nvme_dir`` while ``"nvme"`` is not in ``tiers``: nothing ever goes there. Before, that
    passed silently (and a directory that does not exist raised NvmeDirError, for an argument
    never used); now a RuntimeWarning names both arguments and the directory is not checked."""
    nvme_dir = tmp_path if where == "a directory" else "/definitely/not/here"
    case = mlp(seed=0)
    ignored = r"nvme_dir=.* is ignored: 'nvme' is not in tiers="
    with pytest.warns(RuntimeWarning, match=ignored) as w:
        mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, nvme_dir=nvme_dir)
    assert len(w) == 1 and w[0].filename == __file__ and "('cpu',)" in str(w[0].message)
    try:
        assert mgr.config.nvme_dir is None
        step(case, mgr)
        assert mgr.stats.last.bytes_offloaded_cpu > 0 == mgr.stats.last.bytes_offloaded_nvme
    finally:
        mgr.close()
    # Made by offload.activations, the warning names the user's line too (it named
    # offload/_offloader.py).
    with pytest.warns(RuntimeWarning, match=ignored) as w:
        offload.activations(case.model, nvme_dir=nvme_dir).close()
    assert len(w) == 1 and w[0].filename == __file__


def test_a_tiers_string_with_a_comma_is_refused_without_a_warning_about_nvme_dir(tmp_path):
    """``tiers="cpu,nvme"`` (the CLI's spelling) with ``nvme_dir``: the ValueError about tiers
    came after a RuntimeWarning that nvme_dir was ignored because 'nvme' was not in tiers,
    which sent the user after the wrong argument."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"tiers: 'cpu,nvme' is not a tier"):
            offload.ActivationOffloader(nn.Linear(2, 2), tiers="cpu,nvme", nvme_dir=tmp_path)


def test_a_model_moved_after_its_manager_was_made_warns() -> None:
    """The manager fixes its device when it is made. Made on a meta model and the model moved
    to its device afterwards (or made before ``model.cuda()``), every saved tensor is on
    another device than the manager's: steps ran, offloaded 0 bytes and said nothing."""
    with torch.device("meta"):
        case_model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
    mgr = offload.ActivationOffloader(case_model, min_offload_bytes=0)
    case_model.to_empty(device="cpu")
    for p in case_model.parameters():
        nn.init.normal_(p)
    try:
        x = torch.randn(32, 64)
        with pytest.warns(RuntimeWarning, match=r"on cpu.*made when they were on meta") as w:
            with mgr:
                loss = case_model(x).sum()
        loss.backward()
        assert len(w) == 1 and w[0].filename == __file__
        assert mgr.stats.last.bytes_offloaded_cpu == 0  # as documented: only meta tensors move
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per manager
            with mgr:
                loss = case_model(x).sum()
            loss.backward()
    finally:
        mgr.close()


def test_an_nvme_dir_this_process_cannot_write_fails_at_construction(tmp_path) -> None:
    """An unwritable nvme_dir used to pass construction and fail every step with a bare
    PermissionError; it is checked up front, with the argument named."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        if os.access(ro, os.W_OK):  # root writes anyway, unless the capability is dropped
            pytest.skip("this process can write into a 0500 directory (root)")
        with pytest.raises(ValueError, match=r"nvme_dir.*not writable"):
            offload.ActivationOffloader(nn.Linear(2, 2), tiers=("nvme",), nvme_dir=ro)
    finally:
        ro.chmod(0o700)


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="model"):
        offload.ActivationOffloader(object())  # type: ignore[arg-type]
