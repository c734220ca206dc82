"""Per-signature budget state (NOTE [ Signatures ], NOTE [ Structure ]): what makes a
signature, each profiled and planned once, the cap on signatures, structures that change,
and step counters and overlapping steps that strike a signature, all with bounded state."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from budget_util import FAST, assert_bitwise
from torch import nn

import offload


def test_each_signature_is_profiled_and_planned_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Tanh())
    sizes = [32, 32, 48, 32, 48, 48]
    ref = [p.detach().clone() for p in model.parameters()]
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    predicted = []
    with mgr:
        pass  # a step without forward changes nothing
    for i, n in enumerate(sizes):
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(i))
        model.zero_grad(set_to_none=True)
        with mgr:
            loss = model(x).sum()
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        # The same step without the manager.
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        for g, p in zip(got, model.parameters(), strict=True):
            assert torch.equal(g, p.grad)
        predicted.append(mgr.stats.last.predicted_peak_bytes)
    mgr.close()
    assert mgr.stats.total.records_offloaded_cpu > 0
    assert [torch.equal(a, b) for a, b in zip(ref, model.parameters(), strict=True)]
    assert sorted(mgr.plans) == ["float32[32,64]", "float32[48,64]"]
    # First step of each signature profiles (no prediction); later ones execute their plan.
    assert predicted[0] == 0 and predicted[2] == 0
    assert predicted[1] == predicted[3] == mgr.plans["float32[32,64]"].predicted_peak_bytes
    assert predicted[4] == predicted[5] == mgr.plans["float32[48,64]"].predicted_peak_bytes


class KeywordInputs(nn.Module):
    """Called as ``model(x=..., scale=...)``, as many trainers call their models."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Tanh())

    def forward(self, *, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.net(x) * scale


def test_keyword_inputs_are_part_of_the_signature() -> None:
    """docs/design.md: a signature is the shapes and dtypes of the root module's inputs: keyword ones
    too, or a new batch size passed by keyword would run another signature's plan."""
    torch.manual_seed(0)
    model = KeywordInputs()
    mgr = offload.ActivationOffloader(model, gpu_budget="96KiB", hardware=FAST, min_offload_bytes=0)
    try:
        for i, n in enumerate([32, 32, 48, 48]):
            x = torch.randn(n, 64, generator=torch.Generator().manual_seed(i))
            model.zero_grad(set_to_none=True)
            with mgr:
                loss = model(x=x, scale=torch.tensor(2.0)).sum()
            loss.backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            model(x=x, scale=torch.tensor(2.0)).sum().backward()
            for g, p in zip(got, model.parameters(), strict=True):
                assert torch.equal(g, p.grad)
            assert mgr.stats.last.unplanned_records == 0
        assert mgr.stats.total.records_offloaded_cpu > 0
        assert sorted(mgr.plans) == [
            "scale=float32[];x=float32[32,64]",
            "scale=float32[];x=float32[48,64]",
        ]
    finally:
        mgr.close()


def test_signatures_past_the_cap_share_a_plan_of_per_key_maxima(caplog) -> None:
    """Eight signatures are profiled and planned each; later ones run one plan made from the
    per-key byte maxima of those eight (docs/design.md, Keys and signatures): a smaller new shape
    follows it (no unplanned record, held bytes within budget), a larger one sends its larger
    records to the first tier with room; gradients stay bitwise throughout."""
    import logging

    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    budget = 24 << 10  # the largest profiled shape (64 rows) saves 36 KiB: some must move

    def step(mgr: offload.ActivationOffloader | None, rows: int) -> dict[str, torch.Tensor]:
        x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    profiled = [8 * k for k in range(1, 9)]
    for rows in profiled:
        for _ in range(2):  # profiled, then planned
            assert_bitwise([step(mgr, rows)], [step(None, rows)])
    assert len(mgr.plans) == len(profiled)  # every one of the eight got its own plan
    with caplog.at_level(logging.WARNING, logger="offload"):
        with SavedBytes.on(mgr) as saved:
            got = step(mgr, 44)  # new, between the profiled shapes
    assert "per-key byte maxima of the 8" in caplog.text
    last = mgr.stats.last
    merged = mgr.plan
    assert merged is not None and merged.signature == "<per-key maxima of 8 signatures>"
    assert last.unplanned_records == 0 and last.predicted_peak_bytes == merged.predicted_peak_bytes
    assert 0 < saved.peak_planned <= merged.predicted_peak_bytes <= budget
    assert_bitwise([got], [step(None, 44)])
    # Larger than every profiled shape: its larger records are not the plan's to place.
    assert_bitwise([step(mgr, 96)], [step(None, 96)])
    assert mgr.stats.last.unplanned_records > 0
    assert mgr.plans["float32[96,16]"] is merged
    # Later signatures share the merged plan's lookup tables, not a copy each.
    assert (
        mgr._budget._active_plans["float32[96,16]"]
        is mgr._budget._active_plans[merged_sig(mgr, 44)]
    )
    mgr.close()


def merged_sig(mgr: Any, rows: int) -> str:
    return next(s for s in mgr.plans if s.startswith(f"float32[{rows},"))


def test_planned_steps_do_not_rebuild_the_profile() -> None:
    """Once every profiled signature is planned, a step does not read the profiler's trace again
    (it did at every step: 58 ms per pipeline round in bench_pipeline's CPU run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    mgr = offload.ActivationOffloader(model, gpu_budget="16KiB", hardware=FAST, min_offload_bytes=0)
    for _ in range(2):  # profiled, then planned
        with mgr:
            loss = model(x).sum()
        loss.backward()
    assert mgr.plan is not None and mgr._budget._profiler is not None

    def no_trace() -> None:
        raise AssertionError("the profile was read again")

    mgr._budget._profiler.trace = no_trace  # type: ignore[method-assign]
    for _ in range(2):
        with mgr:
            loss = model(x).sum()
        loss.backward()
    assert mgr.stats.last.predicted_peak_bytes > 0
    mgr.close()


class Depth(nn.Module):
    """A forward whose structure its plain arguments choose: ``depth`` runs the middle layer
    that many times; ``cfg`` may scale the result."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, depth: int = 1, cfg: Any = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        for _ in range(depth):
            h = torch.sigmoid(self.b(h)) * h
        if cfg is not None and cfg.get("scale"):
            h = h * cfg["scale"]
        return self.c(h)


def _depth_step(model: nn.Module, mgr: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(len(args)))
    model.zero_grad(set_to_none=True)
    with mgr if mgr is not None else contextlib.nullcontext():
        loss = model(x, *args, **kwargs).pow(2).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_plain_arguments_of_the_root_are_part_of_the_signature() -> None:
    """NOTE [ Signatures ]: ``model(x, depth)`` with depth 1 then 3 are two signatures, each
    profiled and planned. Before, both were ``float32[32,64]``: depth 3 ran depth 1's plan with
    8 records unplanned and held 196,608 saved bytes against a budget of 81,920."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = Depth()
    budget = 80 << 10
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    try:
        for depth in (1, 1, 3, 3):
            with SavedBytes.on(mgr) as saved:
                got = _depth_step(model, mgr, depth)
            last = mgr.stats.last
            assert_bitwise([got], [_depth_step(model, None, depth)])
            if last.predicted_peak_bytes:  # a planned step
                assert last.unplanned_records == 0
                assert saved.peak_planned <= last.predicted_peak_bytes <= budget
        assert sorted(mgr.plans) == ["float32[32,64];1", "float32[32,64];3"]
        assert mgr.stats.last.predicted_peak_bytes > 0  # depth 3's second step ran its own plan
    finally:
        mgr.close()


class Switched(nn.Module):
    """A forward whose structure something outside its signature switches (NOTE [ Structure ]):
    a float argument (``cause="float"``), an attribute set between steps (``"attr"``), or the
    data (``"data"``). The branch runs ops in the root's own call, so the root's later packs
    shift their ordinals, and a module of its own."""

    def __init__(self, cause: str) -> None:
        super().__init__()
        self.cause, self.use_extra = cause, False
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)
        self.extra = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))

    def forward(self, x: torch.Tensor, p: float = 0.0) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        switch = {"float": p > 0, "attr": self.use_extra, "data": bool(x[0, 0] > 0)}
        if switch[self.cause]:
            h = torch.sigmoid(self.extra(h)) * h
        return self.c(torch.tanh(self.b(h)))


def _switched_step(model: Switched, mgr: Any, s: int, on: bool) -> dict[str, torch.Tensor]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s))
    x[0, 0] = 1.0 if on else -1.0
    model.use_extra = on
    model.zero_grad(set_to_none=True)
    with mgr if mgr is not None else contextlib.nullcontext():
        loss = model(x, 0.5 if on else 0.0).pow(2).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_switched(cause: str, pattern: list[bool]) -> tuple[Any, list[Any], list[int], list[str]]:
    """Steps of ``pattern`` (True: the branch runs) under a budget above keeping everything of
    either structure (80 KiB without the branch, 176 KiB with it); gradients checked bitwise."""
    from offload._live import SavedBytes

    torch.manual_seed(0)
    model = Switched(cause)
    mgr = offload.ActivationOffloader(
        model, gpu_budget=192 << 10, hardware=FAST, min_offload_bytes=0
    )
    stats, peaks, said = [], [], []
    for s, on in enumerate(pattern):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with SavedBytes.on(mgr) as saved:
                got = _switched_step(model, mgr, s, on)
        said += [str(w.message) for w in caught if "offload" in str(w.message)]
        assert_bitwise([got], [_switched_step(model, None, s, on)])
        stats.append(mgr.stats.last)
        peaks.append(saved.peak)
    return mgr, stats, peaks, said


@pytest.mark.parametrize("cause", ["float", "attr", "data"])
def test_a_structure_outside_the_signature_is_followed_and_profiled_again(cause: str) -> None:
    """NOTE [ Structure ]: a planned step whose forward packs off its plan's sequence runs the
    rest unplanned (first tier with room), warns once naming the causes and the fix, and the
    signature's next step profiles the new structure, which gets a plan of its own; back to the
    old structure, the next profile finds it and its plan runs again. Before, every step with
    the branch ran the plan of the step without it: 6 of 16 records unplanned, 249,856 saved
    bytes held against a budget of 196,608 (keeping everything holds 180,224: a storage kept
    under one shifted key and reloaded under another), said nowhere; now 114,688 at the step
    that left its plan, 180,224 under the branch's own plan."""
    budget = 192 << 10
    pattern = [False, False, False, True, True, True, False, False, False]
    mgr, stats, peaks, said = _run_switched(cause, pattern)
    try:
        base = "float32[32,64];float"
        assert max(peaks) <= budget, peaks
        assert sorted(mgr.plans) == [base, f"{base} [structure 2]"]
        # Step 3 left the plan of the structure without the branch; step 4 profiled the new
        # one; step 5 ran its plan, as predicted.
        assert stats[3].unplanned_records > 0 and stats[4].predicted_peak_bytes == 0
        assert stats[5].unplanned_records == 0
        assert 0 < peaks[5] <= stats[5].predicted_peak_bytes <= budget
        # Back without the branch: step 6 left structure 2's plan, step 7 profiled and found
        # the first structure, whose plan step 8 ran.
        assert stats[6].unplanned_records > 0 and stats[7].predicted_peak_bytes == 0
        assert stats[8].unplanned_records == 0 and stats[8].predicted_peak_bytes > 0
        assert mgr.plan is mgr.plans[base]
        assert len(said) == 1, said
        assert f"signature {base} left its plan at pack 2" in said[0]
        assert "bool, int or str" in said[0] and "keep=" in said[0]
    finally:
        mgr.close()


def test_a_structure_changing_every_step_stops_being_profiled_said_once() -> None:
    """NOTE [ Structure ]: when the structure alternates, each re-profile finds the structure
    that had just diverged; after two in a row the signature is no longer profiled again (said
    once), and steps off their plan keep running their rest unplanned within the budget
    (before: every step with the branch held 249,856 bytes against 196,608)."""
    budget = 192 << 10
    pattern = [False, False] + [True, False] * 5
    mgr, stats, peaks, said = _run_switched("attr", pattern)
    try:
        assert max(peaks) <= budget, peaks
        profiled = [i for i, s in enumerate(stats) if s.predicted_peak_bytes == 0]
        assert profiled == [0, 3, 5], profiled
        assert all(stats[i].unplanned_records > 0 for i in range(6, len(pattern), 2))
        assert all(stats[i].unplanned_records == 0 for i in range(7, len(pattern), 2))
        assert len(said) == 2 and "from step to step" in said[1], said
    finally:
        mgr.close()


def test_a_known_structure_found_again_inside_the_step_leaves_no_recording_behind() -> None:
    """NOTE [ Structure ]: a re-profile that finds a structure already planned is dropped. With
    the backward inside the step the profile had ended (and the recorder kept the step) before
    the structure was named, and only the manager forgot it: every switch back kept one more
    step in the recorder for good (24 steps switching every 3: 10 recorded steps and 120
    records where 4 and 48 describe the two structures; a long run grows without end). Now the
    structure is named before the profile ends, so a known one is discarded while it is still
    being recorded."""
    torch.manual_seed(0)
    model = Switched("attr")
    mgr = offload.ActivationOffloader(
        model, gpu_budget=192 << 10, hardware=FAST, min_offload_bytes=0
    )
    pattern = ([False] * 3 + [True] * 3) * 4
    recorded = []
    try:
        for s, on in enumerate(pattern):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s))
            x[0, 0] = 1.0 if on else -1.0  # as _switched_step's
            model.use_extra = on
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the structure's change, said once
                with mgr:
                    model(x).pow(2).sum().backward()
            got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert_bitwise([got], [_switched_step(model, None, s, on)])
            recorded.append(mgr._budget._profiler.recorder.steps_recorded)
        assert sorted(mgr.plans) == ["float32[32,64]", "float32[32,64] [structure 2]"]
        # Each structure's profile and its timing step; the re-profiles since kept nothing.
        assert recorded[5:] == [4] * (len(pattern) - 5), str(recorded)
    finally:
        mgr.close()


