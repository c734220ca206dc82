"""A synthetic trace of one transformer training step: for planning experiments without a model.

:func:`transformer_trace` writes the timeline a GPT-style (or Llama-style: SwiGLU) stack would
record, layer by layer, with byte counts and times from the usual per-layer formulas (docs/design.md,
"The physics"): about 32·h bytes saved per token and layer in bf16 for GPT (flash attention, no
dropout; 44·h with SwiGLU), matmul time from FLOPs at a given rate, pointwise time from bytes at
a given memory bandwidth, backward twice the forward. It lets the planner and the simulator be
exercised (and timed) at sizes no CPU can run: an h=8192 model, 100k records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.lifecycle._trace import Event, EventKind, TensorRecord, Trace
from offload.lifecycle._units import check_count


@dataclass(frozen=True)
class _Op:
    """One leaf module of a layer: what it saves and how long its forward takes."""

    name: str
    # Per pack: (family slot in the layer, bytes, the slot whose record it can be rebuilt from
    # (an activation's or a norm's output, from that function's input) or -1).
    saves: tuple[tuple[int, int, int], ...]
    forward_s: float


def transformer_trace(
    *,
    layers: int,
    hidden: int,
    tokens: int,
    seq_len: int | None = None,
    mlp: str = "gelu",
    ffn_hidden: int | None = None,
    dtype_bytes: int = 2,
    flops_per_s: float = 450e12,
    memory_bytes_per_s: float = 4.0e12,
    base_bytes: int = 0,
) -> Trace:
    """One training step of a pre-norm transformer stack, as :class:`lifecycle.Recorder` would
    trace it.

    Each layer ``layers.{i}`` calls ``ln1``, ``attn.qkv``, ``attn.core`` (flash attention: saves
    q, k and v as views of the qkv output, its output and the log-sum-exp), ``attn.proj``,
    ``ln2`` and its MLP. ``mlp="gelu"`` (GPT): ``mlp.fc1``, ``mlp.act`` (GELU) and ``mlp.fc2``,
    ``ffn_hidden`` 4h: 12 records and 9 alias families per layer (about 32·h bytes per token).
    ``mlp="swiglu"`` (Llama, without grouped-query attention): ``mlp.gate`` and ``mlp.up`` (both
    save the ``ln2`` output), ``mlp.act`` (SiLU, saves the gate output), ``mlp.mul`` (saves the
    SiLU output and the up output) and ``mlp.down``, ``ffn_hidden`` 3.5h: 15 records and 11
    alias families per layer (16·h + 8·f bytes per token: 44·h). The outputs the next op saves
    of the norms and of the activation link to the inputs those saved (``rebuild_from``), as the
    recorder links them (a bf16 model; under autocast the norms' float32 outputs are saved as
    bf16 casts, linked the same way). The memory probe is ``base_bytes`` plus the live saved
    bytes.

    Args:
        layers: transformer layers.
        hidden: model width h.
        tokens: tokens per step (batch x sequence).
        seq_len: attention context (for its FLOPs); default ``min(tokens, 4096)``.
        mlp: ``"gelu"`` or ``"swiglu"``.
        ffn_hidden: the MLP's inner width f; default 4h (GELU) or 3.5h (SwiGLU, rounded down).
        dtype_bytes: bytes per activation element (2 for bf16).
        flops_per_s: matmul throughput the model reaches.
        memory_bytes_per_s: device memory bandwidth (pointwise ops).
        base_bytes: memory in use at the step's start (weights, optimizer state).

    Raises:
        TypeError: a size, ``dtype_bytes`` or ``base_bytes`` that is not an int (a float, a
            bool); the message names it.
        ValueError: an argument out of its range (the message names it): the sizes and
            ``dtype_bytes`` are ints >= 1, ``base_bytes`` an int >= 0, the rates finite and > 0.

    Example:
        >>> t = transformer_trace(layers=2, hidden=1024, tokens=4096)
        >>> len(t.records), len(t.families())
        (24, 18)
        >>> t.saved_bytes // (2 * 4096 * 1024)  # bytes per token per layer, in units of h
        32
    """
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"mlp must be 'gelu' or 'swiglu'; got {mlp!r}")
    ffn = (
        ffn_hidden if ffn_hidden is not None else (4 * hidden if mlp == "gelu" else 7 * hidden // 2)
    )
    counts = [
        ("layers", layers),
        ("hidden", hidden),
        ("tokens", tokens),
        ("ffn_hidden", ffn),
        ("dtype_bytes", dtype_bytes),
    ]
    if seq_len is not None:
        counts.append(("seq_len", seq_len))
    for name, value in counts:
        check_count(value, name=name, minimum=1)
    check_count(base_bytes, name="base_bytes", minimum=0)
    for name, rate in (("flops_per_s", flops_per_s), ("memory_bytes_per_s", memory_bytes_per_s)):
        # Every op's time is a size divided by a rate: 0 divides by zero, a negative rate runs
        # time backwards, and an infinite one makes ops take no time.
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"{name} must be a finite number > 0; got {rate!r}")
    seq = min(tokens, 4096) if seq_len is None else seq_len
    act = tokens * hidden * dtype_bytes  # one [tokens, h] activation
    inner = tokens * ffn * dtype_bytes  # one [tokens, f] activation
    lse = tokens * 4 * max(1, hidden // 128)  # fp32, one per head

    def mm(k: int, n: int) -> float:
        return 2.0 * tokens * k * n / flops_per_s

    def pointwise(nbytes: int) -> float:
        return 2.0 * nbytes / memory_bytes_per_s

    # Family slots: 0 x, 1 ln1 out, 2 qkv out (q, k, v views), 3 attn out, 4 x2, 5 ln2 out, then
    # the MLP's, and the log-sum-exp (attn.core's own family) last.
    lse_slot = 8 if mlp == "gelu" else 10
    attention = (
        _Op("ln1", ((0, act, -1),), pointwise(2 * act)),
        _Op("attn.qkv", ((1, act, 0),), mm(hidden, 3 * hidden)),
        _Op(
            "attn.core",
            ((2, act, -1), (2, act, -1), (2, act, -1), (3, act, -1), (lse_slot, lse, -1)),
            4.0 * tokens * seq * hidden / flops_per_s,
        ),
        _Op("attn.proj", ((3, act, -1),), mm(hidden, hidden)),
        _Op("ln2", ((4, act, -1),), pointwise(2 * act)),
    )
    slot_bytes = {0: act, 1: act, 2: 3 * act, 3: act, 4: act, 5: act}
    mlp_ops: tuple[_Op, ...]
    if mlp == "gelu":
        # 6 fc1 out, 7 GELU out.
        mlp_ops = (
            _Op("mlp.fc1", ((5, act, 4),), mm(hidden, ffn)),
            _Op("mlp.act", ((6, inner, -1),), pointwise(2 * inner)),
            _Op("mlp.fc2", ((7, inner, 6),), mm(ffn, hidden)),
        )
        slot_bytes.update({6: inner, 7: inner})
    else:
        # 6 gate out, 7 up out, 8 SiLU out, 9 SiLU out x up out.
        mlp_ops = (
            _Op("mlp.gate", ((5, act, 4),), mm(hidden, ffn)),
            _Op("mlp.up", ((5, act, 4),), mm(hidden, ffn)),
            _Op("mlp.act", ((6, inner, -1),), pointwise(2 * inner)),
            _Op("mlp.mul", ((8, inner, 6), (7, inner, -1)), pointwise(3 * inner)),
            _Op("mlp.down", ((9, inner, -1),), mm(ffn, hidden)),
        )
        slot_bytes.update({6: inner, 7: inner, 8: inner, 9: inner})
    slot_bytes[lse_slot] = lse
    assert lse_slot == len(slot_bytes) - 1  # family ids are layer * slots + slot
    ops = (*attention, *mlp_ops)
    return _build(layers, ops, slot_bytes, base_bytes)


def _build(layers: int, ops: tuple[_Op, ...], slot_bytes: dict[int, int], base_bytes: int) -> Trace:
    events: list[Event] = []
    packs: list[dict] = []  # seq -> facts; unpacks filled in backward
    now = 0.0
    live = 0

    def event(kind: EventKind, module: str = "", call: int = -1, record: int = -1) -> int:
        events.append(
            Event(
                index=len(events),
                kind=kind,
                step=0,
                time_s=now,
                memory_bytes=base_bytes + live,
                module=module,
                call_index=call,
                record=record,
            )
        )
        return len(events) - 1

    # Family ids: one per (layer, slot); slot offsets of the qkv views inside their storage.
    def fid(layer: int, slot: int) -> int:
        return layer * len(slot_bytes) + slot

    event(EventKind.STEP_START)
    event(EventKind.FORWARD_START, "", 0)
    family_last: dict[int, int] = {}  # family -> index into packs of its last member
    for i in range(layers):
        block = f"layers.{i}"
        event(EventKind.FORWARD_START, block, 0)
        slot_seq: dict[int, int] = {}  # slot -> its last record in this layer
        for op in ops:
            name = f"{block}.{op.name}"
            event(EventKind.FORWARD_START, name, 0)
            now += op.forward_s
            seen_slots: dict[int, int] = {}
            for ordinal, (slot, nbytes, rebuilt_from) in enumerate(op.saves):
                f = fid(i, slot)
                view = seen_slots.get(slot, 0)
                seen_slots[slot] = view + 1
                if f not in family_last:
                    live += slot_bytes[slot]
                seq = len(packs)
                packs.append(
                    {
                        "family": f,
                        "module": name,
                        "ordinal": ordinal,
                        "nbytes": nbytes,
                        "storage": slot_bytes[slot],
                        "offset": view * nbytes,
                        "time": now,
                        "event": -1,
                        "unpacks": [],
                        "layer": i,
                        "rebuild": slot_seq.get(rebuilt_from, -1),
                    }
                )
                slot_seq[slot] = seq
                packs[seq]["event"] = event(EventKind.PACK, name, 0, seq)
                family_last[f] = seq
            event(EventKind.FORWARD_END, name, 0)
        event(EventKind.FORWARD_END, block, 0)
    event(EventKind.FORWARD_END, "", 0)
    # Backward: layers and their ops in reverse; each op unpacks what it saved, at twice its
    # forward time; a family is freed after its last member's unpack.
    by_op: dict[str, list[int]] = {}
    for seq, p in enumerate(packs):
        by_op.setdefault(p["module"], []).append(seq)
    remaining = {f: 0 for f in family_last}
    for p in packs:
        remaining[p["family"]] += 1
    event(EventKind.BACKWARD_START, "", 0)
    for i in reversed(range(layers)):
        block = f"layers.{i}"
        event(EventKind.BACKWARD_START, block, 0)
        for op in reversed(ops):
            name = f"{block}.{op.name}"
            event(EventKind.BACKWARD_START, name, 0)
            for seq in by_op[name]:
                p = packs[seq]
                p["unpacks"].append((event(EventKind.UNPACK, name, 0, seq), now))
            now += 2.0 * op.forward_s
            for seq in by_op[name]:
                f = packs[seq]["family"]
                remaining[f] -= 1
                if remaining[f] == 0:
                    live -= slot_bytes[_slot_of(f, slot_bytes)]
            event(EventKind.BACKWARD_END, name, 0)
        event(EventKind.BACKWARD_END, block, 0)
    event(EventKind.BACKWARD_END, "", 0)
    event(EventKind.STEP_END)
    records = tuple(
        TensorRecord(
            seq=seq,
            step=0,
            family=p["family"],
            module=p["module"],
            call_index=0,
            ordinal=p["ordinal"],
            nbytes=p["nbytes"],
            storage_nbytes=p["storage"],
            storage_offset=p["offset"] // 2,
            shape=(p["nbytes"] // 2,),
            stride=(1,),
            dtype="torch.bfloat16",
            device="cuda:0",
            is_parameter=False,
            grad_fn="",
            in_backward=False,
            pack_event=p["event"],
            pack_time_s=p["time"],
            unpack_events=tuple(e for e, _ in p["unpacks"]),
            unpack_times_s=tuple(t for _, t in p["unpacks"]),
            rebuild_from=p["rebuild"],
        )
        for seq, p in enumerate(packs)
    )
    return Trace(
        records=records,
        events=tuple(events),
        metadata={"source": "lifecycle.transformer_trace", "device": "cuda:0"},
    )


def _slot_of(family: int, slot_bytes: dict[int, int]) -> int:
    return family % len(slot_bytes)
