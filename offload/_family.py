"""One alias family's life off the device: its state machine, its bytes, the member handles pack
returns for it (``_Member``), and how views come back.

NOTE [ Alias handling ]
    A family is one live storage at one version of one version counter, keyed on the storage's
    Python object and the root tensor whose counter the member uses (its view base, else itself;
    both held weakly) plus ``t._version``, and never on ``data_ptr()``. Versions of different
    counters do not compare: GRU cells split one storage with ``unsafe_chunk`` (no views, a
    counter each) and change the pieces in place, so sibling pieces reach equal versions holding
    different bytes (matching on storage and version alone would give a wrong gradient). Never on
    ``data_ptr()``: once an offloaded tensor is freed, the
    allocator hands its address to the next tensor of the step (keying on the address gives
    wrong gradients). The family is copied once, from ``t.detach()`` taken inside pack (a
    later ``out.data = ...`` must not change what is copied): the whole storage when the first
    member spans at least a quarter of it (views packed later, such as q, k and v of one qkv
    output, are then covered), else just that member's byte span (``WHOLE_STORAGE_FACTOR`` in
    lifecycle's ``_trace.py``: a trace counts a family's bytes by the same rule, so a plan's bytes
    are the bytes moved). A later member inside the copy
    reuses it; one reaching outside it, or packed at a newer version, starts a new family. Members come back as ``as_strided``
    views over one reloaded buffer whose address is congruent to the original modulo 4096 bytes,
    so every member keeps its original alignment (kernels choose code paths by alignment: a
    compact rebuild can change a ``dot`` result).
"""

from __future__ import annotations

import enum
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from offload._errors import OffloadError

if TYPE_CHECKING:
    from offload._executor import Executor

ALIGN_BYTES = 4096
# A lazy view's flags (``_Member.bits``): a conjugate or negative view (``h.conj()``, its
# ``.imag``) is its plain bytes plus a flag.
CONJ, NEG = 1, 2


class Life(enum.Enum):
    """Where a family's bytes are. See ``_NEXT`` for the legal transitions."""

    ON_DEVICE = "on device"  # packed; the copy out has not started
    COPYING_OUT = "copying out"  # the copy out is in flight; the source is still held
    OFF_DEVICE = "off device"  # stored in a tier only
    COPYING_IN = "copying in"  # a reload is in flight
    RESIDENT = "resident"  # reloaded; the device buffer is held for the members' unpacks
    FREED = "freed"  # every member is gone, or the step failed: the tier bytes are released


_NEXT: dict[Life, frozenset[Life]] = {
    Life.ON_DEVICE: frozenset({Life.COPYING_OUT, Life.FREED}),
    Life.COPYING_OUT: frozenset({Life.OFF_DEVICE, Life.FREED}),
    Life.OFF_DEVICE: frozenset({Life.COPYING_IN, Life.FREED}),
    Life.COPYING_IN: frozenset({Life.RESIDENT, Life.OFF_DEVICE, Life.FREED}),
    Life.RESIDENT: frozenset({Life.OFF_DEVICE, Life.FREED}),
    Life.FREED: frozenset(),
}
# The same table on the states themselves, searched by identity, for Family.to (several moves
# per saved tensor): a dict or set lookup of an Enum member calls Enum.__hash__, which is Python
# code, and an attribute of the state is one lookup less than a table keyed by ``id()``.
for _state, _allowed in _NEXT.items():
    _state._next = tuple(_allowed)  # type: ignore[attr-defined]
del _state, _allowed


class IllegalTransition(OffloadError):
    """A family was asked to move to a state its current state does not lead to (a bug)."""


