"""Seeded randomized stress: random small models (Linear, GELU, in-place ReLU, LayerNorm, RMSNorm,
a SwiGLU MLP, residual adds, slices, transposes, q/k/v chunks with matmul and softmax,
``torch.utils.checkpoint`` around a random block) under random settings (tiers, a ``cpu_budget`` that forces spills or not, a
``max_inflight_bytes`` from one byte to unbounded, the synchronous or the deferred copy engine),
over a few steps each ending in a random way: backward after the block, backward inside it, two
``retain_graph`` backwards, an exception mid-forward, or the graph dropped unused.

Every completed backward is compared bit for bit with an identical model run without offloading;
after every step nothing may stay live, and after ``close()`` the shared host pool is back where it
was and no spill file is still open. Plain ``random.Random(seed)``: a failing seed replays exactly.
RMSNorm runs as on CUDA, one ``_fused_rms_norm`` (the ``fused_rms_norm`` fixture), so its outputs
take the norm recipe (NOTE [ Activation recipes ]) as LayerNorm's and the SiLU's do.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import storage

# Chosen (greedy set cover over seeds 0-399) so that together they hit every block kind both outside
# and inside a checkpoint (outside, the activation and norm recipes run), both checkpoint flavours,
# every tier order, every cpu_budget and max_inflight_bytes choice, both engines and every step
# ending (also under the deferred engine and with a host tier that spills); every seed of 0-399
# passed when this file was written.
SEEDS = (24, 30, 205, 263, 348)
KINDS = ("mlp", "relu", "ln", "attn", "slice", "transpose", "rms", "swiglu")
ENDINGS = ("after", "inside", "retain", "raise", "drop")


class Boom(RuntimeError):
    pass


class Block(nn.Module):
    def __init__(self, kind: str, d: int, t: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)
        elif kind == "relu":
            self.fc, self.act = nn.Linear(d, d), nn.ReLU(inplace=True)
        elif kind == "ln":
            self.ln = nn.LayerNorm(d)
        elif kind == "attn":
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        elif kind == "slice":
            self.fc = nn.Linear(d, d)
        elif kind == "transpose":
            self.mix = nn.Linear(t, t)  # mixes tokens: runs on the transposed view
        elif kind == "rms":
            self.norm = nn.RMSNorm(d, eps=1e-4)
        elif kind == "swiglu":
            self.gate, self.up = nn.Linear(d, hidden), nn.Linear(d, hidden)
            self.act, self.down = nn.SiLU(), nn.Linear(hidden, d)
        else:
            raise AssertionError(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "mlp":
            return x + self.fc2(self.act(self.fc1(x)))
        if k == "relu":
            return self.act(self.fc(x))
        if k == "ln":
            return self.ln(x)
        if k == "attn":
            q, key, v = self.qkv(x).chunk(3, dim=-1)
            att = torch.softmax(q @ key.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
            return x + self.proj(att @ v)
        if k == "slice":
            h = x.shape[-1] // 2
            a, b = x[..., :h], x[..., h:]
            return self.fc(torch.cat([a * torch.sigmoid(b), b.tanh() * a], dim=-1))
        if k == "rms":
            return self.norm(x)
        if k == "swiglu":  # the product saves the SiLU's output (rebuilt) and the up output
            return x + self.down(self.act(self.gate(x)) * self.up(x))
        y = self.mix(x.transpose(-2, -1))
        return x + y.transpose(-2, -1) * x


class Checkpointed(nn.Module):
    def __init__(self, inner: Block, use_reentrant: bool) -> None:
        super().__init__()
        self.inner, self.use_reentrant = inner, use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


class RandomNet(nn.Module):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        d, t = spec["d"], spec["t"]
        self.stem = nn.Linear(spec["d_in"], d)
        blocks: list[nn.Module] = []
        for kind, hidden, ckpt in spec["blocks"]:
            b = Block(kind, d, t, hidden)
            blocks.append(Checkpointed(b, ckpt == "reentrant") if ckpt else b)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 1)
        self.explode_at = -1  # raise after this block (a mid-forward exception)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i == self.explode_at:
                raise Boom(f"boom after block {i}")
        return self.head(h).pow(2).mean()


def random_spec(rng: random.Random) -> dict[str, Any]:
    blocks = []
    for _ in range(rng.randint(2, 5)):
        ckpt = rng.choice((None, None, None, "reentrant", "non_reentrant"))
        blocks.append((rng.choice(KINDS), rng.choice((32, 64, 96)), ckpt))
    return {
        "d_in": rng.choice((8, 24)),
        "d": rng.choice((16, 32, 48)),
        "t": rng.choice((8, 16)),
        "b": rng.choice((2, 3)),
        "blocks": blocks,
        "x_grad": rng.random() < 0.5,
    }


def build(spec: dict[str, Any], seed: int) -> RandomNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RandomNet(spec)


def batch(spec: dict[str, Any], seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(spec["b"], spec["t"], spec["d_in"], generator=g)
    return x.requires_grad_(spec["x_grad"])


def grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        out["<input>"] = x.grad.clone()
    return out


def reference_step(model: RandomNet, x: torch.Tensor, ending: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward(retain_graph=ending == "retain")
    if ending == "retain":
        loss.backward()
    return grads(model, x)


def open_fds_under(path: Path) -> list[str]:
    root = str(path)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(root):
                found.append(target)
    return found


def assert_nothing_live(mgr: offload.ActivationOffloader) -> None:
    ex = mgr._executor
    assert ex is not None
    assert ex.live_families() == 0
    assert ex.cpu_bytes == 0
    assert not ex._inflight and ex._inflight_bytes == 0


def random_settings(rng: random.Random, tmp_path: Path) -> dict[str, Any]:
    tiers = rng.choice((("cpu",), ("nvme",), ("cpu", "nvme"), ("nvme", "cpu")))
    kw: dict[str, Any] = {"tiers": tiers, "min_offload_bytes": 0}
    if "nvme" in tiers:
        kw["nvme_dir"] = tmp_path
        # Tiny: every host record spills; 16 KiB: a few fit, the rest spill; 1 GiB: none spill.
        kw["cpu_budget"] = rng.choice((1, 16 << 10, 1 << 30))
    else:
        kw["cpu_budget"] = 1 << 30  # host only: a tiny budget could only raise StorageFullError
    kw["max_inflight_bytes"] = rng.choice((1, 4 << 10, 64 << 10, 1 << 20, None))
    return kw


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.usefixtures("fused_rms_norm")
def test_random_models_settings_and_step_endings(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    spec = random_spec(rng)
    settings = random_settings(rng, tmp_path)
    deferred = rng.random() < 0.5
    endings = [rng.choice(ENDINGS) for _ in range(rng.randint(3, 5))]
    explode = [rng.randrange(len(spec["blocks"])) for _ in endings]
    info = f"seed={seed} spec={spec} settings={settings} deferred={deferred} endings={endings}"

    ref = build(spec, seed)
    model = build(spec, seed)
    pool = storage.shared_host_pool(pin_memory=False)
    used_before = pool.used_bytes
    engine = (
        storage.CopyEngine(deferred=True, max_delay_s=rng.choice((0.0, 0.0005, 0.002)), seed=seed)
        if deferred
        else None
    )
    mgr = offload.ActivationOffloader(model, _copy_engine=engine, **settings)
    try:
        for step, ending in enumerate(endings):
            where = f"{info} step={step} ending={ending}"
            x = batch(spec, seed, step)
            model.zero_grad(set_to_none=True)
            if ending == "raise":
                model.explode_at = explode[step]
                with pytest.raises(Boom) as exc:
                    with mgr:
                        model(x)
                model.explode_at = -1
                del exc
                gc.collect()
                assert mgr._executor.live_families() == 0, where
                assert_nothing_live(mgr)
                continue
            with mgr:
                loss = model(x)
                if ending == "inside":
                    loss.backward()
            moved = mgr.stats.last.bytes_offloaded_cpu + mgr.stats.last.bytes_offloaded_nvme
            assert moved > 0, where
            if settings["tiers"] == ("nvme",):
                assert mgr.stats.last.bytes_offloaded_cpu == 0, where
            if ending in ("after", "retain"):
                loss.backward(retain_graph=ending == "retain")
            if ending == "retain":
                loss.backward()
            del loss
            gc.collect()
            assert_nothing_live(mgr)
            if ending == "drop":
                continue
            got = grads(model, x)
            x.grad = None
            want = reference_step(ref, x, ending)
            assert got.keys() == want.keys(), where
            for k in want:
                assert torch.equal(got[k], want[k]), f"{where} grad={k}"
    finally:
        mgr.close()
        if engine is not None:
            engine.close()
    assert pool.used_bytes == used_before, info
    assert open_fds_under(tmp_path) == [], info
