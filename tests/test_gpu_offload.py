"""The runtime on a CUDA device: streams on, exactness, memory, races (skipped without CUDA).

Run with ``python -m pytest -q -m gpu tests`` (``benchmarks/gpu_check.sh`` does it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from models import ALL_MODELS, gpt_block
from torch import nn

import offload

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _deterministic_kernels():
    """Bitwise tests compare against a run without offloading: the kernels themselves must be
    deterministic (cuDNN may otherwise pick a nondeterministic weight-gradient algorithm for the
    conv net; ``benchmarks/gpu_check.sh`` also sets ``CUBLAS_WORKSPACE_CONFIG``)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _grads(case) -> dict[str, torch.Tensor]:
    return case.grads()


def _baseline(name: str) -> dict[str, torch.Tensor]:
    a = ALL_MODELS[name](seed=0, device="cuda")
    a.step()
    b = ALL_MODELS[name](seed=0, device="cuda")
    b.step()
    for k, g in a.grads().items():
        assert torch.equal(g, b.grads()[k]), (
            f"baseline is not deterministic ({k}); exactness cannot be tested"
        )
    return a.grads()


def _offloaded(
    name: str, tmp_path, **kw
) -> tuple[dict[str, torch.Tensor], offload.ActivationOffloader]:
    case = ALL_MODELS[name](seed=0, device="cuda")
    if "nvme" in kw.get("tiers", ()):
        kw["nvme_dir"] = tmp_path
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, **kw)
    case.model.zero_grad(set_to_none=True)
    with mgr:
        loss = case.loss(case.batch())
    loss.backward()
    torch.cuda.synchronize()
    return case.grads(), mgr


@pytest.mark.parametrize("tiers", [("cpu",), ("nvme",), ("cpu", "nvme")])
@pytest.mark.parametrize(
    "name", ["mlp", "gpt_block", "conv_net", "lstm", "views_model", "mixed_dtypes", "checkpointed"]
)
def test_bitwise_equal_with_streams(name: str, tiers, tmp_path) -> None:
    want = _baseline(name)
    got, mgr = _offloaded(name, tmp_path, tiers=tiers)
    try:
        assert mgr.stats.last.bytes_offloaded_cpu + mgr.stats.last.bytes_offloaded_nvme > 0
        for k, g in want.items():
            assert torch.equal(got[k], g), k
    finally:
        mgr.close()


class _Deep(nn.Module):
    def __init__(self, width: int = 2048, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _peak_of_step(
    model: nn.Module, x: torch.Tensor, mgr: offload.ActivationOffloader | None
) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if mgr is None:
        loss = model(x).float().pow(2).mean()
    else:
        with mgr:
            loss = model(x).float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_peak_memory_lower_by_offloaded_bytes_minus_window() -> None:
    torch.manual_seed(0)
    model = _Deep().cuda()
    x = torch.randn(8192, 2048, device="cuda", requires_grad=True)
    window = 128 << 20
    _peak_of_step(model, x, None)  # warm the allocator
    model.zero_grad(set_to_none=True)
    peak_none = _peak_of_step(model, x, None)
    model.zero_grad(set_to_none=True)
    mgr = offload.ActivationOffloader(model, max_inflight_bytes=window)
    try:
        _peak_of_step(model, x, mgr)
        model.zero_grad(set_to_none=True)
        peak_off = _peak_of_step(model, x, mgr)
        moved = mgr.stats.last.bytes_offloaded_cpu
        assert moved > 4 * window
        # In flight out (<= window) plus the reload look-ahead (<= window) may stay on the device.
        assert peak_off <= peak_none - moved + 2 * window + (64 << 20), (peak_none, peak_off, moved)
        assert mgr.stats.last.host_allocations == 0  # the pinned pool is reused after step 1
    finally:
        mgr.close()


def test_reloads_race_a_saturated_compute_stream() -> None:
    """Reloads run on the H2D stream while the compute stream is busy: gradients stay exact."""
    want = _baseline("gpt_block")
    case = gpt_block(seed=0, device="cuda")
    mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, max_inflight_bytes=1 << 20)
    try:
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch())
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(30):  # seconds of queued work ahead of backward on the compute stream
            a = torch.tanh(a @ a)
        loss.backward()
        torch.cuda.synchronize()
        for k, g in want.items():
            assert torch.equal(case.grads()[k], g), k
        assert float(a.float().abs().sum()) >= 0
    finally:
        mgr.close()


