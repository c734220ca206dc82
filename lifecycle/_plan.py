"""A plan: where each alias family of a step waits, and when it comes back, as plain data.

:func:`lifecycle.plan` makes one from a :class:`~offload.lifecycle.Trace`; the ``offload`` executor
carries it out. A plan names tensors by their record keys (module path, call index within the
step, ordinal of the pack within that call), which are stable across steps of one signature, and
it names the events that start reloads the same way, so the executor needs no event counter.
Plans are JSON with a schema version and explain themselves (:meth:`Plan.summary`).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Any

from offload.lifecycle._hardware import HardwareModel
from offload.lifecycle._jsonfile import check_header, read_json, write_json
from offload.lifecycle._placement import Decision, Placement
from offload.lifecycle._report import check_top
from offload.lifecycle._units import format_bytes

PLAN_SCHEMA_VERSION = 1
_FORMAT = "offload.plan"
_ANCHORS = ("keep_all", "offload_all", "checkpoint_blocks")  # NOTE [ Anchors ] in _anchors
_TIERS = ("cpu", "nvme")

Key = tuple[str, int, int]  # (module path, call index, ordinal): TensorRecord.key


class BudgetInfeasibleError(ValueError):
    """No plan keeps the step under the budget (less the margin).

    Attributes:
        budget_bytes: the budget asked for.
        min_feasible_bytes: the smallest budget a plan can meet on this trace (everything movable
            offloaded, reloads just in time), margin included.

    Example:
        >>> e = BudgetInfeasibleError("too small", budget_bytes=10, min_feasible_bytes=25)
        >>> e.min_feasible_bytes - e.budget_bytes
        15
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes

    def __reduce__(self) -> Any:
        return (
            _rebuild_infeasible,
            (type(self), str(self), self.budget_bytes, self.min_feasible_bytes),
        )


def _rebuild_infeasible(cls: type, message: str, budget: int, floor: int) -> BudgetInfeasibleError:
    return cls(message, budget_bytes=budget, min_feasible_bytes=floor)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trigger:
    """A point of the backward pass where reloads start, as the executor sees it.

    Attributes:
        kind: ``"backward"`` (right before the backward of module call ``(module, call_index)``
            starts: a pre-hook on its outputs' ``grad_fn``) or ``"unpack"`` (when the record
            ``(module, call_index, ordinal)`` is unpacked).
        module / call_index / ordinal: which one (``ordinal`` is -1 for ``"backward"``).

    Example:
        >>> Trigger(kind="backward", module="layers.3", call_index=0).key
        ('backward', 'layers.3', 0, -1)
    """

    kind: str
    module: str
    call_index: int
    ordinal: int = -1

    def __post_init__(self) -> None:
        if self.kind not in ("backward", "unpack"):
            raise ValueError(f"Trigger.kind must be 'backward' or 'unpack'; got {self.kind!r}")
        if self.kind == "backward" and self.ordinal != -1:
            raise ValueError("Trigger.ordinal applies to kind 'unpack' only")

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.kind, self.module, self.call_index, self.ordinal)

    def __reduce__(self) -> Any:
        # Explicit, so that pickling a frozen slotted dataclass works on Python 3.10 too.
        return (_rebuild, (Trigger, tuple(getattr(self, f.name) for f in fields(self))))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry:
    """What the plan does with one alias family.

    Attributes:
        family: the family's id in the planned trace.
        keys: record keys of its members, in pack order; the first one decides at execution.
        nbytes: bytes its copy spans.
        module: module path of its first record (for summaries).
        placement: KEEP, CPU, NVME, RECOMPUTE or REBUILD (not stored: rebuilt at its first
            unpack from the family its records' ``rebuild_from`` names).
        reload: CPU / NVME: where its reload starts (``None``: when backward reaches the module
            call that packed it).
        reload_event: the same point as an event index of the planned trace (for the simulator;
            -1 with ``reload=None``).
        recompute_module: RECOMPUTE: the module whose forward call runs again.
    """

    family: int
    keys: tuple[Key, ...]
    nbytes: int
    module: str
    placement: Placement
    reload: Trigger | None = None
    reload_event: int = -1
    recompute_module: str = ""

    def decision(self) -> Decision:
        """This entry as the simulator's :class:`~offload.lifecycle.Decision`."""
        return Decision(
            placement=self.placement,
            reload_event=self.reload_event if self.placement.moves else -1,
            recompute_module=self.recompute_module,
        )

    def __reduce__(self) -> Any:
        return (_rebuild, (PlanEntry, tuple(getattr(self, f.name) for f in fields(self))))


