"""Resync only where it helps: the policy for resync requests and the record of what followed.

A resync fixes policy lag (stale or unapplied weights); it cannot fix a numeric discrepancy (a
precision, a kernel, an LM head). The evaluator watches each request: if the alert that asked
is firing ``watch_steps`` steps later, or resolved and fired again within them, and the pool's
k3 did not fall fourfold at the step after the resync, the fault looks numeric and no resync is
asked for that pool again (a fourfold fall is an effect: the resync fixed the pool and its fault
came back); its later firings say so and name the fix that applies instead. A request whose
alert's condition cleared but came back while the alert was still held firing (a rule with
``keep_firing_steps``: the pool fell behind again within steps of its resync) helped but did not
hold: it is lag again, so the same firing asks for one more resync (``repeat_requests``), and says
that the pool's sync path keeps failing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NUMERIC_NOTE", "RELAPSE_NOTE", "ResyncOutcome", "ResyncPolicy"]


@dataclass(frozen=True)
class ResyncPolicy:
    """When a firing resync alert asks for a resync: at most once per pool and step, not while
    an earlier request for the pool is still watched, and not again within ``cooldown_steps``
    steps of the previous request for that pool. A request whose
    alert is firing ``watch_steps`` steps later, or fired again within them, did not help: the fault looks numeric, not
    lag, and no resync is asked for that pool again (its later firings say so and which fix
    applies instead). ``watch_steps=0`` keeps asking."""

    cooldown_steps: int = 0
    watch_steps: int = 3

    def __post_init__(self) -> None:
        if not (isinstance(self.cooldown_steps, int) and self.cooldown_steps >= 0):
            raise ValueError(f"expected integer cooldown_steps >= 0, got {self.cooldown_steps!r}")
        if not (isinstance(self.watch_steps, int) and self.watch_steps >= 0):
            raise ValueError(f"expected integer watch_steps >= 0, got {self.watch_steps!r}")


@dataclass(frozen=True)
class ResyncOutcome:
    """A resync request and what followed: ``helped`` when its alert was quiet at the end of the
    policy's ``watch_steps`` and did not fire again before (a rule held by ``keep_firing_steps``:
    when its condition first cleared; ``checked_step``: the step that decided); ``relapsed_step``: the
    step the condition came back while the alert was still held firing (the resync did not hold)."""

    pool: str | None
    alert: str
    requested_step: int
    checked_step: int
    helped: bool
    relapsed_step: int | None = None


NUMERIC_NOTE = (" A resync of {pool} at step {step} ({alert}) did not clear it within {watch} steps: the "
                "fault looks numeric, not lag, so no further resync is asked for this pool. Fix it at the source "
                "(FP32 LM head, matched precision, batch-invariant kernels) or correct it per pool (a tighter "
                "cap) instead.")

RELAPSE_NOTE = (" A resync of {pool} at step {step} cleared {alert}, but the pool fell behind again at step "
                "{relapse}: its weight sync keeps failing and each resync holds only until the next failed sync. "
                "The alert stays firing and asks for a resync each time this repeats; fix the sync path (the "
                "engine's weight-update call and its result, a worker that stopped taking updates).")