class Family:
    """The bytes of one alias family and their state. All fields are guarded by the executor's
    lock; this class only checks transitions and does arithmetic."""

    __slots__ = (
        "__weakref__",
        "ahead",
        "dense",
        "error",
        "fid",
        "guard",
        "handle",
        "life",
        "members",
        "module",
        "nbytes",
        "order",
        "reload",
        "reload_event",
        "reload_started_s",
        "reload_stream",
        "resident",
        "resident_ref",
        "root_ref",
        "source",
        "source_event",
        "span_start",
        "spill",
        "staging",
        "step_ref",
        "storage_mod",
        "storage_ref",
        "tier",
        "token",
        "typed",
        "unpack_round",
        "unpacked",
        "unpacked_task",
        "version",
        "view",
    )

    def __init__(
        self,
        fid: int,
        storage: torch.UntypedStorage,
        root: torch.Tensor,
        version: int,
        span_start: int,
        nbytes: int,
        storage_ptr: int,
        module: str,
        order: int,
        step_ref: Any = None,
    ) -> None:
        # (Positional at the executor's one call, once per family: binding eleven keywords
        # cost more than the rest of the call.)
        self.fid = fid
        self.storage_ref = weakref.ref(storage)
        # The tensor whose version counter ``version`` is read from (lifecycle.version_root).
        self.root_ref = weakref.ref(root)
        self.version = version
        self.span_start = span_start  # byte offset of the copied span in the storage
        self.nbytes = nbytes  # bytes of the copied span
        # Address of the span's first byte modulo ALIGN_BYTES; see NOTE [ Alias handling ].
        self.storage_mod = (storage_ptr + span_start) % ALIGN_BYTES
        self.module = module  # module path of the first member (for prefetch order and stats)
        self.order = order  # position among the step's offloaded families (pack order)
        # The executor's state of the step that packed it (for prefetch), held weakly: the step
        # holds its families, and a cycle would keep freed families until a gc pass. The step's
        # own reference (``_StepState.ref``): one call less per family.
        self.step_ref: Any = step_ref
        self.life = Life.ON_DEVICE
        self.members = 0  # live packed handles
        # Held by each of them too: the truth when a release was cut short (NOTE [ Member
        # tokens ]).
        self.token = object()
        self.unpacked = 0  # unpacks since the last reload, of members still alive
        # Counts the times ``unpacked`` started over: a member unpacked in the current round
        # takes its unpack with it when it dies (see _release.release).
        self.unpack_round = 0
        self.unpacked_task = -1  # the graph task (backward) of the last of them
        # Held until copied: a uint8 view of the span, or the first member's ``t.detach()``
        # itself where the family is that one dense tensor (``dense``).
        self.source: torch.Tensor | None = None
        # ``(dtype, size, stride)`` of the family's one dense tensor: a plain contiguous tensor
        # that is its storage's whole bytes (most saved tensors), copied and reloaded as itself
        # (NOTE [ Whole tensors ]); else None.
        self.dense: tuple[torch.dtype, tuple[int, ...], tuple[int, ...]] | None = None
        # ``t.detach()`` of the first member, held as long as ``source``: it shares the saved
        # tensor's version counter, so an in-place change before the copy completed is seen.
        self.guard: torch.Tensor | None = None
        self.source_event: Any = None  # CUDA event D (copy out done), or None on CPU
        self.staging: Any = None  # pinned region an NVMe reload lands in (GPU)
        # GPU + NVMe: the pinned region holding the record while its file write runs (and, if
        # that write fails, for good); the device copy is dropped as soon as D completes.
        self.spill: Any = None
        self.tier: Any = None
        self.handle: Any = None  # storage.StoredHandle
        self.reload: Any = None  # storage Transfer of a reload in flight
        self.reload_event: Any = None  # CUDA event R (copy in done)
        self.reload_started_s = 0.0
        # The stream current when the reload buffer was allocated: its caching-allocator pool
        # (see NOTE [ Stream ordering ], rule 3, in _executor.py).
        self.reload_stream: Any = None
        # Raw 1-D device buffer of a reload: uint8, or a whole tensor's dtype (NOTE [ Whole
        # tensors ]).
        self.resident: torch.Tensor | None = None
        self.typed: torch.Tensor | None = None  # ``resident`` viewed as its members' dtype
        # The last member view rebuilt over ``resident``, with its facts: ``(dtype, size,
        # stride, offset_bytes, view)`` (see rebuild).
        self.view: tuple[Any, ...] | None = None
        self.resident_ref: weakref.ref | None = None
        self.ahead = False  # counted in the executor's look-ahead bytes
        self.error: BaseException | None = None

    def to(self, new: Life) -> None:
        """Move to ``new``; an illegal move raises naming the family, its state and the legal ones."""
        if new not in self.life._next:  # type: ignore[attr-defined]
            allowed = ", ".join(sorted(s.value for s in _NEXT[self.life])) or "none"
            raise IllegalTransition(
                f"alias family {self.fid} ({self.module or '<root>'}, {self.nbytes} bytes) cannot go "
                f"from '{self.life.value}' to '{new.value}'; allowed next: {allowed}"
            )
        self.life = new

    def covers(self, start: int, end: int) -> bool:
        return self.span_start <= start and end <= self.span_start + self.nbytes