def _rebuild(cls: type, values: tuple) -> Any:
    return cls(**{f.name: v for f, v in zip(fields(cls), values, strict=True)})


def _bulk(cls: type, n: int, columns: Mapping[str, Iterable[Any]]) -> list[Any]:
    """``n`` instances of the slotted dataclass ``cls``, field by field from ``columns`` (one
    iterable of ``n`` values per field), without calling ``__init__``: a planner builds one
    entry per family of a step (100k of them), and this runs in C about twice as fast. For
    classes whose fields need no validation, or whose values are valid by construction."""
    objs: list[Any] = list(map(object.__new__, repeat(cls, n)))
    names = {f.name for f in fields(cls)}
    if set(columns) != names:
        raise ValueError(f"{cls.__name__} needs exactly the fields {sorted(names)}")
    for name, values in columns.items():
        deque(map(getattr(cls, name).__set__, objs, values), maxlen=0)
    return objs


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A predicted step: device peak (base included) and time."""

    peak_bytes: int
    step_s: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where each alias family of one step waits, and when it comes back.

    Made by :func:`lifecycle.plan`; carried out by ``offload.ActivationOffloader(plan=...)``.

    Attributes:
        gpu_budget_bytes: the budget planned for.
        margin_bytes: room left under it for what the trace cannot show (allocator rounding,
            workspaces): the plan aims at ``gpu_budget_bytes - margin_bytes``.
        tiers: the tiers the plan may use.
        entries: one per activation family of the step (KEEP ones included).
        recompute_calls: ``(module, call index)`` of each module call run under non-reentrant
            checkpoint.
        expected_keys: the record keys the executed step will show (packs inside a recomputed
            call vanish); a pack whose key is not here is unplanned.
        predicted: the plan's predicted peak and step time.
        anchors: what running each alternative instead would give (NOTE [ Anchors ] in
            ``lifecycle._anchors``): keeping everything (``"keep_all"``), the manager's
            min-memory mode (``"offload_all"``) and non-reentrant checkpoint around every block
            (``"checkpoint_blocks"``), as :func:`lifecycle.predict_anchors` simulates them;
            without a simulation, the planner model's ``"keep_all"`` and (when it may recompute
            every block) ``"checkpoint_blocks"``.
        trace_step_s: the planned step's time in the trace.
        base_bytes: device memory at the step's start in the trace.
        prediction_source: ``"simulator"`` (the plan's peak replayed by
            :func:`lifecycle.simulate`, its step time from the planner's model, which chose the
            plan, so that a larger budget never predicts a slower step, the simulated one in
            ``metadata["simulated_step_s"]``; the anchors simulated, peaks and step times) or
            ``"planner model"`` (every figure from the planner's own closed-form model, whose
            peak bounds the simulator's: used above ``simulate_records`` records, where the
            simulator takes seconds).
        hardware: the hardware model planned with.
        signature: what the plan is for (the input shapes and dtypes of the root module; free
            text, "" when unknown).
        metadata: free-form facts: ``planning_s``, ``candidates_scored``, ``simulations``,
            ``records``, ``recomputed_blocks``, ``offloaded_families``, ``reload_lead``,
            ``model_peak_bytes`` (the planner model's peak) and, after a replay,
            ``simulated_step_s``.
    """

    gpu_budget_bytes: int
    margin_bytes: int
    tiers: tuple[str, ...]
    entries: tuple[PlanEntry, ...]
    recompute_calls: tuple[tuple[str, int], ...]
    expected_keys: tuple[Key, ...]
    predicted: Prediction
    anchors: Mapping[str, Prediction]
    trace_step_s: float
    base_bytes: int
    prediction_source: str
    hardware: HardwareModel
    signature: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Counts, not contents (the generated repr printed every entry and key); :meth:`summary`
        # is the report.
        return (
            f"Plan(gpu_budget_bytes={self.gpu_budget_bytes}, tiers={self.tiers}, "
            f"entries={len(self.entries)}, recompute_calls={len(self.recompute_calls)}, "
            f"predicted_peak_bytes={self.predicted.peak_bytes}, "
            f"predicted_step_s={self.predicted.step_s:.6g}, signature={self.signature!r})"
        )

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted.peak_bytes

    @property
    def predicted_step_s(self) -> float:
        return self.predicted.step_s

    @property
    def target_bytes(self) -> int:
        """``gpu_budget_bytes - margin_bytes``: what the predicted peak must not exceed."""
        return self.gpu_budget_bytes - self.margin_bytes

    def bytes_by_placement(self) -> dict[str, int]:
        """Family bytes per placement: ``{"keep": ..., "cpu": ..., "nvme": ..., "recompute": ...,
        "rebuild": ...}``."""
        out = {p.value: 0 for p in Placement}
        for e in self.entries:
            out[e.placement.value] += e.nbytes
        return out

    def decisions(self) -> dict[int, Decision]:
        """``{family id: Decision}`` for :func:`lifecycle.simulate` on the planned trace."""
        return {e.family: e.decision() for e in self.entries if e.placement is not Placement.KEEP}

    def with_signature(self, signature: str) -> Plan:
        """A copy of this plan labelled with ``signature``."""
        from dataclasses import replace

        return replace(self, signature=signature)

    # -- explanation -------------------------------------------------------------------------

    def summary(self, top: int = 12) -> str:
        """A plain-text explanation: budget, predictions next to the anchors, bytes per tier,
        and the ``top`` modules holding the most bytes (0: none) with where their bytes wait.

        Raises:
            TypeError / ValueError: ``top`` is not an int >= 0.
        """
        check_top(top)
        lines = [
            f"plan for a budget of {format_bytes(self.gpu_budget_bytes)} "
            f"(margin {format_bytes(self.margin_bytes)}, aiming at {format_bytes(self.target_bytes)}); "
            f"tiers {', '.join(self.tiers)}; "
            + (
                "the plan's peak from the simulator and its step time from the planner model; "
                "the anchors simulated"
                if self.prediction_source == "simulator"
                else f"predictions from the {self.prediction_source}"
            ),
            "",
            f"  {'':<20} {'peak':>12} {'step':>11} {'x keep all':>10}",
        ]
        base = self.anchors.get("keep_all")
        rows = [("this plan", self.predicted), *self.anchors.items()]
        for name, p in rows:
            ratio = p.step_s / base.step_s if base and base.step_s > 0 else float("nan")
            lines.append(
                f"  {name:<20} {format_bytes(p.peak_bytes):>12} {p.step_s * 1e3:>9.2f}ms "
                f"{ratio:>10.3f}"
            )
        missing = [a for a in _ANCHORS if a not in self.anchors]
        if missing:
            # See NOTE [ Anchors ] in lifecycle._anchors: the model has no look-ahead window.
            lines.append(
                f"  {', '.join(missing)}: not predicted without a simulation of the step "
                "(lifecycle.predict_anchors simulates them)"
            )
        by = self.bytes_by_placement()
        lines += [
            "",
            "  bytes by placement: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in by.items() if v or k == "keep"),
        ]
        if self.recompute_calls:
            calls = ", ".join(f"{m or '<root>'}[{c}]" for m, c in self.recompute_calls[:8])
            more = len(self.recompute_calls) - 8
            lines.append(
                f"  recomputed module calls ({len(self.recompute_calls)}): {calls}"
                + (f", ... {more} more" if more > 0 else "")
            )
        per_module: dict[str, dict[str, int]] = {}
        for e in self.entries:
            row = per_module.setdefault(e.module, {p.value: 0 for p in Placement})
            row[e.placement.value] += e.nbytes
        ranked = sorted(per_module.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        if ranked:
            width = max(24, *(len(m) for m, _ in ranked))
            shown = (
                f"  top {len(ranked)} of {len(per_module)} modules by bytes:"
                if len(ranked) < len(per_module)
                else f"  {len(per_module)} modules:"
            )
            lines += ["", shown]
            lines.append(f"  {'module':<{width}} " + " ".join(f"{p.value:>10}" for p in Placement))
            for module, row in ranked:
                lines.append(
                    f"  {module or '<root>':<{width}} "
                    + " ".join(f"{_short(row[p.value]):>10}" for p in Placement)
                )
        return "\n".join(lines)

    # -- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "format": _FORMAT,
            "schema_version": PLAN_SCHEMA_VERSION,
            "gpu_budget_bytes": self.gpu_budget_bytes,
            "margin_bytes": self.margin_bytes,
            "tiers": list(self.tiers),
            "signature": self.signature,
            "prediction_source": self.prediction_source,
            "trace_step_s": self.trace_step_s,
            "base_bytes": self.base_bytes,
            "predicted": _prediction_to_json(self.predicted),
            "anchors": {k: _prediction_to_json(v) for k, v in self.anchors.items()},
            "hardware": self.hardware.to_dict(),
            "recompute_calls": [list(c) for c in self.recompute_calls],
            "expected_keys": [list(k) for k in self.expected_keys],
            "entries": [_entry_to_json(e) for e in self.entries],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: another format or schema; a missing field or one not of the type and
                range :meth:`to_dict` writes (named, with its value); or entries that disagree
                (a family or record key in two entries, a move to a tier the plan does not
                have, a recomputation in a call ``recompute_calls`` does not list).
        """
        check_header(data, fmt=_FORMAT, version=PLAN_SCHEMA_VERSION, what="plan")
        tiers, anchors = data.get("tiers"), data.get("anchors")
        if (
            not isinstance(tiers, list)
            or not tiers
            or any(t not in _TIERS for t in tiers)
            or len(set(tiers)) != len(tiers)
        ):
            raise ValueError(
                f"plan field 'tiers' must be a list naming 'cpu' and/or 'nvme', each once; got "
                f"{tiers!r}"
            )
        if not isinstance(anchors, Mapping):
            raise ValueError(
                "plan field 'anchors' must be a JSON object of predictions by name; got "
                f"{anchors!r}"
            )
        metadata = data.get("metadata", {})
        if not isinstance(metadata, Mapping):
            raise ValueError(f"plan field 'metadata' must be a JSON object; got {metadata!r}")
        try:
            budget = _size(data["gpu_budget_bytes"], "gpu_budget_bytes", low=1)
            plan = cls(
                gpu_budget_bytes=budget,
                margin_bytes=_size(data["margin_bytes"], "margin_bytes", high=budget),
                tiers=tuple(tiers),
                signature=_str(data.get("signature", ""), "signature"),
                prediction_source=_str(data["prediction_source"], "prediction_source"),
                trace_step_s=_seconds(data["trace_step_s"], "trace_step_s"),
                base_bytes=_size(data["base_bytes"], "base_bytes"),
                predicted=_prediction_from_json(data["predicted"], "predicted"),
                anchors={k: _prediction_from_json(v, f"anchors.{k}") for k, v in anchors.items()},
                hardware=HardwareModel.from_dict(data["hardware"]),
                recompute_calls=tuple(
                    _call(c, f"recompute_calls[{i}]")
                    for i, c in enumerate(_list(data["recompute_calls"], "recompute_calls"))
                ),
                expected_keys=tuple(
                    _key(k, f"expected_keys[{i}]")
                    for i, k in enumerate(_list(data["expected_keys"], "expected_keys"))
                ),
                entries=tuple(
                    _entry_from_json(e, f"entries[{i}]")
                    for i, e in enumerate(_list(data["entries"], "entries"))
                ),
                metadata=dict(metadata),
            )
        except KeyError as e:
            raise ValueError(f"plan file is missing the field {e.args[0]!r}") from None
        except TypeError as e:  # an entry that is not an object, say
            raise ValueError(f"plan file has a malformed field: {e}") from None
        _check_consistent(plan)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path`` (atomically: a temp file, then a rename)."""
        write_json(path, self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not an offload plan, has another schema version, or is
                malformed (see :meth:`from_dict`).
        """
        return cls.from_dict(read_json(path))


def _short(n: int) -> str:
    return "-" if n == 0 else format_bytes(n)


# A loaded plan's fields: each of the type to_dict() writes, or a ValueError naming the field
# (int() of "8GiB", or unpacking a key of two items, said neither where nor what).
_INT64 = 2**63


def _size(v: Any, field: str, *, low: int = 0, high: int = _INT64 - 1) -> int:
    if type(v) is not int or not low <= v <= high:
        raise ValueError(f"plan field {field!r} must be an int in [{low}, {high}]; got {v!r}")
    return v


def _int(v: Any, field: str) -> int:
    if type(v) is not int or not -_INT64 <= v < _INT64:
        raise ValueError(f"plan field {field!r} must be an int; got {v!r}")
    return v


def _str(v: Any, field: str) -> str:
    if type(v) is not str:
        raise ValueError(f"plan field {field!r} must be a string; got {v!r}")
    return v


def _seconds(v: Any, field: str) -> float:
    if type(v) not in (int, float) or not 0 <= v < math.inf:
        raise ValueError(f"plan field {field!r} must be a finite number of seconds >= 0; got {v!r}")
    return float(v)


def _list(v: Any, field: str) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"plan field {field!r} must be a list; got {v!r}")
    return v


def _call(c: Any, field: str) -> tuple[str, int]:
    if not isinstance(c, list) or len(c) != 2:
        raise ValueError(f"plan field {field!r} must be [module, call index]; got {c!r}")
    return (_str(c[0], field), _size(c[1], field))


def _key(k: Any, field: str = "key") -> Key:
    if not isinstance(k, (list, tuple)) or len(k) != 3:
        raise ValueError(f"plan field {field!r} must be [module, call index, ordinal]; got {k!r}")
    return (_str(k[0], field), _size(k[1], field), _size(k[2], field))


def _check_consistent(plan: Plan) -> None:
    """A loaded plan's entries agree with each other and with the plan (what :func:`plan`
    makes always does): one entry per family, each key in one entry, moves only to the plan's
    tiers, recomputation only in the calls it lists."""
    families: set[int] = set()
    keys: set[Key] = set()
    recomputed = {m for m, _ in plan.recompute_calls}
    for i, e in enumerate(plan.entries):
        where = f"plan entries[{i}] (family {e.family})"
        if e.family in families:
            raise ValueError(f"{where}: another entry has this family")
        families.add(e.family)
        if not e.keys:
            raise ValueError(f"{where}: no record keys")
        for k in e.keys:
            if k in keys:
                raise ValueError(f"{where}: key {list(k)} is another entry's too")
            keys.add(k)
        tier = {Placement.CPU: "cpu", Placement.NVME: "nvme"}.get(e.placement)
        if tier is not None and tier not in plan.tiers:
            raise ValueError(
                f"{where}: moves to {tier}, which is not among the plan's tiers {list(plan.tiers)}"
            )
        if e.placement is Placement.RECOMPUTE and e.recompute_module not in recomputed:
            raise ValueError(
                f"{where}: recomputed in {e.recompute_module!r}, which recompute_calls does not "
                f"list ({sorted(recomputed)})"
            )


def _prediction_to_json(p: Prediction) -> dict[str, Any]:
    return {"peak_bytes": p.peak_bytes, "step_s": p.step_s}


def _prediction_from_json(d: Any, field: str) -> Prediction:
    if not isinstance(d, Mapping):
        raise ValueError(f"plan field {field!r} must be a JSON object; got {d!r}")
    return Prediction(
        peak_bytes=_size(d["peak_bytes"], f"{field}.peak_bytes"),
        step_s=_seconds(d["step_s"], f"{field}.step_s"),
    )


def _entry_to_json(e: PlanEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "family": e.family,
        "keys": [list(k) for k in e.keys],
        "nbytes": e.nbytes,
        "module": e.module,
        "placement": e.placement.value,
    }
    if e.reload is not None:
        out["reload"] = list(e.reload.key)
        out["reload_event"] = e.reload_event
    if e.recompute_module:
        out["recompute_module"] = e.recompute_module
    return out


def _entry_from_json(d: Any, field: str) -> PlanEntry:
    if not isinstance(d, Mapping):
        raise ValueError(f"plan field {field!r} must be a JSON object; got {d!r}")
    reload = None
    if "reload" in d:
        r = d["reload"]
        if not isinstance(r, list) or len(r) != 4:
            raise ValueError(
                f"plan field '{field}.reload' must be [kind, module, call index, ordinal]; got "
                f"{r!r}"
            )
        reload = Trigger(
            kind=_str(r[0], f"{field}.reload"),
            module=_str(r[1], f"{field}.reload"),
            call_index=_size(r[2], f"{field}.reload"),
            ordinal=_int(r[3], f"{field}.reload"),
        )
    try:
        placement = Placement(d["placement"])
    except ValueError:
        raise ValueError(
            f"plan field '{field}.placement' must be one of "
            f"{[p.value for p in Placement]}; got {d['placement']!r}"
        ) from None
    return PlanEntry(
        family=_size(d["family"], f"{field}.family"),
        keys=tuple(_key(k, f"{field}.keys") for k in _list(d["keys"], f"{field}.keys")),
        nbytes=_size(d["nbytes"], f"{field}.nbytes"),
        module=_str(d["module"], f"{field}.module"),
        placement=placement,
        reload=reload,
        reload_event=_int(d.get("reload_event", -1), f"{field}.reload_event"),
        recompute_module=_str(d.get("recompute_module", ""), f"{field}.recompute_module"),
    )
