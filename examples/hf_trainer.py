"""Offload inside a Hugging Face ``transformers.Trainer``: ``OffloadCallback`` (docs/trainers-hf.md).

    pip install 'offload[integrations]'
    python examples/hf_trainer.py

Trains a tiny GPT-2 for a few steps on CPU twice, without and with the callback under a
budget, and checks the final weights bitwise equal. On a CPU the copies go from host memory to
host memory: it exercises the whole path (profile, plan, planned steps) but saves nothing.
"""

from __future__ import annotations

import tempfile

import torch
import transformers

from offload.integrations.hf import OffloadCallback


def train(callback: OffloadCallback | None, out: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # each micro-batch is one step of the manager
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    callbacks = [callback] if callback is not None else []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return model


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        plain = train(None, out)
        cb = OffloadCallback(gpu_budget="300KiB", min_offload_bytes=0)
        model = train(cb, out)
    mgr = cb.manager  # closed when training ended; its stats and plan stay readable
    assert mgr is not None and mgr.plan is not None
    total = mgr.stats.total
    same = all(
        torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True)
    )
    print(f"steps: {total.steps} (4 optimizer steps x 2 micro-batches)")
    print(
        f"offloaded: {total.bytes_offloaded_cpu / 2**20:.2f} MiB in {total.records_offloaded_cpu}"
        f" records; unplanned records: {total.unplanned_records}"
    )
    print(f"final weights bitwise equal to training without offload: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
