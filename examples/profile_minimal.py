"""The smallest use of the library: profile one training step, print it, save it, load it back.

``offload.profile`` runs ``step_fn`` (forward and backward) under the recorder and returns a
``Trace``: every tensor autograd saved, which module saved it, its size, and when it was created
and last used. Nothing is offloaded. Runs on CPU or, if there is one, a CUDA device:

    python examples/profile_minimal.py
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict

import torch
from torch import nn

import offload


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    # Named children, so the summary says "fc1" rather than "0".
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(256, 1024),
            act1=nn.GELU(),
            fc2=nn.Linear(1024, 1024),
            norm=nn.LayerNorm(1024),
            act2=nn.ReLU(),
            head=nn.Linear(1024, 10),
        )
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step_fn() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    trace = offload.profile(step_fn, model, warmup_steps=1, steps=1)
    print(trace.summary())

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        trace.save(path)
        loaded = offload.Trace.load(path)
    if loaded.records != trace.records or loaded.events != trace.events:
        raise RuntimeError("the reloaded trace differs from the one saved")
    print(
        f"\nsaved and reloaded {path}: {len(loaded.records)} records, "
        f"{loaded.saved_bytes} activation bytes saved for backward"
    )


if __name__ == "__main__":
    main()