def test_signature_parts_of_plain_settings() -> None:
    import enum

    from offload._planned import signature_of

    class Kind(enum.Enum):
        CAUSAL = 1

    x = torch.zeros(2, 3)
    assert signature_of((x,)) == "float32[2,3]"  # tensors alone read as before
    assert signature_of((x, None, True, 3, Kind.CAUSAL, torch.bfloat16)) == (
        "float32[2,3];None;True;3;Kind.CAUSAL;bfloat16"
    )
    # Nested settings, by their dict key; a float is its type only; other objects are left out.
    assert signature_of((), {"cfg": {"depth": 2, "p": 0.1, "fn": print}, "x": [x, "sdpa"]}) == (
        "cfg=depth:2;cfg=p:float;x=float32[2,3];x='sdpa'"
    )
    assert signature_of((0.1,)) == signature_of((0.7,)) == "float"
    long = "a" * 100
    assert signature_of((long,)) == signature_of((long,)) != signature_of(("b" * 100,))
    assert len(signature_of((long,))) < 16
    # numpy's bool reads as a bool; a long list of settings is compacted (its head and a crc32),
    # still told apart; a container holding itself is looked into only so deep.
    import numpy as np

    assert signature_of((np.bool_(True),)) == signature_of((True,)) == "True"
    many = list(range(100_000))
    assert len(signature_of((x, many))) <= 1024
    assert signature_of((x, many)) != signature_of((x, [*many[:-1], -1]))
    assert signature_of((x, many)).startswith("float32[2,3];0;1;2")
    cyclic: dict = {"depth": 2}
    cyclic["self"] = cyclic
    assert signature_of((x,), {"cfg": cyclic}).startswith("float32[2,3];cfg=depth:2;cfg=depth:2")


