"""What a plan does with one alias family: where it waits (:class:`Placement`) and how it
comes back (:class:`Decision`). The vocabulary the planner, plans and the simulator share.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Placement(str, enum.Enum):
    """Where an alias family waits between its pack and its last use.

    Example:
        >>> Placement("cpu").moves, Placement.RECOMPUTE.moves
        (True, False)
    """

    KEEP = "keep"  # on the device
    CPU = "cpu"  # pinned host memory
    NVME = "nvme"  # a file, through pinned staging
    RECOMPUTE = "recompute"  # dropped; its module's forward runs again in backward
    REBUILD = "rebuild"  # dropped; rebuilt at its first unpack from its parent (rebuild_from)

    @property
    def moves(self) -> bool:
        """True for the placements whose bytes leave the device (CPU, NVME)."""
        return self in (Placement.CPU, Placement.NVME)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What a plan does with one alias family.

    Attributes:
        placement: where the family waits.
        reload_event: CPU / NVME only: the trace's event index (``Event.index``) at which the
            reload starts; ``-1`` leaves it to the default policy (see NOTE [ Reload policy ]
            in _simulate.py).
        recompute_module: RECOMPUTE only: the module whose forward call (the one running when the
            family was first packed) is run again; ``""`` means the family's own module. Families
            naming the same call form one unit, recomputed once.

    Raises:
        ValueError: a field that does not apply to ``placement`` is set, or has a wrong value.

    Example:
        >>> Decision(placement=Placement.CPU, reload_event=42).reload_event
        42
        >>> Decision(placement=Placement.RECOMPUTE, recompute_module="blocks.0").placement.value
        'recompute'
    """

    placement: Placement
    reload_event: int = -1
    recompute_module: str = ""

    def __post_init__(self) -> None:
        # A str ("cpu") is accepted too: plans read from JSON carry them.
        object.__setattr__(self, "placement", _as_placement(self.placement))
        event = self.reload_event
        if isinstance(event, bool) or not isinstance(event, int) or event < -1:
            raise ValueError(f"reload_event must be an event index >= 0, or -1; got {event!r}")
        if event != -1 and not self.placement.moves:
            raise ValueError(
                f"reload_event applies to placements 'cpu' and 'nvme' only; got placement "
                f"{self.placement.value!r} with reload_event={event}"
            )
        if not isinstance(self.recompute_module, str):
            raise ValueError(
                f"recompute_module must be a module path (str); got {self.recompute_module!r}"
            )
        if self.recompute_module and self.placement is not Placement.RECOMPUTE:
            raise ValueError(
                f"recompute_module applies to placement 'recompute' only; got placement "
                f"{self.placement.value!r} with recompute_module={self.recompute_module!r}"
            )


PlacementMap = Mapping[int, Placement | Decision | str]


def _as_placement(value: object) -> Placement:
    try:
        return Placement(value)
    except ValueError:
        raise ValueError(
            f"placement must be one of {[p.value for p in Placement]}; got {value!r}"
        ) from None
