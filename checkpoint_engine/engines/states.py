"""The managed engine's lifecycle states and their pure transition table (no processes here).

stopped ──start──▶ starting ──first update──▶ updating ──ok──▶ serving ──update──▶ updating ...
                      │  (dummy weights: never       │ error                 │
                      │   reported as serving)       ▼                       │
                      │                          incomplete ──update──▶ updating
     any live state ──process exited──▶ failed ──restart (heal)──▶ starting
     any state ──stop──▶ stopped
     serving ──sleep──▶ sleeping ──wake, level 1──▶ serving (its weights were kept in host memory)
                           └──────wake, level 2──▶ incomplete ──update──▶ updating (weights were dropped)
"""

from __future__ import annotations

from typing import Literal, get_args

EngineState = Literal["starting", "serving", "updating", "incomplete", "sleeping", "stopped", "failed"]
STATES: tuple[str, ...] = get_args(EngineState)

# Allowed transitions. An engine serves only after a complete update: starting never goes to serving.
TRANSITIONS: dict[str, frozenset[str]] = {
    "stopped": frozenset({"starting"}),
    "starting": frozenset({"updating", "failed", "stopped"}),
    "updating": frozenset({"serving", "incomplete", "failed", "stopped"}),
    "serving": frozenset({"updating", "sleeping", "failed", "stopped"}),
    "incomplete": frozenset({"updating", "failed", "stopped"}),
    "sleeping": frozenset({"serving", "incomplete", "failed", "stopped"}),
    "failed": frozenset({"starting", "stopped"}),
}
UPDATABLE: frozenset[str] = frozenset({"starting", "serving", "incomplete"})  # healthy processes
STARTABLE: frozenset[str] = frozenset({"stopped", "failed"})
SLEEPABLE: frozenset[str] = frozenset({"serving"})
SLEEP_LEVELS: tuple[int, ...] = (1, 2)  # vLLM's: 1 keeps the weights in host memory, 2 drops them


class TransitionError(ValueError):
    """An engine state change the table does not allow."""


def check_transition(old: str, new: str) -> None:
    """Raise TransitionError unless `old -> new` is in the table (both must be known states)."""
    for s in (old, new):
        if s not in TRANSITIONS:
            raise TransitionError(f"unknown engine state {s!r}; known: {list(STATES)}")
    if new not in TRANSITIONS[old]:
        raise TransitionError(
            f"illegal engine state transition {old} -> {new}; "
            f"from {old} the engine may go to {sorted(TRANSITIONS[old])}"
        )