def test_a_step_counter_among_the_arguments_keeps_memory_and_plans_bounded() -> None:
    """An int that changes every step makes each step a new signature: 8 are profiled, every
    later one runs the plan of their per-key maxima (held within the budget, no unplanned
    record, bitwise), and ``mgr.plans`` names at most 8 + MAX_SHARED_SIGNATURES of them."""
    from offload._live import SavedBytes
    from offload._planned import MAX_SHARED_SIGNATURES, MAX_SIGNATURES

    torch.manual_seed(0)
    model = _Counted()
    budget = 12 << 10  # 32 rows save 18 KiB: some must move
    x = torch.randn(32, 16)
    steps = MAX_SIGNATURES + MAX_SHARED_SIGNATURES + 8
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=FAST, min_offload_bytes=0)
    try:
        for i in range(steps):
            model.zero_grad(set_to_none=True)
            with SavedBytes.on(mgr) as saved:
                with mgr:
                    loss = model(x, i).pow(2).sum()
                loss.backward()
            got = {n: p.grad.clone() for n, p in model.named_parameters()}
            last = mgr.stats.last
            if i >= MAX_SIGNATURES:
                assert last.predicted_peak_bytes > 0 and last.unplanned_records == 0, i
                assert saved.peak_planned <= last.predicted_peak_bytes <= budget
            if i % 16 == 0 or i == steps - 1:
                model.zero_grad(set_to_none=True)
                model(x, i).pow(2).sum().backward()
                assert_bitwise([got], [{n: p.grad for n, p in model.named_parameters()}])
        assert len(mgr.plans) == MAX_SIGNATURES + MAX_SHARED_SIGNATURES
        assert len(mgr._budget._active_plans) <= MAX_SHARED_SIGNATURES + 1
        assert f"float32[32,16];{steps - 1}" in mgr.plans  # the most recent are named
        assert "float32[32,16];8" not in mgr.plans
    finally:
        mgr.close()


