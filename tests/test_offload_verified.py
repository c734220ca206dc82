"""Recomputation never changes results: modules the model checkpoints itself and blocks that
write their input in place are not recomputed, and the first planned step verifies every other
recomputed module (NOTE [ Verified recomputation ] in offload/_verify.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import lifecycle
from offload._verify import same_bits
from offload.lifecycle import HardwareModel

# A 1 MB/s link: the planner recomputes rather than offloads.
SLOW = HardwareModel.cpu_only(
    copy_bytes_per_s=1e6, disk_write_bytes_per_s=1e6, disk_read_bytes_per_s=1e6
)
STEPS = 4


class Block(nn.Module):
    """LayerNorm, Linear 64->256, GELU, Linear 256->64; ``noise``: times uniform noise drawn
    from ``gen`` (``"attribute"``: a generator of its own, ``self.gen``; ``"hidden"``: one held
    in a list, which no attribute scan finds); ``writes_input``: opens with
    ``LeakyReLU(0.2, inplace=True)``, as pix2pix U-Net blocks do."""

    def __init__(self, noise: str = "", writes_input: bool = False, device: str = "cpu") -> None:
        super().__init__()
        self.norm, self.fc1 = nn.LayerNorm(64), nn.Linear(64, 256)
        self.act, self.fc2 = nn.GELU(), nn.Linear(256, 64)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True) if writes_input else None
        self.noise = noise
        if noise == "attribute":
            self.gen = torch.Generator(device).manual_seed(7)
        elif noise in ("hidden", "route"):
            self.gens = [torch.Generator(device).manual_seed(7)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lrelu is not None:
            x = self.lrelu(x)
        h = self.act(self.fc1(self.norm(x)))
        if self.noise == "route":  # how many features go on: drawn (another shape each call)
            k = int(torch.randint(128, 257, (1,), generator=self.gens[0]))
            return nn.functional.linear(h[:, :k], self.fc2.weight[:, :k], self.fc2.bias)
        if self.noise:
            gen = self.gen if self.noise == "attribute" else self.gens[0]
            h = h * torch.rand(h.shape, generator=gen, device=h.device)
        return self.fc2(h)


class Residual(nn.Module):
    """4 residual blocks; ``checkpointed``: the blocks the model runs under non-reentrant
    ``torch.utils.checkpoint`` itself; ``make``: each block by index."""

    def __init__(self, make: Callable[[int], Block], checkpointed: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(make(i) for i in range(4))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if i in self.checkpointed:
                x = x + checkpoint(b, x, use_reentrant=False)
            elif b.lrelu is not None:
                x = x + b(x * 1.0)  # the block writes its own input, not the residual
            else:
                x = x + b(x)
        return x


def run(
    make: Callable[[], Residual], reseed: bool = False
) -> tuple[offload.ActivationOffloader, list[warnings.WarningMessage]]:
    """Train ``make()`` under a manager (budget 60% of the profile's peak, SLOW link) beside a
    run without offloading, asserting bitwise equal gradients at every step; the manager (still
    open) and the warnings it gave. ``reseed``: each step seeds the hidden generators first."""
    ref, model, probe = make(), make(), make()
    model.load_state_dict(ref.state_dict())
    xs = [torch.randn(256, 64, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    trace = offload.profile(lambda: probe(xs[0]).pow(2).sum().backward(), probe)
    mgr = offload.ActivationOffloader(
        model, gpu_budget=int(0.6 * trace.peak_saved_bytes), hardware=SLOW, min_offload_bytes=0
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step, x in enumerate(xs):
            for m, ctx in ((ref, contextlib.nullcontext()), (model, mgr)):
                if reseed:
                    for b in m.blocks:
                        if b.noise in ("hidden", "route"):
                            b.gens[0].manual_seed(100 + step)
                m.zero_grad(set_to_none=True)
                with ctx:
                    loss = m(x).pow(2).sum()
                loss.backward()
            for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad), (step, name)
            if step == 1:
                # The first planned step recomputed (this test is not vacuous).
                assert mgr.stats.last.bytes_recomputed > 0
    return mgr, [w for w in said if "offload" in str(w.message)]


def recomputed(mgr: offload.ActivationOffloader) -> set[str]:
    plan = mgr.plan
    assert plan is not None
    return {m for m, _ in plan.recompute_calls}


def test_blocks_the_model_checkpoints_itself_are_not_recomputed() -> None:
    """Blocks 1 and 3 under the model's own non-reentrant checkpoint: a plan that recomputed
    one (checkpoint inside checkpoint) made every planned backward raise CheckpointError
    ("Recomputed values ... different metadata"). The trace names them and everything inside;
    the plan recomputes only blocks 0 and 2."""
    mgr, said = run(lambda: Residual(lambda i: Block(), checkpointed=(1, 3)))
    try:
        assert recomputed(mgr) and recomputed(mgr) <= {"blocks.0", "blocks.2"}
        trace = mgr._budget._profiler.trace()
        assert {"blocks.1", "blocks.3", "blocks.1.fc1"} <= set(
            trace.metadata["checkpointed_modules"]
        )
        # The plan's own checkpoints, recorded on the first planned step, are not the model's.
        assert "blocks.0.fc1" not in trace.metadata["checkpointed_modules"]
        assert not said
    finally:
        mgr.close()


def test_blocks_that_write_their_input_in_place_are_not_recomputed() -> None:
    """Blocks 1 and 3 open with LeakyReLU(inplace=True) on their input, which checkpoint saved:
    recomputing one made every planned backward raise "modified by an inplace operation". The
    trace names them; the plan recomputes only the others."""
    mgr, said = run(lambda: Residual(lambda i: Block(writes_input=i % 2 == 1)))
    try:
        assert recomputed(mgr) and not recomputed(mgr) & {"blocks.1", "blocks.3"}
        meta = mgr._budget._profiler.trace().metadata
        assert {"blocks.1", "blocks.3"} <= set(meta["input_writing_modules"])
        assert not said
    finally:
        mgr.close()


def test_a_modules_own_generator_is_replayed_and_it_stays_recomputed() -> None:
    """Blocks 1 and 3 draw noise from a torch.Generator of their own (``self.gen``), which
    checkpoint does not replay: recomputing them gave other gradients from the first planned
    step on. Their generators are replayed now: the first planned step verifies them equal, and
    they stay recomputed (no false exclusion), with no warning."""
    mgr, said = run(lambda: Residual(lambda i: Block(noise="attribute" if i % 2 else "")))
    try:
        assert {"blocks.1", "blocks.3"} <= recomputed(mgr)
        assert mgr.stats.last.bytes_recomputed > 0
        assert not mgr._budget._verifier.differing
        assert not said
    finally:
        mgr.close()


@pytest.mark.parametrize("noise", ["hidden", "route"])
def test_a_recomputation_that_differs_is_found_excluded_and_warned_once(noise: str) -> None:
    """Blocks 1 and 3 draw from a generator no attribute scan finds: their recomputation
    differs. The first planned step finds it, yet its gradients are exact (it uses what the
    forward saved); the signature is planned again without them, the other blocks stay
    recomputed, and each is named in one warning. (The loop seeds those generators each step,
    as the recomputation that finds the difference advances them once more.) ``route``: the
    draw picks how many features go on, so the recomputation saves tensors of other shapes,
    which checkpoint refuses (CheckpointError): found the same way."""
    mgr, said = run(lambda: Residual(lambda i: Block(noise=noise if i % 2 else "")), reseed=True)
    try:
        assert list(mgr._budget._verifier.differing) and set(mgr._budget._verifier.differing) <= {
            "blocks.1",
            "blocks.3",
        }
        # The plan made again recomputes the other blocks, and so does its refinement: the
        # first step of the new plan, recorded for its timings, recomputed them verified (no
        # tap) under checkpoints the recorder knows for the plan's, not the model's.
        assert mgr.plan.metadata.get("refined")
        left = recomputed(mgr)
        assert left and not left & {"blocks.1", "blocks.3"}
        assert "checkpointed_modules" not in mgr._budget._profiler.trace().metadata
        named = [str(w.message) for w in said]
        assert len(named) == len(mgr._budget._verifier.differing)
        for name in mgr._budget._verifier.differing:
            assert sum(f"module {name!r}" in m for m in named) == 1
    finally:
        mgr.close()


def test_same_bits_compares_bits() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone())
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.ones(2), torch.ones(3))
    assert same_bits(torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64))
    assert same_bits(torch.tensor([True]), torch.tensor([True]))
    assert not same_bits(torch.ones(2, dtype=torch.float16), torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int8])
def test_same_bits_reads_every_element_size(dtype: torch.dtype) -> None:
    a = torch.arange(6).to(dtype).reshape(2, 3).t()  # not contiguous
    b = a.clone()
    assert same_bits(a, b)
    b[1, 1] += 1
    assert not same_bits(a, b)


def test_the_planner_leaves_out_the_blocks_the_trace_names() -> None:
    """How far each name reaches: a module the model checkpoints, or one whose recomputation
    differed, takes out every block that is, holds or lies inside it; a module writing its own
    input takes out only the block that is it (an in-place activation inside a block writes
    a tensor the block made, and the block stays a candidate)."""
    model = Residual(lambda i: Block())
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    trace = offload.profile(lambda: model(x).pow(2).sum().backward(), model)
    budget = int(0.6 * trace.peak_saved_bytes)

    def planned(**names: list[str]) -> set[str]:
        marked = dataclasses.replace(trace, metadata={**trace.metadata, **names})
        p = lifecycle.plan(marked, budget, SLOW, min_offload_bytes=0)
        return {m for m, _ in p.recompute_calls}

    free = planned()
    assert len(free) >= 2
    last = max(free)
    assert planned(input_writing_modules=[f"{last}.act"]) == free
    for names in (
        {"input_writing_modules": [last]},
        {"checkpointed_modules": [f"{last}.fc1"]},
        {"recompute_mismatch_modules": [f"{last}.fc1"]},
        {"recompute_mismatch_modules": [last]},
    ):
        left = planned(**names)
        assert left and last not in left, names


# A 1 MB/s link on a GPU: the planner recomputes rather than offloads.
GLACIAL = HardwareModel(
    h2d_bytes_per_s=1e6,
    d2h_bytes_per_s=1e6,
    duplex_bytes_per_s=2e6,
    disk_write_bytes_per_s=1e6,
    disk_read_bytes_per_s=1e6,
)


@pytest.mark.gpu
@pytest.mark.parametrize("noise", ["attribute", "hidden"])
def test_verified_recomputation_on_cuda(noise: str) -> None:
    """On a GPU (CUDA generators, unpacks on autograd's device thread): blocks 1 and 3 draw
    from CUDA generators of their own; held as attributes they are replayed and stay
    recomputed, held in a list their recomputation differs, is found on the first planned step
    and left out. Gradients stay bitwise equal to a run without offloading at every step."""

    def make() -> Residual:
        return Residual(lambda i: Block(noise=noise if i % 2 else "", device="cuda")).cuda()

    ref, model, probe = make(), make(), make()
    model.load_state_dict(ref.state_dict())
    gen = torch.Generator("cuda")
    xs = [torch.randn(1 << 17, 64, device="cuda", generator=gen.manual_seed(i)) for i in range(4)]
    # The budget: the device's peak without offloading, less 40% of what the step adds.
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    probe(xs[0]).pow(2).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del probe
    budget = base + int(0.6 * (peak - base))
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=GLACIAL)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step, x in enumerate(xs):
                for m, ctx in ((ref, contextlib.nullcontext()), (model, mgr)):
                    for b in m.blocks:
                        if b.noise == "hidden":
                            b.gens[0].manual_seed(100 + step)  # see the CPU test above
                    m.zero_grad(set_to_none=True)
                    with ctx:
                        loss = m(x).pow(2).sum()
                    loss.backward()
                torch.cuda.synchronize()
                for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
                    assert torch.equal(a.grad, b.grad), (step, name)
                if step == 1:
                    assert mgr.stats.last.bytes_recomputed > 0
        named = [str(w.message) for w in said if "recomputed other values" in str(w.message)]
        if noise == "attribute":
            assert not mgr._budget._verifier.differing and not named
            assert {"blocks.1", "blocks.3"} & recomputed(mgr)
        else:
            assert mgr._budget._verifier.differing and len(named) == len(
                mgr._budget._verifier.differing
            )
            assert not recomputed(mgr) & set(mgr._budget._verifier.differing)
    finally:
        mgr.close()


def test_a_given_plan_runs_a_module_found_to_differ_as_it_is() -> None:
    """A plan given with ``plan=`` is not made again: the modules it recomputes that differ
    are named once each and run as they are from the next step on (their saves reach the
    manager: more records), and every step stays exact. (Before, with nothing profiled,
    the verification was never settled: no warning, and each step verified again.)"""

    def make() -> Residual:
        return Residual(lambda i: Block(noise="hidden" if i % 2 else ""))

    probe, ref, model = make(), make(), make()
    model.load_state_dict(ref.state_dict())
    xs = [torch.randn(256, 64, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    trace = offload.profile(lambda: probe(xs[0]).pow(2).sum().backward(), probe)
    budget = int(0.6 * trace.peak_saved_bytes)
    given = lifecycle.plan(trace, budget, SLOW, min_offload_bytes=0)
    hidden = {m for m, _ in given.recompute_calls} & {"blocks.1", "blocks.3"}
    assert hidden  # the given plan recomputes blocks that differ
    mgr = offload.ActivationOffloader(
        model, gpu_budget=budget, hardware=SLOW, min_offload_bytes=0, plan=given
    )
    records = []
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step, x in enumerate(xs):
                for m, ctx in ((ref, contextlib.nullcontext()), (model, mgr)):
                    for b in m.blocks:
                        if b.noise == "hidden":
                            b.gens[0].manual_seed(100 + step)
                    m.zero_grad(set_to_none=True)
                    with ctx:
                        loss = m(x).pow(2).sum()
                    loss.backward()
                for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
                    assert torch.equal(a.grad, b.grad), (step, name)
                records.append(mgr.stats.last.records)
        assert set(mgr._budget._verifier.differing) == hidden
        named = [str(w.message) for w in said if "recomputed other values" in str(w.message)]
        assert len(named) == len(set(named)) == len(hidden)  # once each
        assert records[0] < records[1] == records[-1]
    finally:
        mgr.close()
