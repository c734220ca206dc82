"""Small deterministic test models, one per shape of saved-tensor traffic the library must handle.

Every factory takes ``seed`` (weights and batches) and ``device`` and returns a :class:`ModelCase`:
the model, a deterministic batch generator and the loss. Two cases built with the same arguments
hold identical weights and produce identical batches for the same step index, whatever the global
RNG state, so a test can build one case for the reference run and another for the run under test
and compare gradients bit for bit.

Sizes are tiny (a CPU forward and backward takes milliseconds) but large enough that most saved
tensors are at least 4 KiB, above typical ``min_offload_bytes`` thresholds.

Example::

    from models import ALL_MODELS

    for name, factory in ALL_MODELS.items():
        case = factory(seed=0)
        case.step()                      # zero grads, forward, loss, backward
        grads = case.grads()             # {param name: grad clone}

Run the self-check (one step of each model, with timings) with ``python tests/models.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

Batch = tuple[torch.Tensor, ...]
Device = str | torch.device

__all__ = [
    "ALL_MODELS",
    "Batch",
    "ModelCase",
    "checkpointed",
    "complex_views",
    "conv_net",
    "gpt_block",
    "gru",
    "lstm",
    "mixed_dtypes",
    "mlp",
    "plan_of",
    "seeded_steps",
    "tied_weights",
    "views_model",
]


@dataclass(frozen=True, eq=False)
class ModelCase:
    """A model with its inputs and loss: everything a test needs to run a training step.

    Attributes:
        name: the key of this case in :data:`ALL_MODELS`.
        model: the module (in train mode, on ``device``).
        make_batch: ``make_batch(step)`` returns the inputs and targets for step ``step``; the
            same step index always gives the same tensors.
        loss_fn: ``loss_fn(model, batch)`` runs the forward pass and returns a scalar loss.
        device: where the model and batches live.
    """

    name: str
    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    device: torch.device

    def batch(self, step: int = 0) -> Batch:
        """The batch for step ``step``."""
        return self.make_batch(step)

    def loss(self, batch: Batch) -> torch.Tensor:
        """Forward pass on ``batch``; returns the scalar loss (backward not run)."""
        return self.loss_fn(self.model, batch)

    def step(self, step: int = 0) -> torch.Tensor:
        """Clear gradients, run forward and backward on the batch for ``step``; return the loss.

        Usable directly as a profiler step function: ``offload.profile(case.step, case.model)``.
        """
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(self.batch(step))
        loss.backward()
        return loss.detach()

    def grads(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter's gradient, by qualified name (``None`` grads left out)."""
        return {
            name: p.grad.detach().clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }


# -- helpers ---------------------------------------------------------------------------------


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build modules from a seeded global RNG without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _generator(seed: int, step: int) -> torch.Generator:
    # A distinct, reproducible stream per (seed, step); drawn on CPU so batches do not depend on
    # the device they are moved to.
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step + 1)


def _case(
    name: str,
    build: Callable[[], nn.Module],
    make_batch: Callable[[torch.Generator], Batch],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    seed: int,
    device: Device,
) -> ModelCase:
    dev = torch.device(device)
    with _seeded(seed):
        model = build()
    model.to(dev).train()

    def batch(step: int) -> Batch:
        return tuple(t.to(dev) for t in make_batch(_generator(seed, step)))

    return ModelCase(name=name, model=model, make_batch=batch, loss_fn=loss_fn, device=dev)


def _call_loss(loss: Callable[..., torch.Tensor]) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """Loss function for models whose ``forward`` takes the whole batch and returns the loss."""

    def fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        return loss(model(*batch[:-1]), batch[-1])

    return fn