class _Counted(nn.Module):
    """A root taking an int it does not use: each value is an input signature of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor, step: Any) -> torch.Tensor:
        return self.net(x)


_MICROBATCHES = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)) for i in (0, 1)]


def _accumulate(
    model: nn.Module, mgr: offload.ActivationOffloader, arg: Any, *, overlapped: bool = True
) -> None:
    """One optimizer step of two microbatches, each forward in its own block; ``overlapped``:
    both forwards before their backwards. Gradients bitwise equal to the same loop without
    the manager."""
    grads = []
    for m in (mgr, None):
        model.zero_grad(set_to_none=True)
        losses = []
        for x in _MICROBATCHES:
            with m if m is not None else contextlib.nullcontext():
                losses.append(model(x, arg).pow(2).sum())
            if not overlapped:
                losses.pop().backward()
        for loss in losses:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_bitwise(grads[:1], grads[1:])


def _grown(mgr: offload.ActivationOffloader) -> dict[str, int]:
    """The manager's sets and maps holding more than MAX_SIGNATURES entries (none of these runs
    shares a plan past the cap, which may name 64 more)."""
    from offload._planned import MAX_SIGNATURES

    return {
        n: len(v)
        for n, v in vars(mgr).items()
        if isinstance(v, (set, dict)) and len(v) > MAX_SIGNATURES
    }


def _offload_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("offload:")]


def test_a_step_counter_under_accumulation_keeps_the_strike_counts_bounded() -> None:
    """A step counter among the root's arguments with two forwards before their backwards: each
    optimizer step is a new signature whose profile the second microbatch cuts short (one
    strike in ``_unfinished``) and whose second microbatch is not profiled (one in
    ``_overlap_skips``). Both maps kept an entry per signature for good: 200 each after 200
    optimizer steps, and ``_structures`` the structure of each dropped profile (200). Now only
    the most recent MAX_SIGNATURES signatures are counted, and no map grows."""
    from offload._planned import MAX_SIGNATURES

    torch.manual_seed(0)
    model = _Counted()
    mgr = offload.ActivationOffloader(
        model, gpu_budget=12 << 10, hardware=FAST, min_offload_bytes=0
    )
    try:
        with pytest.warns(RuntimeWarning, match="steps in a row"):  # see the test below
            for i in range(200):
                _accumulate(model, mgr, i)
        assert len(mgr._budget._unfinished) <= MAX_SIGNATURES
        assert len(mgr._budget._overlap_skips) <= MAX_SIGNATURES
        assert _grown(mgr) == {}
    finally:
        mgr.close()


def test_budget_mode_that_never_plans_says_so_once() -> None:
    """A step counter among the root's arguments with two forwards before their backwards: every
    profile is cut short by the next microbatch and every signature is struck once, never twice,
    so no plan was made in 48 steps, every one ran in min-memory mode, and nothing said so (no
    warning; ``min_memory_steps`` 0 of 48). Now one warning at the 16th such step names both
    causes and the fix, and the steps that were not profiled are counted."""
    torch.manual_seed(0)
    model = _Counted()
    mgr = offload.ActivationOffloader(
        model, gpu_budget=12 << 10, hardware=FAST, min_offload_bytes=0
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(24):
                _accumulate(model, mgr, i)
                if i == 6:
                    assert _offload_warnings(caught) == []  # 14 such steps: not yet
        said = _offload_warnings(caught)
        assert len(said) == 1, said
        assert caught[0].category is RuntimeWarning and caught[0].filename == __file__
        msg = said[0]
        assert "16 steps in a row" in msg
        assert "with mgr:" in msg and "mgr.attach" in msg  # overlapping steps
        assert "8 input signatures" in msg and "step counter" in msg and "float" in msg
        assert mgr.plans == {}
        total = mgr.stats.total
        assert total.steps == 48 and total.min_memory_steps == 24  # the second microbatches

        # The documented loop (each microbatch's backward before the next forward), the counter
        # passed as a float: one signature, profiled and planned, nothing more said.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(24, 28):
                _accumulate(model, mgr, float(i), overlapped=False)
        assert _offload_warnings(caught) == []
        assert list(mgr.plans) == ["float32[32,16];float"]
        assert mgr.stats.last.predicted_peak_bytes > 0
    finally:
        mgr.close()


def test_overlapping_steps_of_one_signature_warn_once() -> None:
    """Without a step counter the signature's own strikes say it (at its second cut-short
    profile), at the user's line (it pointed into offload/_offloader.py); the run-wide warning
    does not say it again."""
    torch.manual_seed(0)
    model = _Counted()
    mgr = offload.ActivationOffloader(
        model, gpu_budget=12 << 10, hardware=FAST, min_offload_bytes=0
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(24):
                _accumulate(model, mgr, 0)
        said = _offload_warnings(caught)
        assert len(said) == 1 and "began before the backward" in said[0], said
        # At the user's line (_accumulate's `with mgr:`), not inside offload.
        where = [w.filename for w in caught if str(w.message).startswith("offload:")]
        assert where == [__file__], where
        assert mgr.plans == {}
    finally:
        mgr.close()


def test_a_counter_every_other_step_under_accumulation_keeps_state_bounded() -> None:
    """A step counter that changes every other optimizer step, with two forwards before their
    backwards: each signature's profile is cut short twice, and it runs in min-memory mode from
    then on. ``_infeasible`` kept every such signature for good (100 after 200 optimizer
    steps) and ``_structures`` every dropped profile's (100). Now at most MAX_SIGNATURES of
    each, with no signature planned again and again."""
    from offload._planned import MAX_SIGNATURES

    torch.manual_seed(0)
    model = _Counted()
    mgr = offload.ActivationOffloader(
        model, gpu_budget=12 << 10, hardware=FAST, min_offload_bytes=0
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(200):
                _accumulate(model, mgr, i // 2)
        assert _grown(mgr) == {}
        assert len(mgr._budget._struck) == MAX_SIGNATURES
        assert mgr.plans == {} and not mgr._budget._profiled
        said = _offload_warnings(caught)
        assert len(said) == 2, said  # the first struck signature, then the run
        assert "began before the backward" in said[0] and "steps in a row" in said[1]
    finally:
        mgr.close()


def test_a_struck_signature_forgotten_and_met_again_starts_fresh() -> None:
    """A signature struck for overlapping steps, then pushed out by MAX_SIGNATURES newer struck
    ones, starts fresh when met again: its loop now runs each backward before the next forward,
    so it is profiled and planned (before, it stayed in min-memory mode for good). A signature
    whose budget cannot be met stays so however many signatures are struck: forgetting it
    would have it planned again at every step (it stays among the profiled ones)."""
    from offload._planned import MAX_SIGNATURES

    torch.manual_seed(0)
    model = _Counted()
    mgr = offload.ActivationOffloader(
        model, gpu_budget=12 << 10, hardware=FAST, min_offload_bytes=0, on_infeasible="min_memory"
    )
    big = torch.randn(4096, 16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _accumulate(model, mgr, "first", overlapped=False)  # a feasible first signature
            _accumulate(model, mgr, "first", overlapped=False)
            with mgr:
                loss = model(big, "big").sum()  # 4096 rows: no plan holds 12 KiB
            loss.backward()
            for _ in range(2):
                with mgr:
                    loss = model(big, "big").sum()
                loss.backward()
                assert mgr.stats.last.min_memory_steps == 1
            for i in range(2 * (MAX_SIGNATURES + 1)):
                _accumulate(model, mgr, i // 2)  # struck, each twice
            for _ in range(3):
                _accumulate(model, mgr, 0, overlapped=False)
            assert "float32[32,16];0" in mgr.plans
            assert mgr.stats.last.predicted_peak_bytes > 0
            with mgr:
                loss = model(big, "big").sum()
            loss.backward()
        assert mgr.stats.last.min_memory_steps == 1
        assert "float32[4096,16];'big'" not in mgr.plans
    finally:
        mgr.close()


def test_many_shapes_past_the_cap_keep_plans_bounded() -> None:
    """Varying lengths past the 8 profiled: ``mgr.plans`` named every one of them (57 entries
    after 200 steps of 57 lengths); now at most 8 + MAX_SHARED_SIGNATURES, the most recent."""
    from offload._planned import MAX_SHARED_SIGNATURES, MAX_SIGNATURES

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    mgr = offload.ActivationOffloader(
        model, gpu_budget=24 << 10, hardware=FAST, min_offload_bytes=0
    )
    rows = [8 * k for k in range(1, MAX_SIGNATURES + 1)] + list(range(1, 81))
    try:
        for n in rows:
            with mgr:
                loss = model(torch.randn(n, 16)).sum()
            loss.backward()
        assert len(mgr.plans) <= MAX_SIGNATURES + MAX_SHARED_SIGNATURES
        assert "float32[80,16]" in mgr.plans
    finally:
        mgr.close()
