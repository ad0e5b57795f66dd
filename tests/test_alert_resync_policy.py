"""Resync only where it helps: a resync whose alert does not clear within the watch stops the
requests for that pool and says the fault looks numeric; one that clears keeps them. Runtime: 1 s."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mismatch_monitor.alerts import AlertEvaluator, ResyncPolicy
from mismatch_monitor.alerts.definitions import LOW_ESS


def history(low: dict[str, set[int]], steps: int = 40) -> pd.DataFrame:
    rows = [{"step": s, "pool": p, "mismatch/ess": 0.3 if s in bad else 0.95} for s in range(steps)
            for p, bad in low.items()]
    return pd.DataFrame(rows)


def firings(events, pool):
    return [(e.step, e.resync, "looks numeric" in e.description) for e in events
            if e.pool == pool and e.state == "firing"]


def test_a_resync_that_does_not_clear_the_alert_is_not_asked_again():
    numeric = set(range(5, 20)) | set(range(30, 35))     # a precision fault: resyncs change nothing
    lag = set(range(5, 7)) | set(range(30, 32))          # lag: the resync clears it at once
    evaluator, events = AlertEvaluator.replay(history({"fp8": numeric, "async": lag}), rules=(LOW_ESS,))
    assert firings(events, "fp8") == [(6, True, False), (31, False, True)]
    assert firings(events, "async") == [(6, True, False), (31, True, False)]
    outcomes = [(o.pool, o.requested_step, o.checked_step, o.helped) for o in evaluator.resync_outcomes()]
    # decided at the end of the watch (step 6 + 3): a statistical rule's quiet step is not a fix yet
    assert ("fp8", 6, 9, False) in outcomes and ("async", 6, 9, True) in outcomes
    numeric_note = next(e.description for e in events if e.pool == "fp8" and e.step == 31)
    assert "at step 6" in numeric_note and "FP32 LM head" in numeric_note


def test_watch_steps_zero_keeps_asking():
    numeric = set(range(5, 20)) | set(range(30, 35))
    _, events = AlertEvaluator.replay(history({"fp8": numeric}), rules=(LOW_ESS,),
                                      resync_policy=ResyncPolicy(watch_steps=0))
    assert [e.resync for e in events if e.state == "firing"] == [True, True]
    assert np.all(["looks numeric" not in e.description for e in events])


def test_an_alert_that_fires_again_within_the_watch_was_not_helped():
    """Resolved one step after its resync, firing again two steps later: the resync did not help
    (noise let it resolve), so the second firing asks none and the third says it looks numeric."""
    flapping = {5, 6} | set(range(8, 14)) | set(range(30, 33))
    evaluator, events = AlertEvaluator.replay(history({"fp8": flapping}), rules=(LOW_ESS,))
    assert firings(events, "fp8") == [(6, True, False), (9, False, False), (31, False, True)]
    assert [(o.requested_step, o.checked_step, o.helped) for o in evaluator.resync_outcomes()] == [(6, 9, False)]


def test_a_resync_that_fixed_the_pool_before_its_fault_came_back_helped():
    """The same flapping alert, but the pool's k3 fell 50-fold at the step after the resync (its
    weights were wrong and the resync loaded the right ones; the next sync spoiled them again):
    the resync had an effect, so the pool is not called numeric and is resynced again later. With
    k3 unchanged by the resync, the same firings are judged no effect."""
    flapping = {5, 6} | set(range(8, 14)) | set(range(30, 33))
    fixed = history({"fp8": flapping}).assign(**{"mismatch/k3_kl": lambda d: np.where(d["step"] == 7, 1e-3, 5e-2)})
    evaluator, events = AlertEvaluator.replay(fixed, rules=(LOW_ESS,))
    assert firings(events, "fp8") == [(6, True, False), (9, False, False), (31, True, False)]
    assert [(o.requested_step, o.checked_step, o.helped, o.relapsed_step)
            for o in evaluator.resync_outcomes()][0] == (6, 9, True, 9)
    unchanged = fixed.assign(**{"mismatch/k3_kl": 5e-2})
    evaluator, events = AlertEvaluator.replay(unchanged, rules=(LOW_ESS,))
    assert firings(events, "fp8") == [(6, True, False), (9, False, False), (31, False, True)]
