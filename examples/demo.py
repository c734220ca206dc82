"""The README demo: profile a small GPT's training step, print the report, then train it.

    python examples/demo.py [--steps 20] [--out offload-demo]

What it does, in order:
1. builds the GPT from ``gpt.py`` and a synthetic next-token task (``train_gpt.py``'s Markov chain);
2. ``offload.profile`` records one training step after one warm-up step: every tensor autograd
   saves, the module that saved it, its bytes, when it was packed and when backward used it;
3. prints the trace's summary and writes ``trace.json``, a Perfetto trace and ``memory.png``
   into ``--out``;
4. trains for ``--steps`` steps and prints the loss.

Offloading the recorded activations (``offload.ActivationOffloader``) and budget plans are added
by the runtime and planner work; this demo shows the profiling half of the product.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import MarkovChain  # noqa: E402

import offload  # noqa: E402
from lifecycle import write_memory_png, write_perfetto  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=20, help="training steps after profiling (default 20)"
    )
    ap.add_argument(
        "--out", default="offload-demo", help="where trace files go (default ./offload-demo)"
    )
    args = ap.parse_args(argv)
    if args.steps < 0:
        ap.error(f"--steps must be >= 0; got {args.steps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)
    model = GPT(cfg, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    chain = MarkovChain(cfg.vocab_size, seed=0)
    gen = torch.Generator().manual_seed(1)

    def train_step() -> float:
        tokens = chain.sample(16, cfg.seq_len + 1, gen).to(device)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    print(f"offload demo: GPT with {model.num_parameters() / 1e6:.2f}M parameters on {device}")
    t0 = time.perf_counter()
    trace = offload.profile(train_step, model, warmup_steps=1)
    print(f"profiled one step in {time.perf_counter() - t0:.2f} s (after one warm-up step)\n")
    print(trace.summary())
    os.makedirs(args.out, exist_ok=True)
    trace.save(os.path.join(args.out, "trace.json"))
    write_perfetto(trace, os.path.join(args.out, "trace.perfetto.json"))
    written = ["trace.json", "trace.perfetto.json"]
    try:
        write_memory_png(trace, os.path.join(args.out, "memory.png"))
        written.append("memory.png")
    except ImportError as e:
        print(f"(no PNG: {e})")
    print(f"\nwrote {', '.join(written)} into {args.out}/\n")

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = train_step()
        if step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss:.4f}")
    if args.steps:
        print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