def test_clean_under_cuda_sanitizer(tmp_path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from models import gpt_block
        import offload
        case = gpt_block(seed=0, device="cuda")
        mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0)
        for s in range(2):
            case.model.zero_grad(set_to_none=True)
            with mgr:
                loss = case.loss(case.batch(s))
            loss.backward()
        torch.cuda.synchronize()
        mgr.close()
        print("done")
        """
    )
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=150
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "done" in r.stdout
    assert "CUDASanitizerErrors" not in r.stderr


def _smallest_feasible_budget(trace: offload.Trace, hardware: offload.HardwareModel) -> int:
    """The smallest budget the planner meets on ``trace`` (its margin included, the manager's
    default settings): a test's budget lies between it and keep-all's peak, or no plan exists."""
    try:
        offload.plan(trace, 1, hardware)
    except offload.BudgetInfeasibleError as e:
        return e.min_feasible_bytes
    raise AssertionError("a 1-byte budget was met: the step saves nothing movable")


def test_budget_bounds_the_measured_peak_from_the_second_planned_step() -> None:
    """docs/design.md "Budget": max_memory_allocated over a step stays under gpu_budget from the
    second executed step of a signature, and gradients stay bitwise equal."""
    torch.manual_seed(0)
    model = _Deep(width=2048, depth=8).cuda()
    # 16 saved tensors of 256 MiB: 4 GiB to plan against the margin, max(5% of the budget,
    # 256 MiB), and the float32 gradients, which stay on the device.
    x = torch.randn(32768, 2048, device="cuda")
    hardware = offload.HardwareModel.h200()

    def grads_without() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads_without()
    assert all(torch.equal(a, b) for a, b in zip(want, grads_without(), strict=True))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model(x).pow(2).mean().backward()
    keep_peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    trace = offload.profile(lambda: model(x).pow(2).mean().backward(), model, warmup_steps=0)
    model.zero_grad(set_to_none=True)
    floor = _smallest_feasible_budget(trace, hardware)
    assert floor < keep_peak, (floor, keep_peak)
    budget = floor + (keep_peak - floor) // 2  # halfway between the feasible ends
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=hardware)
    peaks = []
    try:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            with mgr:
                loss = model(x).pow(2).mean()
            loss.backward()
            torch.cuda.synchronize()
            peaks.append(mgr.stats.last.peak_allocated_bytes)
            got = [p.grad for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        plan = mgr.plan
    finally:
        mgr.close()
    assert plan is not None and plan.gpu_budget_bytes == budget
    assert mgr.stats.last.unplanned_records == 0
    # Step 1 profiles in min-memory mode; steps 2.. execute the plan; from step 3 the bound holds.
    assert max(peaks[2:]) <= budget, (peaks, budget, plan.predicted_peak_bytes)


class _Stage0:
    """Stage 0 of a 1F1B pipeline in one process, under the method names ``mgr.attach`` wraps:
    F(i) runs microbatch i's forward and holds its input and output; B(i) runs its backward with
    a fixed gradient (as if from stage 1)."""

    stage_index = 0

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], grads: list[torch.Tensor]):
        self.submod, self.inputs, self.grads, self.chunks = model, inputs, grads, len(inputs)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward_one_chunk(self, i: int, *a, **k) -> None:
        x = self.inputs[i].clone().requires_grad_()
        self.held[i] = (x, self.submod(x))

    def backward_one_chunk(self, i: int, *a, **k) -> None:
        _x, out = self.held.pop(i)
        out.backward(self.grads[i])

    def backward_weight_one_chunk(self, i: int, *a, **k) -> None:
        pass

    def round(self, stages: int) -> None:
        from offload.lifecycle import schedule_1f1b

        for kind, i in schedule_1f1b(stages, self.chunks)[0]:
            if kind == "F":
                self.forward_one_chunk(i)
            else:
                self.backward_one_chunk(i)


def test_pipeline_stage_budget_bounds_the_round_peak() -> None:
    """A budgeted manager attached to stage 0 of 1F1B (4 stages, 8 microbatches): from the
    second planned round, max_memory_allocated over a round stays under gpu_budget, gradients
    bitwise equal to the same rounds without offloading."""
    torch.manual_seed(0)
    model = _Deep(width=2048, depth=4).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    # 1 GiB saved per microbatch, a stash of 4 GiB: room for a plan under the margin.
    inputs = [torch.randn(16384, 2048, device="cuda", generator=gen) for _ in range(8)]
    grads = [torch.randn(16384, 2048, device="cuda", generator=gen) for _ in range(8)]
    stage = _Stage0(model, inputs, grads)
    hardware = offload.HardwareModel.h200()

    def kept_round() -> tuple[list[torch.Tensor], int, int]:
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        stage.round(stages=4)
        torch.cuda.synchronize()
        return (
            [p.grad.clone() for p in model.parameters()],
            start,
            torch.cuda.max_memory_allocated(),
        )

    want, _, _ = kept_round()  # gradients allocated from here on
    again, _, keep_peak = kept_round()
    assert all(torch.equal(a, b) for a, b in zip(want, again, strict=True))
    model.zero_grad(set_to_none=False)
    trace = offload.profile(lambda: stage.round(stages=4), model, warmup_steps=0)
    floor = _smallest_feasible_budget(trace, hardware)
    assert floor < keep_peak, (floor, keep_peak)
    budget = floor + (keep_peak - floor) // 2  # halfway between the feasible ends
    mgr = offload.ActivationOffloader(model, gpu_budget=budget, hardware=hardware)
    peaks = []
    try:
        with mgr.attach(stage):
            for _ in range(4):
                got, _, peak = kept_round()
                peaks.append(peak)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        plan = mgr.plan
    finally:
        mgr.close()
    assert plan is not None and "pipeline stage 0, 8 microbatches" in plan.signature
    # Round 1 profiles in min-memory mode; rounds 2.. execute the plan; from round 3 it holds.
    assert max(peaks[2:]) <= budget, (peaks, budget, plan.predicted_peak_bytes, keep_peak)


def test_autocast_weight_casts_rebuilt_bitwise_on_cuda() -> None:
    """NOTE [ Weight casts ]: under bf16 autocast on CUDA the saved weight casts are cast again at
    unpack, never stored or copied, and gradients stay bitwise equal."""
    torch.manual_seed(0)
    model = _Deep(width=1024, depth=4).cuda()
    x = torch.randn(2048, 1024, device="cuda")

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with mgr if mgr is not None else contextlib.nullcontext():
                loss = model(x).float().pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(None)
    assert all(torch.equal(a, b) for a, b in zip(want, grads(None), strict=True))
    mgr = offload.ActivationOffloader(model)
    try:
        for _ in range(2):
            got = grads(mgr)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        last = mgr.stats.last
    finally:
        mgr.close()
    # Every Linear but the first (whose input needs no gradient) saves its weight's cast; the GELU
    # outputs before them are rebuilt too where autocast runs GELU in bf16 (NOTE [ Activation
    # recipes ]).
    casts = 3 * 1024 * 1024 * 2
    assert last.records_rebuilt in (3, 6)
    assert last.bytes_rebuilt == casts + (last.records_rebuilt - 3) * 2048 * 1024 * 2


@pytest.mark.parametrize("source", ["keep", "cpu"])
def test_planned_rebuilds_bitwise_on_cuda(source: str) -> None:
    """NOTE [ Rebuilt outputs ]: under a plan that rebuilds the GELU / SiLU / LayerNorm outputs,
    from inputs kept or reloaded on the H2D stream (the rebuild waits for the reload's event),
    gradients stay bitwise equal on CUDA, every output is rebuilt and none is unplanned."""
    from test_offload_rebuild import REBUILDS, _act_mlp, _assert_bitwise, _forced, _profile, _step

    from offload.lifecycle import Placement

    model = _act_mlp().cuda()
    x = torch.randn(64, 128, 64, device="cuda")
    want = _step(model, x)
    _assert_bitwise(_step(model, x), want)
    plan = _forced(_profile(model, x), child=Placement.REBUILD, parent=Placement(source))
    mgr = offload.ActivationOffloader(model, plan=plan, min_offload_bytes=0)
    try:
        for _ in range(3):
            _assert_bitwise(_step(model, x, mgr), want)
            last = mgr.stats.last
            assert last.records_rebuilt == REBUILDS and last.unplanned_records == 0
    finally:
        mgr.close()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_outputs_rebuilt_bitwise_on_cuda(kind: str, autocast: bool) -> None:
    """NOTE [ Activation recipes ]: in min-memory mode the nn.LayerNorm / nn.RMSNorm outputs
    (under autocast, the bf16 casts of them the Linears save) are rebuilt on the compute stream
    from inputs reloaded on the H2D stream, with the modules' eps, weight and bias: bitwise on
    CUDA. (RMSNorm runs ``_fused_rms_norm`` here, whose node saves the input.)"""
    from offload_util import _grads, _NormNet

    if kind == "rms_norm":
        probe = nn.RMSNorm(8, device="cuda")(torch.ones(2, 8, device="cuda", requires_grad=True))
        if type(probe.grad_fn).__name__ != "FusedRmsNormBackward0":
            pytest.skip(f"this torch runs nn.RMSNorm on CUDA as elementwise ops ({probe.grad_fn})")
    model = _NormNet(kind, width=1024).cuda()
    x = torch.randn(8, 512, 1024, device="cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        return _grads(model, x, mgr, amp=amp)

    want = grads(None)
    assert all(torch.equal(a, b) for a, b in zip(want, grads(None), strict=True))
    mgr = offload.ActivationOffloader(model)
    try:
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(grads(mgr), want, strict=True))
        last = mgr.stats.last
    finally:
        mgr.close()
    # Three norm outputs rebuilt; under autocast also the five Linear weights' casts.
    norms = 3 * 8 * 512 * 1024 * (2 if autocast else 4)
    weights = 5 * 1024 * 1024 * 2 if autocast else 0
    assert (last.records_rebuilt, last.bytes_rebuilt) == (8 if autocast else 3, norms + weights)


# -- CUDA graph capture and event queries, memory room (NOTE [ No query while capturing ],
# -- NOTE [ Prefetch under memory pressure ]) ----------------------------------------------------


def _graph_replays(
    name: str, mgr_kw: dict | None
) -> tuple[list[dict[str, torch.Tensor]], offload.ActivationOffloader | None, object]:
    """Warm-up steps (with offloading when ``mgr_kw`` is given) on a side stream, as
    ``torch.cuda.graph`` asks, then one forward + backward captured (inside the manager's step)
    and replayed on the batches of steps 1-3: each replay's gradients."""
    case = ALL_MODELS[name](seed=0, device="cuda")
    mgr = None
    if mgr_kw is not None:
        mgr = offload.ActivationOffloader(case.model, min_offload_bytes=0, **mgr_kw)
    step = mgr if mgr is not None else contextlib.nullcontext()
    static = tuple(t.clone() for t in case.batch(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            case.model.zero_grad(set_to_none=True)
            with step:
                loss = case.loss(static)
            loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    if mgr is not None:
        assert mgr.stats.last.bytes_offloaded_cpu > 0  # the warm-up steps offloaded
    case.model.zero_grad(set_to_none=True)  # the captured backward allocates them (static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with step:
            loss = case.loss(static)
        loss.backward()
    torch.cuda.synchronize()
    out = []
    for s in range(1, 4):
        for dst, src in zip(static, case.batch(s), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        out.append(case.grads())
    return out, mgr, case


@pytest.mark.parametrize("name", ["mlp", "gpt_block"])
def test_graph_capture_after_offloaded_steps_replays_bitwise(name: str) -> None:
    """Warm-up steps with offloading leave copies, events and releases behind; a forward +
    backward captured inside the manager's step then asks no event query (cudaEventQuery during
    capture invalidates it), its packs pass through with one warning, and every replay's
    gradients are bitwise those of the same graph captured without the manager. Steps after the
    capture offload again, bitwise."""
    want, _, _ = _graph_replays(name, None)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture: saved tensors"):
        got, mgr, case = _graph_replays(name, {})
    assert mgr is not None
    try:
        last = mgr.stats.last  # the captured step
        assert last.records_offloaded_cpu == 0 and last.records_kept == last.records > 0
        for g, w in zip(got, want, strict=True):
            for k in w:
                assert torch.equal(g[k], w[k]), k
        eager = _baseline(name)
        case.model.zero_grad(set_to_none=True)
        with mgr:
            loss = case.loss(case.batch())
        loss.backward()
        torch.cuda.synchronize()
        assert mgr.stats.last.bytes_offloaded_cpu > 0
        for k, g in eager.items():
            assert torch.equal(case.grads()[k], g), k
        assert mgr._executor.live_families() == 0 and not mgr._executor._deferred_releases
    finally:
        mgr.close()


# ---------------------------------------------------------------------------------------------
# Streams (gpu-streams): a deferred pack's stream, reload buffers used on another stream, the
# copy streams, NVMe I/O threads' device, stall time. CPU halves in tests/test_offload_streams.py.


def _busy(stream: torch.cuda.Stream, n: int = 30) -> torch.Tensor:
    """Queue ``n`` 4096 x 4096 matmuls (tens of ms) on ``stream``; no autograd."""
    with torch.cuda.stream(stream), torch.no_grad():
        a = torch.full((4096, 4096), 1e-4, device="cuda")
        for _ in range(n):
            a = torch.tanh(a @ a)
    return a


def test_a_deferred_mask_on_a_saturated_side_stream_is_copied_after_it() -> None:
    """NOTE [ Fill after pack ]: a dropout run under a side stream whose queue holds tens of ms
    of matmuls saves its mask (no gradient), stored at the next op's pack on the default stream.
    Its copy out must wait for the side stream: ordered after the default stream instead, it
    read the mask's block before the dropout wrote it (an all-ones block freed there just
    before), and backward reloaded those stale bytes exactly."""
    from test_offload_streams import SideBranch

    torch.manual_seed(0)
    model = SideBranch(width=4096, busy=30).cuda()
    model.side = torch.cuda.Stream()
    x = torch.randn(4096, 2048, device="cuda")

    def grads(mgr: offload.ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.cuda.stream(model.side):
            stale = torch.ones(4096 * 4096, dtype=torch.bool, device="cuda")  # the mask's size
        torch.cuda.synchronize()  # the block holds ones before the step begins
        del stale  # its block goes back to the side stream's pool, for the mask
        torch.manual_seed(3)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        torch.cuda.synchronize()  # every copy out done: backward reloads the stored bytes
        loss.backward()
        torch.cuda.synchronize()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    want = grads(None)
    again = grads(None)
    assert all(torch.equal(want[k], again[k]) for k in want), "baseline is not deterministic"
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0)
    try:
        for _ in range(2):
            got = grads(mgr)
            assert mgr.stats.last.bytes_offloaded_cpu > 4096 * 4096  # the mask among them
            for k in want:
                assert torch.equal(got[k], want[k]), k
    finally:
        mgr.close()


def test_room_probe_answers_without_waiting_for_the_device() -> None:
    """The room probe that guards prefetches (``offload._device.CudaRoom``) reads the
    allocator's counters and cudaMemGetInfo: it says yes to a small reload and no to one larger
    than the device, and returns while a kernel queued before it still runs (a probe that
    synchronized would have waited for it)."""
    from offload._device import CudaRoom

    dev = torch.device("cuda", torch.cuda.current_device())
    room = CudaRoom(dev)
    _, total = torch.cuda.mem_get_info(dev)
    keep = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    del keep  # 64 MiB cached, unallocated: room without asking the driver
    assert room(32 << 20) and not room(2 * total)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e9))  # a few seconds of one kernel at any clock rate
    queued = torch.cuda.Event()
    queued.record()
    assert not room(2 * total) and room(32 << 20)
    assert not queued.query()  # the probe did not wait for the kernel
    torch.cuda.synchronize()


def test_a_reload_buffer_unpacked_on_another_stream_is_not_reused_before_it_is_read() -> None:
    """NOTE [ Reload buffers used on another stream ]: reloads started under a side stream (a
    backward pre-hook of a node on it) come from that stream's pool and are unpacked by nodes on
    the default stream, saturated here. Once backward freed them, the side stream must not get
    their blocks back while the default stream's queued kernels may still read them: before,
    an allocation of the same size on the side stream right after backward got one of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 4096)).cuda()
    x = torch.randn(2048, 4096, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()

    def run(mgr: offload.ActivationOffloader | None) -> tuple[dict[str, torch.Tensor], bool]:
        model.zero_grad(set_to_none=True)
        reused = False
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).pow(2).sum()
        torch.cuda.synchronize()
        sizes: list[tuple[int, int]] = []
        if mgr is not None:
            ex = mgr._executor
            assert ex is not None and ex.step is not None
            with torch.cuda.stream(side):
                ex.prefetch(ex.step.families)
            torch.cuda.current_stream().wait_stream(side)
            sizes = [
                (f.resident.untyped_storage().data_ptr(), f.resident.untyped_storage().nbytes())
                for f in ex.step.families
                if f.resident is not None
            ]
            assert len(sizes) == 3
        busy = _busy(torch.cuda.current_stream())  # the nodes' kernels queue behind this
        loss.backward()
        del loss
        with torch.cuda.stream(side):
            fresh = [torch.empty(n, dtype=torch.uint8, device="cuda") for _, n in sizes]
            reused = any(t.data_ptr() == p for t, (p, _) in zip(fresh, sizes, strict=True))
        torch.cuda.synchronize()
        assert float(busy.sum()) >= 0
        return {k: p.grad.clone() for k, p in model.named_parameters()}, reused

    want, _ = run(None)
    mgr = offload.ActivationOffloader(model, min_offload_bytes=0, max_inflight_bytes="1GiB")
    try:
        got, reused = run(mgr)
        assert not reused
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        mgr.close()


def test_copy_streams_are_the_processs_own_and_alias_no_drawn_stream() -> None:
    """NOTE [ Copy streams ]: every manager on a device shares one D2H and one H2D stream, drawn
    once from the priority -2 pool, so no stream that torch hands out at its default priority
    (0) or FSDP2's (-1) is one of them, however many are drawn. Before, each manager drew two
    of the default pool's 32: the 16th manager's copies ran on the streams of the first."""
    model = nn.Linear(256, 256).cuda()
    managers = [offload.ActivationOffloader(model, min_offload_bytes=0) for _ in range(2)]
    try:
        for mgr in managers:
            with mgr:
                model(torch.randn(8, 256, device="cuda")).sum().backward()
        a, b = (mgr._executor for mgr in managers)
        assert a is not None and b is not None
        assert (a._d2h, a._h2d) == (b._d2h, b._h2d) and a._d2h != a._h2d
        ours = {a._d2h.cuda_stream, a._h2d.cuda_stream}
        _, greatest = a._d2h.priority_range()  # (0, -3) where the device has 4 levels or more
        # Where -2 clamps to -1, the copy streams come from FSDP2's pool (NOTE [ Copy streams ]).
        levels = (0, -1) if greatest <= -2 else (0,)
        drawn = [torch.cuda.Stream(priority=p) for p in levels for _ in range(64)]
        assert not ours & {s.cuda_stream for s in drawn}
        if greatest <= -2:
            assert a._d2h.priority == a._h2d.priority == -2
    finally:
        for mgr in managers:
            mgr.close()


def test_stall_s_counts_the_time_the_compute_stream_waits_for_a_reload() -> None:
    """NOTE [ Stall time on CUDA ]: one 256 MiB saved tensor, reloaded when its module's backward
    begins on an idle device and unpacked right after: the compute stream waits for the whole
    H2D copy, which no PCIe link moves faster than 1 TB/s. Before, stall_s read host seconds
    around an unpack that does not block the host (microseconds)."""

    class Scale(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(n, device="cuda"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w * x  # saves x (no gradient: stored at the module's end)

    nbytes = 256 << 20
    x = torch.randn(nbytes // 4, device="cuda")
    scale = Scale(nbytes // 4)
    mgr = offload.ActivationOffloader(scale, min_offload_bytes=0)
    try:
        for _ in range(2):
            with mgr:
                loss = scale(x).sum()
            torch.cuda.synchronize()  # the copy out is done and the device idle
            loss.backward()
            last = mgr.stats.last
            assert last.bytes_offloaded_cpu >= nbytes and last.reloads >= 1
            assert last.stall_s >= nbytes / 1e12, last.stall_s
    finally:
        mgr.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nvme_io_threads_create_no_context_on_device_0_for_a_manager_on_cuda_1(tmp_path) -> None:
    """The NVMe tier's I/O threads wait on the manager's CUDA events: with cuda:1 their current
    device, no CUDA context appears on device 0 (hundreds of MiB per rank there) in a process
    whose own thread set cuda:1. Before, the threads had none set and cudaEventSynchronize
    created device 0's primary context."""
    code = textwrap.dedent(
        f"""
        import torch, offload
        from torch import nn
        torch.cuda.set_device(1)  # as each rank does: this thread's waits are on cuda:1
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024)).to("cuda:1")
        mgr = offload.ActivationOffloader(
            model, tiers=("nvme",), nvme_dir={str(tmp_path)!r}, min_offload_bytes=0
        )
        for _ in range(3):
            with mgr:
                loss = model(torch.randn(512, 1024, device="cuda:1")).pow(2).sum()
            loss.backward()
        assert mgr.stats.last.bytes_offloaded_nvme > 0
        mgr.close()
        torch.cuda.synchronize(1)
        print("context on 0:", torch._C._cuda_hasPrimaryContext(0))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=150
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "context on 0: False" in r.stdout, r.stdout


# -- pinned staging: a full pool waits, NVMe reloads land early (gpu-staging) ------------------


def _halves_grads(
    a: nn.Module,
    b: nn.Module,
    x: torch.Tensor,
    mgr: offload.ActivationOffloader | None,
    saturate: bool,
) -> list[torch.Tensor]:
    """One step of ``b(a(x))`` with the op between the halves waiting for the manager's NVMe
    tier (see offload_util._WaitForTier), the compute stream kept busy for seconds
    before backward when ``saturate``; the gradients."""
    from offload_util import _WaitForTier

    for p in [*a.parameters(), *b.parameters()]:
        p.grad = None
    with mgr if mgr is not None else contextlib.nullcontext():
        h = a(x)
        h = _WaitForTier.apply(h, mgr._tiers[0]) if mgr is not None else h.clone()
        loss = b(h).sum()
    if mgr is not None:
        assert mgr.stats.last.records_offloaded_nvme > 0  # waits for every file write
    if saturate:
        c = torch.randn(4096, 4096, device="cuda")
        for _ in range(30):  # seconds of queued work ahead of backward on the compute stream
            c = torch.tanh(c @ c)
    loss.backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in [*a.parameters(), *b.parameters()]]


def test_nvme_reloads_land_early_bitwise_under_a_saturated_compute_stream(tmp_path) -> None:
    """NOTE [ NVMe reloads land early ] on CUDA: the staging -> device copy of each NVMe reload
    is issued from the poll that sees its file read done, waiting on the event recorded right
    after its destination's allocation, while the compute stream holds seconds of queued
    work. Gradients bitwise; the first half's 4 families landed before their unpacks."""

    def half() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(2048, 2048), nn.Tanh())])

    torch.manual_seed(0)
    a, b = half().cuda(), half().cuda()
    x = torch.randn(2048, 2048, device="cuda")
    want = _halves_grads(a, b, x, None, saturate=False)
    again = _halves_grads(a, b, x, None, saturate=False)
    assert all(torch.equal(g, w) for g, w in zip(again, want, strict=True))
    mgr = offload.ActivationOffloader(
        nn.ModuleList([a, b]),
        tiers=("nvme",),
        nvme_dir=tmp_path,
        min_offload_bytes=0,
        max_inflight_bytes="256MiB",
    )
    try:
        for _ in range(2):
            landed = mgr._executor.landed_early if mgr._executor is not None else 0
            got = _halves_grads(a, b, x, mgr, saturate=True)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert mgr._executor.landed_early - landed >= 4
            assert mgr.stats.last.stalls == 0
    finally:
        mgr.close()


def test_a_full_pinned_pool_waits_for_copies_in_flight_bitwise(tmp_path, monkeypatch) -> None:
    """NOTE [ A full pool waits for what is in flight ] on CUDA: another user of the pinned
    pool holds all but 2 MiB of the staging room, cpu_budget is 2 MiB, and the records (1 MiB
    each) spill to NVMe through that room: each D2H copy's region waits for older copies
    and file writes to give theirs back instead of raising StorageFullError. Bitwise."""
    from offload import storage

    monkeypatch.setattr(storage._pool, "_shared_pools", {})
    monkeypatch.setattr(storage._pool, "_shared_claims", {})
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.Tanh())])
    model = model.cuda()
    x = torch.randn(256, 1024, device="cuda")

    def grads(mgr: offload.ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(None)
    assert all(torch.equal(g, w) for g, w in zip(grads(None), want, strict=True))
    pool = storage.shared_host_pool(pin_memory=True)
    other = pool.allocate(2 * (256 << 20) - (2 << 20))  # the manager's least staging claim
    mgr = offload.ActivationOffloader(
        model,
        tiers=("cpu", "nvme"),
        nvme_dir=tmp_path,
        cpu_budget="2MiB",
        max_inflight_bytes="64MiB",
        min_offload_bytes=0,
    )
    try:
        for _ in range(2):
            assert all(torch.equal(g, w) for g, w in zip(grads(mgr), want, strict=True))
            assert mgr.stats.last.records_offloaded_nvme > 0
    finally:
        mgr.close()
        other.release()
        pool.close()


# -- a module's own saved tensors under the look-ahead window (NOTE [ Module triggers under the
# -- window ]; the CPU half: test_offload_window.py::test_a_modules_own_saved_tensors_come_back_
# -- under_the_window) ---------------------------------------------------------------------------


def test_a_modules_own_saved_tensors_come_back_under_the_window_on_cuda() -> None:
    """One module whose own ops save 9 x 2 MiB (8 x (matmul, tanh)), min-memory mode with a
    4 MiB window: its backward used to bring all 9 back when it began, so the step's allocator
    peak was no offload's (18 MiB of saved bytes at once). Under the window at most 6 MiB of
    them are back at once: the step's peak above its start is at least 10 MiB below no
    offload's (12 MiB less saved, 2 MiB for reload buffers' alignment and allocator rounding).
    Gradients bitwise."""

    class TanhChain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(1024, 1024, device="cuda") / 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(8):
                x = torch.tanh(x @ self.w)
            return x

    torch.manual_seed(0)
    model = TanhChain()
    x = torch.randn(512, 1024, device="cuda")
    family = 2 << 20

    def step(mgr: offload.ActivationOffloader | None) -> tuple[torch.Tensor, int]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with mgr if mgr is not None else contextlib.nullcontext():
            loss = model(x).sum()
        loss.backward()
        torch.cuda.synchronize()
        return model.w.grad.clone(), torch.cuda.max_memory_allocated() - start

    step(None)  # cuBLAS workspaces and the gradient's first allocation
    want, none_peak = step(None)
    mgr = offload.ActivationOffloader(model, max_inflight_bytes="4MiB", min_offload_bytes=0)
    try:
        for _ in range(3):
            got, peak = step(mgr)
            assert torch.equal(got, want)
            assert mgr.stats.last.records_offloaded_cpu == 9
        assert peak <= none_peak - 5 * family, (peak, none_peak)
    finally:
        mgr.close()