# NOTE [ Whole tensors ]
#     Most saved tensors are a plain contiguous tensor whose storage holds just its elements
#     (an op's output). Such a family (``Family.dense``: the tensor's dtype, size and stride;
#     no conjugate or negative bit, not a subclass) is copied as the tensor itself: its
#     ``t.detach()`` (the guard) is the source, copied into the host region's view of its
#     shape (NOTE [ Typed copies ] in storage/_pool.py), where any other family's source is a
#     uint8 view of its span (two views per family). On a CPU device its reload buffer is
#     of the tensor's dtype, and the reload fills the tensor's own view over it, at the same
#     aligned offset, kept as the family's last view (``Family.view``) for ``rebuild`` to hand
#     out: one view per reload where there were three (the uint8 slice the reload filled,
#     the buffer as the dtype, the member's view). The bytes are the same: a copy between
#     equal dtypes moves the bytes as they are. A member of another dtype or layout is
#     rebuilt from the same buffer as before (viewed as its bytes first). On CUDA the reload
#     still fills a uint8 slice of a uint8 buffer (its H2D copy is issued from the bytes of
#     the host region or of NVMe staging).

# NOTE [ Member tokens ]
#     A member's ``__del__`` releases its family, and an exception raised inside it (a
#     KeyboardInterrupt arriving there, even at its first line) is printed and dropped by
#     Python: the release stops where it was, and ``members`` still counts a member that is
#     gone. ``_release.release_lost`` then needs the truth: whether any member of the family
#     is still alive. Each family makes one plain ``object()``, its token, and each member
#     holds it: the token's reference count is the family's one plus one per live member, and
#     CPython drops a dying member's references in C after its ``__del__``, where nothing can
#     cut it short. A weak reference per member told the same, but it was an object the
#     collector tracks per saved tensor, and a list of them per family (NOTE [ Objects per
#     saved tensor ] in _executor.py); the token is not tracked, and one per family.


def live_members(fam: Family) -> int:
    """How many member handles of ``fam`` are alive (NOTE [ Member tokens ])."""
    # getrefcount counts its own argument and the family's reference.
    return sys.getrefcount(fam.token) - 2