# -- mlp -------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``fc1 -> GELU -> fc2 -> ReLU -> fc3``."""

    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def mlp(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """A three-layer perceptron on a ``(64, 64)`` batch with a cross-entropy loss."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(64, 64, generator=g), torch.randint(0, 16, (64,), generator=g)

    return _case("mlp", MLP, make_batch, _call_loss(F.cross_entropy), seed, device)


# -- gpt_block -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block (the shape of ``examples/gpt.py``'s, kept separate so
    the tests do not depend on the examples)."""

    def __init__(self, d_model: int = 64, n_head: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def gpt_block(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """One transformer block on ``(4, 32, 64)`` activations with an MSE loss."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(4, 32, 64, generator=g), torch.randn(4, 32, 64, generator=g)

    return _case("gpt_block", Block, make_batch, _call_loss(F.mse_loss), seed, device)


# -- conv_net --------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """``conv1 -> bn -> ReLU(inplace) -> conv2 -> ReLU(inplace) -> max pool -> fc``.

    The in-place ReLUs make saved tensors share storage with later-modified ones (the batch-norm
    output is overwritten by ``act1`` and then saved by ``conv2``); max pooling saves int64
    indices.
    """

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act2 = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(channels * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn(self.conv1(x)))
        x = self.pool(self.act2(self.conv2(x)))
        return self.fc(x.flatten(1))


def conv_net(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """A small CNN on ``(8, 3, 16, 16)`` images with a cross-entropy loss.

    The model is in train mode, so batch norm updates its running statistics every step: compare
    two runs step for step from freshly built cases.
    """

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)

    return _case("conv_net", ConvNet, make_batch, _call_loss(F.cross_entropy), seed, device)


# -- lstm ------------------------------------------------------------------------------------


class LSTMHead(nn.Module):
    """``nn.LSTM`` over the sequence, then a Linear head on every time step."""

    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out)


def _sequence_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lstm(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """A one-layer LSTM on ``(16, 16, 32)`` sequences with a per-step cross-entropy loss."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(16, 16, 32, generator=g), torch.randint(0, 10, (16, 16), generator=g)

    return _case("lstm", LSTMHead, make_batch, _call_loss(_sequence_ce), seed, device)


class GRUHead(nn.Module):
    """``nn.GRU`` over the sequence, then a Linear head on every time step.

    CPU torch runs the GRU cell by cell: each step splits its gate pre-activations with
    ``unsafe_chunk`` (pieces of one storage that are not views, each with its own version
    counter) and applies ``sigmoid_`` / ``tanh_`` to them in place, so pieces of one storage are
    saved at equal version numbers holding unrelated bytes.
    """

    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.gru = nn.GRU(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out)


def gru(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """A one-layer GRU on ``(16, 16, 32)`` sequences with a per-step cross-entropy loss."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(16, 16, 32, generator=g), torch.randint(0, 10, (16, 16), generator=g)

    return _case("gru", GRUHead, make_batch, _call_loss(_sequence_ce), seed, device)


# -- tied_weights ----------------------------------------------------------------------------


class TiedLM(nn.Module):
    """Embedding -> Linear -> GELU -> LayerNorm -> head, with ``head.weight is emb.weight``.

    The shared weight is saved by the head's matmul and its gradient accumulates from two places.
    """

    def __init__(self, vocab: int = 128, d_model: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.fc = nn.Linear(d_model, d_model)
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.emb.weight
        # The default N(0, 1) embedding init would make the tied head's logits huge.
        nn.init.normal_(self.emb.weight, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.act(self.fc(self.emb(idx)))))


def tied_weights(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """A language model whose output head shares the embedding weight; ``(8, 16)`` token ids."""

    def make_batch(g: torch.Generator) -> Batch:
        tokens = torch.randint(0, 128, (8, 17), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return _case("tied_weights", TiedLM, make_batch, _call_loss(_sequence_ce), seed, device)


# -- views_model -----------------------------------------------------------------------------


class ViewsModel(nn.Module):
    """Saves many views of one tensor ``y = proj(x)``: a transpose, a slice, an expanded view and
    a reshaped view, each by an op that keeps its input for backward (matmul or mul with a
    parameter). Several saved tensors therefore share one storage with different shapes,
    strides and offsets.
    """

    def __init__(self, n: int = 64, k: int = 32, heads: int = 8):
        super().__init__()
        self.k = k
        self.heads = heads
        self.proj = nn.Linear(n, n)
        self.w_t = nn.Parameter(torch.randn(64, n) / 8)  # y.t() @ w_t: saves y.t()
        self.w_slice = nn.Parameter(torch.randn(k))  # y[:, :k] * w_slice: saves the slice
        self.w_expand = nn.Parameter(torch.randn(3, 1, n))  # y[None].expand(3, ...) * w_expand
        self.w_view = nn.Parameter(torch.randn(n // heads, n // heads) / 3)  # y.view(...) @ w_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        b, n = y.shape
        a = y.t() @ self.w_t
        s = y[:, : self.k] * self.w_slice
        e = y.unsqueeze(0).expand(3, b, n) * self.w_expand
        v = y.view(b, self.heads, n // self.heads) @ self.w_view
        # The squares save a, s, e and v in turn, so the views' results are saved as well.
        return a.pow(2).mean() + s.pow(2).mean() + e.pow(2).mean() + v.pow(2).mean()


def _views_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0])


def views_model(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """Several differently-shaped views of one activation saved for backward; ``(64, 64)`` input."""

    def make_batch(g: torch.Generator) -> Batch:
        return (torch.randn(64, 64, generator=g),)

    return _case("views_model", ViewsModel, make_batch, _views_loss, seed, device)


# -- checkpointed ----------------------------------------------------------------------------


class ResidualMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Module):
    """Three residual MLP blocks; ``blocks.1`` runs under non-reentrant activation checkpointing,
    so its activations are recomputed in backward instead of being saved in forward."""

    def __init__(self, d: int = 64, n_blocks: int = 3, checkpointed: tuple[int, ...] = (1,)):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLP(d) for _ in range(n_blocks))
        self.checkpointed = frozenset(checkpointed)
        self.head = nn.Linear(d, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i in self.checkpointed else block(x)
        return self.head(x)


def checkpointed(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """Residual MLP blocks, the middle one checkpointed; ``(64, 64)`` input."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(64, 64, generator=g), torch.randint(0, 16, (64,), generator=g)

    return _case(
        "checkpointed", Checkpointed, make_batch, _call_loss(F.cross_entropy), seed, device
    )


# -- mixed_dtypes ----------------------------------------------------------------------------


class MixedDtypes(nn.Module):
    """Saves tensors of four dtypes in one step.

    * int64: the token ids (embedding) and a permutation index (``gather``);
    * bfloat16: the input of a bf16 Linear (``proj_bf16``, whose weights are bf16);
    * bool: the mask of ``masked_fill``;
    * float32: everything else (LayerNorm, the fp32 head, the loss).
    """

    def __init__(self, vocab: int = 128, d_model: int = 64, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.proj_bf16 = nn.Linear(d_model, d_model).to(torch.bfloat16)
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, idx: torch.Tensor, perm: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # saves idx (int64)
        h = self.proj_bf16(h.to(torch.bfloat16)).float()  # saves a bf16 activation
        h = torch.gather(h, 2, perm)  # saves perm (int64)
        h = h.masked_fill(mask, 0.0)  # saves mask (bool)
        return self.head(self.ln(h))


def _mixed_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    idx, perm, mask, targets = batch
    return _sequence_ce(model(idx, perm, mask), targets)


def mixed_dtypes(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """bf16, fp32, int64 and bool saved tensors; ``(16, 32)`` token ids."""

    def make_batch(g: torch.Generator) -> Batch:
        b, t, d = 16, 32, 64
        idx = torch.randint(0, 128, (b, t), generator=g)
        perm = torch.argsort(torch.rand(b, t, d, generator=g), dim=-1)
        mask = torch.rand(b, t, d, generator=g) < 0.25
        targets = torch.randint(0, 10, (b, t), generator=g)
        return idx, perm, mask, targets

    return _case("mixed_dtypes", MixedDtypes, make_batch, _mixed_loss, seed, device)


# -- complex_views ---------------------------------------------------------------------------


class ComplexViews(nn.Module):
    """A complex projection whose output is saved as lazy views that carry a flag, not bytes of
    their own: ``h * h.conj()`` saves ``h.conj()`` (the conjugate bit) and ``h.conj().imag`` is
    a negative view (the negative bit), each of the same storage as ``h``."""

    def __init__(self, d: int = 32, classes: int = 4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, dtype=torch.complex64) / d**0.5)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        power = (h * h.conj()).real
        phase = h.conj().imag * h.real
        return self.head(power + phase)


def complex_views(seed: int = 0, device: Device = "cpu") -> ModelCase:
    """Conjugate and negative views saved for backward; ``(64, 32)`` complex input."""

    def make_batch(g: torch.Generator) -> Batch:
        x = torch.randn(64, 32, dtype=torch.complex64, generator=g)
        return x, torch.randint(0, 4, (64,), generator=g)

    return _case(
        "complex_views", ComplexViews, make_batch, _call_loss(F.cross_entropy), seed, device
    )


class BlockStack(nn.Module):
    def __init__(self, n_layer: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def block_stack(seed: int = 0, device: Device = "cpu", n_layer: int = 8) -> ModelCase:
    """``n_layer`` transformer blocks on ``(4, 32, 64)`` activations with an MSE loss: a step
    whose saved bytes (about 0.55 MiB a block) are spread evenly over its depth. Not in
    ``ALL_MODELS``."""

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(4, 32, 64, generator=g), torch.randn(4, 32, 64, generator=g)

    return _case(
        "block_stack", lambda: BlockStack(n_layer), make_batch, _call_loss(F.mse_loss), seed, device
    )


ALL_MODELS: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp,
    "gpt_block": gpt_block,
    "conv_net": conv_net,
    "lstm": lstm,
    "gru": gru,
    "tied_weights": tied_weights,
    "views_model": views_model,
    "checkpointed": checkpointed,
    "mixed_dtypes": mixed_dtypes,
    "complex_views": complex_views,
}
"""Every test model by name; each factory is called as ``factory(seed=..., device=...)``."""


# -- runs shared by the offload tests ------------------------------------------------------------


def seeded_steps(
    model: nn.Module, mgr: Any = None, n: int = 3, first: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Steps ``first`` to ``first + n - 1`` of ``model`` (the loss ``model(x).pow(2).sum()`` of
    a (32, 64) batch seeded with the step's index), each inside ``mgr`` when given: each step's
    gradients, from zero."""
    out = []
    for s in range(first, first + n):
        model.zero_grad(set_to_none=True)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s))
        with mgr if mgr is not None else nullcontext():
            loss = model(x).pow(2).sum()
        loss.backward()
        out.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return out


def fail_backward_at(module: nn.Module, fault: type[BaseException]) -> list[int]:
    """Make backward raise ``fault`` when it reaches the gradient of ``module``'s output, while
    the returned list is not empty (the caller fills and empties it per step)."""
    failing: list[int] = []

    def check(g: torch.Tensor) -> None:
        if failing:
            raise fault("a gradient check failed")

    def on_output(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(check)

    module.register_forward_hook(on_output)
    return failing


def plan_of(model: nn.Module, x: torch.Tensor, **manager_kw: Any) -> Any:
    """The ``offload.Plan`` a manager made with ``manager_kw`` holds after a profiling and a
    planned step of ``model(x).pow(2).sum()``; the manager is closed, the gradients dropped."""
    import offload  # models.py itself needs no offload

    mgr = offload.ActivationOffloader(model, **manager_kw)
    try:
        for _ in range(2):
            with mgr:
                loss = model(x).pow(2).sum()
            loss.backward()
        plan = mgr.plan
    finally:
        mgr.close()
    model.zero_grad(set_to_none=True)
    assert plan is not None
    return plan


def _saved_tensors(case: ModelCase) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> Any:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        case.step()
    return saved


if __name__ == "__main__":
    import time

    for name, factory in ALL_MODELS.items():
        case = factory(seed=0)
        case.step()  # warm-up: first-call costs
        # Best of five: on a shared machine a single timing says more about the neighbours.
        times = []
        for _ in range(5):
            start = time.perf_counter()
            loss = case.step()
            times.append(time.perf_counter() - start)
        ms = min(times) * 1e3
        again = factory(seed=0)
        again.step()
        same = all(
            torch.equal(a, b)
            for a, b in zip(case.grads().values(), again.grads().values(), strict=True)
        )
        saved = _saved_tensors(factory(seed=0))
        big = sum(t.untyped_storage().nbytes() >= 4096 for t in saved)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in saved})
        print(
            f"{name:13s} loss {loss.item():8.4f}  {ms:6.1f} ms  {len(saved):3d} saved "
            f"({big} >= 4 KiB storage)  {', '.join(dtypes)}  reproducible={same}"
        )


class Wrapper(nn.Module):
    """A backbone and a head whose own forward the steps never call (a LightningModule's
    ``training_step`` calling ``self.net(x)`` reads the same to the manager)."""

    def __init__(self) -> None:
        super().__init__()
        blocks = [
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)
        ]
        self.backbone = nn.Sequential(*blocks)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        raise AssertionError("the steps call the children, not the root")
