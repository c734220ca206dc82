"""Train the small GPT from ``gpt.py`` on a synthetic next-token task.

An ordinary training script with nothing offload-specific in it: it is the script the profiler
runs unchanged. The data are sequences drawn from a fixed random Markov chain in which every
token has a few likely successors, so the loss falls from about ln(vocab) toward the chain's
entropy within a few dozen steps. Run it with:

    python examples/train_gpt.py --steps 20

and profile it, without editing it, with:

    offload profile --steps 2 --out prof examples/train_gpt.py --layers 4

The profiler's options go before the script: here it lets one warm-up step run, records 2
steps and writes into ``prof/``. Everything after the script goes to the script (here 4
blocks); its own ``--steps`` need not be given, as the profiler stops it once its steps are
recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch

# Run as a script (directly, or by runpy from the profiler) the sibling module is not on the
# path unless the cwd happens to be this directory.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpt import GPT, GPTConfig  # noqa: E402


class MarkovChain:
    """A fixed random first-order Markov chain over ``vocab`` tokens.

    Each token has ``fanout`` possible successors with random probabilities, so a model that
    learns the transition table reaches a loss well below ``ln(vocab)``.

    Args:
        vocab: number of tokens.
        seed: seed for the transition table.
        fanout: number of successors of each token.
    """

    def __init__(self, vocab: int, seed: int, fanout: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        fanout = min(fanout, vocab)
        self.successors = torch.stack(
            [torch.randperm(vocab, generator=gen)[:fanout] for _ in range(vocab)]
        )
        self.probs = torch.rand(vocab, fanout, generator=gen) + 0.1
        self.probs /= self.probs.sum(dim=1, keepdim=True)

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """Return ``(batch, length)`` int64 token ids drawn from the chain."""
        out = torch.empty(batch, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (batch,), generator=gen)
        # Inverse-CDF sampling with all the uniforms drawn up front: a few cheap ops per position
        # instead of one multinomial call each.
        u = torch.rand(batch, length, 1, generator=gen)
        cdf = self.probs.cumsum(dim=1)
        last = self.successors.shape[1] - 1
        for t in range(1, length):
            prev = out[:, t - 1]
            choice = (u[:, t] > cdf[prev]).sum(dim=1).clamp_(max=last)
            out[:, t] = self.successors[prev, choice]
        return out

    def entropy(self) -> float:
        """Entropy rate in nats, the lowest next-token loss a model can reach (the start aside)."""
        h = -(self.probs * self.probs.log()).sum(dim=1)
        # Weight each state's entropy by its long-run frequency (power iteration on the chain).
        p = torch.zeros(self.vocab, self.vocab)
        p.scatter_add_(1, self.successors, self.probs)
        pi = torch.full((self.vocab,), 1.0 / self.vocab)
        for _ in range(200):
            pi = pi @ p
        return float((pi * h).sum())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a small GPT on sequences from a fixed random Markov chain."
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch (default: 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default: 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default: 256)")
    p.add_argument(
        "--device",
        default=None,
        help="torch device (default: cuda if available, else cpu)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for data and weights (default: 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    p.add_argument(
        "--log-every", type=int, default=5, help="print the loss every N steps (default: 5)"
    )
    p.add_argument("--bf16", action="store_true", help="run forward and loss under bf16 autocast")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first argument that cannot work."""
    for name in ("steps", "batch", "layers", "d_model", "heads", "log_every"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1; got {getattr(args, name)}")
    if args.seq < 2:
        raise ValueError(f"--seq must be >= 2 (inputs and shifted targets); got {args.seq}")
    if args.vocab < 2:
        raise ValueError(f"--vocab must be >= 2; got {args.vocab}")
    if args.d_model % args.heads != 0:
        raise ValueError(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0; got {args.lr}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"--device {args.device!r} is not a torch device: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device!r} asked for CUDA but no CUDA device is available")


def main(argv: list[str] | None = None) -> float:
    """Train and return the loss of the last step."""
    args = build_parser().parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_args(args)
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=args.vocab,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        seq_len=args.seq,
    )
    model = GPT(config, seed=args.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    chain = MarkovChain(args.vocab, seed=args.seed)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    print(
        f"model: {model.num_parameters() / 1e6:.2f}M parameters on {device}; "
        f"uniform loss {math.log(args.vocab):.3f}, "
        f"best possible ~{chain.entropy():.3f}"
    )

    model.train()
    loss_value = float("nan")
    for step in range(1, args.steps + 1):
        # One extra token per row: the inputs are tokens [0, seq), the targets [1, seq].
        tokens = chain.sample(args.batch, args.seq + 1, data_gen).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if args.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            loss = model.loss(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            loss_value = loss.item()
            print(f"step {step:5d}  loss {loss_value:.4f}")
    return loss_value


if __name__ == "__main__":
    main()