class _Member:
    """What pack returns for an offloaded tensor: its family and how to rebuild the view.

    Dropping it (autograd freed the saved variable, or the graph died) releases the family's bytes
    once no member is left. Its family counts it by its token (NOTE [ Member tokens ]).
    """

    __slots__ = (
        "__weakref__",
        "bits",
        "dtensor",
        "dtype",
        "executor",
        "family",
        "holders",
        "key",
        "offset_bytes",
        "seq",
        "size",
        "stride",
        "token",
        "unpacked_in",
        "unpacks",
    )

    def __init__(
        self,
        executor: Executor,
        family: Family,
        dtype: torch.dtype,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        offset_bytes: int,
        bits: int,
        dtensor: Any,
        key: Any = None,
    ) -> None:
        # (The saved tensor's facts, read once by Executor.offload.)
        self.key = key  # (module, call index, ordinal) under a plan: unpack triggers
        self.seq = -1  # the recorder's record number during a profiling step
        self.unpacked_in = -1  # the family's unpack round it was last unpacked in
        self.unpacks = 0  # its unpacks in that round
        # The saved variables autograd holds it in: more than one where an op saved one tensor
        # twice (NOTE [ Packed again ] in _pack.py); the family counts each.
        self.holders = 1
        self.executor = executor
        self.family = family
        self.token = family.token  # (NOTE [ Member tokens ])
        self.dtype = dtype
        self.size = size  # a plain tuple (NOTE [ Objects per saved tensor ] in _executor.py)
        self.stride = stride
        self.offset_bytes = offset_bytes  # of element 0 in the storage
        # Copied bytes carry no CONJ / NEG flag (NOTE in _family.py), so the view gets its
        # flags back at unpack.
        self.bits = bits
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a DTensor, else None

    def __del__(self) -> None:
        # Once per saved tensor: try/except, not contextlib.suppress (an object per call).
        try:  # noqa: SIM105
            self.executor.release(self.family, self.unpacked_in, self.holders, self.unpacks)
        except Exception:  # in a finalizer: nothing to raise to
            pass

    def source_view(self) -> torch.Tensor:
        """A view of the family's source, held until its copy out completed (rule 3)."""
        # Views of the source only (slice, dtype view, as_strided), no ``set_``: on CUDA the D2H
        # stream may still read these bytes, and torch's CUDA sanitizer counts ``set_``'s return
        # (``Tensor(a!)``) as a write on the compute stream, unordered with that read: a data race
        # reported where there is none (torch/cuda/_sanitizer.py, ArgumentHandler.parse_outputs).
        fam = self.family
        item = self.dtype.itemsize
        src = fam.source  # uint8: the storage's bytes [span_start, span_start + nbytes)
        assert src is not None
        if fam.dense is not None:  # the tensor itself (NOTE [ Whole tensors ])
            if src.dtype is self.dtype:
                return src.as_strided(self.size, self.stride, self.offset_bytes // item)
            src = src.view(-1).view(torch.uint8)  # its bytes: the whole storage's
        lo = -fam.span_start % item  # the first byte at a multiple of the item size
        n = src.numel()
        usable = (n - lo) // item * item
        typed = (
            src.view(self.dtype)
            if lo == 0 and usable == n
            else src[lo : lo + usable].view(self.dtype)
        )
        return typed.as_strided(self.size, self.stride, self.offset_bytes // item)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (the rebuilt view) as the saved tensor was: its lazy flags, a DTensor."""
        if self.bits:
            if self.bits & CONJ:
                local = local.conj()
            if self.bits & NEG:
                local = torch._neg_view(local)
        if self.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )


def step_of(fam: Family) -> Any:
    """The executor's state of the step that packed ``fam``, while it lives."""
    return fam.step_ref() if fam.step_ref is not None else None


def span_of(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of ``t``'s storage that its elements touch."""
    item = t.element_size()
    start = int(t.storage_offset()) * item
    n = t.numel()
    if n == 0:
        return start, start
    if t.is_contiguous():  # the common case: its elements are one dense run
        return start, start + n * item
    extent = 1 + sum(int(n - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)
    return start, start + extent * item


def storage_bytes(
    t: torch.Tensor,
    start: int = 0,
    end: int = -1,
    bits: int = -1,
    stride: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A uint8 tensor over the bytes ``[start, end)`` of ``t``'s storage (``end`` -1: to its
    end), as one view (keeps the storage alive). ``bits`` (its ``CONJ`` / ``NEG`` flags) and
    ``stride`` (``t.stride()``): what the caller read of ``t`` already, else read here.

    Views of ``t`` only, never ``t.new_empty(0).set_(storage)``: ``set_`` returns ``Tensor(a!)``,
    which torch's CUDA sanitizer counts as a write to the storage on the current stream
    (torch/cuda/_sanitizer.py, ArgumentHandler.parse_outputs), and a second family of one
    storage is made while the first one's D2H copy may still read it: a data race reported
    where none is. A view of another dtype needs the conjugate and negative flags off (a lazy
    view's bytes are the plain ones), and starts as an empty tensor at byte 0, so any layout,
    storage offset and storage length (a multiple of no item size) is allowed.
    """
    if type(t) is not torch.Tensor:
        # A tensor subclass with bytes of its own is viewed as the plain tensor it is.
        with torch._C.DisableTorchFunctionSubclass():
            return _plain_bytes(t, start, end, bits, stride)
    return _plain_bytes(t, start, end, bits, stride)


def _plain_bytes(
    t: torch.Tensor, start: int, end: int, bits: int, stride: tuple[int, ...] | None
) -> torch.Tensor:
    if bits < 0:
        bits = (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)
    if bits & CONJ:
        t = t.conj()  # clears the flag: a view
    if bits & NEG:
        t = torch._neg_view(t)  # likewise
    if end < 0:
        end = t.untyped_storage().nbytes()
    if stride is None:
        stride = t.stride()  # (a flag's view keeps the strides)
    # Its bytes as uint8 in one view where its last dimension is dense (most tensors: one view
    # less, once per family), else from an empty view at byte 0, which any layout allows.
    if stride and stride[-1] == 1:
        head = t.view(torch.uint8)
    else:
        head = t.as_strided((0,), (1,), 0).view(torch.uint8)
    return head.as_strided((end - start,), (1,), start)


def aligned_offset(raw: torch.Tensor, mod: int) -> int:
    """The offset in ``raw`` whose address is ``mod`` modulo ALIGN_BYTES."""
    return (mod - raw.data_ptr()) % ALIGN_BYTES


def aligned_buffer(
    nbytes: int, mod: int, device: torch.device, dtype: torch.dtype = torch.uint8
) -> tuple[torch.Tensor, int]:
    """A device buffer of ``nbytes + ALIGN_BYTES`` bytes (1-D, of ``dtype``, whose item size
    divides ``nbytes``) and the byte offset in it whose address is ``mod`` modulo ALIGN_BYTES."""
    raw = torch.empty((nbytes + ALIGN_BYTES) // dtype.itemsize, dtype=dtype, device=device)
    return raw, aligned_offset(raw, mod)


def rebuild(
    raw: torch.Tensor,
    fam: Family,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset_bytes: int,
) -> torch.Tensor:
    """One member as a view over a reloaded buffer; see NOTE [ Alias handling ]."""
    last = fam.view
    if (
        last is not None
        and last[0] is dtype
        and last[3] == offset_bytes
        and last[1] == size
        and last[2] == stride
    ):
        # A member just like the last one unpacked (one tensor saved twice by one op, NOTE
        # [ Packed again ] in _pack.py): its view again. Autograd makes a variable of its own
        # from each view an unpack returns, so one serves both.
        return last[4]
    item = dtype.itemsize
    off = (fam.storage_mod - raw.data_ptr()) % ALIGN_BYTES  # aligned_offset, inline
    start = off + offset_bytes - fam.span_start  # byte position of the member's element 0
    # ``raw`` is 1-D with storage offset 0 (uint8, or a whole tensor's dtype).
    if start % item:
        raise OffloadError(
            f"internal: member of family {fam.fid} starts at byte {start}, not a multiple of its "
            f"itemsize {item}"
        )
    typed = fam.typed
    if typed is None or typed.dtype is not dtype:
        # (``raw`` itself: a whole tensor's buffer, NOTE [ Whole tensors ].)
        typed = raw if raw.dtype is dtype else _typed(raw, dtype)
        # The family's other members (q, k and v of one qkv output) reuse it: one view less
        # each. It holds the buffer as ``resident`` does, and is dropped with it.
        fam.typed = typed
    out = typed.as_strided(size, stride, start // item)
    if fam.members > 1:  # (a family of one member has no other view to serve)
        fam.view = (dtype, size, stride, offset_bytes, out)  # held as ``typed`` is, dropped with it
    return out


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (1-D, storage offset 0) viewed as ``dtype``: whole when its length divides,
    else its longest prefix that does (one view less per unpack where it divides)."""
    if raw.dtype is not torch.uint8:
        raw = raw.view(torch.uint8)  # its bytes (a whole tensor's buffer)
    item = dtype.itemsize
    n = raw.numel()
    usable = (n // item) * item
    return raw.view(dtype) if usable == n else raw[:usable].view(dtype)
