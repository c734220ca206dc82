"""Budget mode's per-signature state machine (NOTE [ Signature states ] in offload/_budget.py):
every state and every legal transition is reachable from a new signature, and an illegal
transition raises, naming the signature, its state and the states it may move to."""

from __future__ import annotations

import pytest

from offload import OffloadError
from offload._budget import _NEXT, SignatureStates, SigState


def _paths() -> dict[SigState, list[SigState]]:
    """For each state reachable from NEW, a shortest path of states to it."""
    paths = {SigState.NEW: [SigState.NEW]}
    todo = [SigState.NEW]
    while todo:
        here = todo.pop(0)
        for nxt in sorted(_NEXT[here], key=lambda s: s.value):
            if nxt not in paths:
                paths[nxt] = [*paths[here], nxt]
                todo.append(nxt)
    return paths


def _walk(states: SignatureStates, sig: str, path: list[SigState]) -> None:
    for state in path[1:]:
        states.to(sig, state)
    assert states.get(sig) is path[-1]


def test_every_state_is_reachable_from_a_new_signature() -> None:
    assert set(_paths()) == set(SigState)


@pytest.mark.parametrize(
    ("old", "new"),
    sorted(((a, b) for a, nexts in _NEXT.items() for b in nexts), key=lambda t: str(t)),
    ids=lambda s: s.value,
)
def test_every_legal_transition_is_taken(old: SigState, new: SigState) -> None:
    states = SignatureStates()
    _walk(states, "sig", _paths()[old])
    states.to("sig", new)
    assert states.get("sig") is new
    assert states.any(new) == (new is not SigState.NEW)


def test_an_illegal_transition_raises_naming_the_signature_and_its_next_states() -> None:
    states = SignatureStates()
    _walk(states, "float32[8,32]", _paths()[SigState.GIVEN])
    with pytest.raises(OffloadError, match=r"'float32\[8,32\]'.*given -> profiling.*none"):
        states.to("float32[8,32]", SigState.PROFILING)
    assert states.get("float32[8,32]") is SigState.GIVEN  # unchanged
    with pytest.raises(OffloadError, match=r"new -> timed.*\['given', 'profiling'"):
        states.to("other", SigState.TIMED)


def test_a_renamed_recording_keeps_its_state_and_forgetting_is_a_move_to_new() -> None:
    states = SignatureStates()
    states.to("s [structure ?]", SigState.PROFILING)
    states.rename("s [structure ?]", "s [structure 2]")
    assert states.get("s [structure ?]") is SigState.NEW
    assert states.get("s [structure 2]") is SigState.PROFILING
    states.forget("s [structure 2]")
    assert not states.any(SigState.PROFILING)
