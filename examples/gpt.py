"""A small GPT-style decoder in plain PyTorch, used by the other examples.

Shows a model whose submodules have readable qualified names (``blocks.0.attn.qkv``,
``blocks.0.mlp.fc1``, ...), which is what the offload profiler uses to name saved tensors.
Nothing here depends on ``offload``. Run its self-check (one forward and backward on CPU) with:

    python examples/gpt.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model.

    Args:
        vocab_size: number of token ids.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream.
        seq_len: longest sequence the position embedding covers.
        dropout: dropout probability on attention, residual branches and embeddings (0 = off).
        bias: whether Linear and LayerNorm layers carry a bias.
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1; got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1); got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One projection for query, key and value: a single larger matmul instead of three.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (b, t, c) -> (b, n_head, t, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wider in the middle."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only language model.

    The LM head shares its weight with the token embedding. Weights are drawn from a private
    ``torch.Generator`` seeded with ``seed``, so two models built with the same config and seed are
    identical whatever the global RNG state, on any device they are later moved to.

    Args:
        config: the model's shape.
        seed: seed for the weight initialisation.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, seq_len=8))
        >>> idx = torch.randint(0, 32, (2, 8))
        >>> model(idx).shape
        torch.Size([2, 8, 32])
        >>> model.loss(idx[:, :-1], idx[:, 1:]).backward()
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Re-draw every weight from a generator seeded with ``seed``.

        Linear and embedding weights are normal with std 0.02; the projections that write into
        the residual stream (``attn.proj``, ``mlp.fc2``) are scaled down by ``sqrt(2 * n_layer)``
        so the stream's variance does not grow with depth. Biases are zero, LayerNorms identity.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module is self.head:
                    continue  # tied to tok_emb, drawn there
                std = residual_std if name.endswith(("attn.proj", "mlp.fc2")) else 0.02
                # Drawn on CPU then copied, so the values do not depend on the device.
                w = torch.empty(module.weight.shape).normal_(0.0, std, generator=gen)
                module.weight.copy_(w)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, seq, vocab_size)`` for token ids ``(batch, seq)``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq); got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the logits for ``idx`` against ``targets``."""
        logits = self(idx)
        # Cross-entropy in fp32 even under bf16 autocast: the log-softmax over the vocab is where
        # low precision hurts.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


if __name__ == "__main__":
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
    model = GPT(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    names = [n for n, _ in model.named_modules() if n.startswith("blocks.0.")]
    print(f"{model.num_parameters()} parameters, loss {loss.item():.4f}")
    print("submodules of block 0:", ", ".join(names))
