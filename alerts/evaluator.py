"""The in-process evaluator: the rules of ``definitions.py`` over a run's metric history.

Semantics are Prometheus' own, counted in steps instead of seconds: a condition that first
holds at step ``s`` makes the alert pending; it fires at the first step ``t >= s + for_steps``
at which it still holds, and resolves at the first step it does not (a missing value counts as
"does not"). A condition with a clear test (the count, tail and k3 rules) resolves only when
that test passes, at the same confidence as the one that fired it (hysteresis); a step at
which its alert is pending or firing stays out of that rule's baseline. A rule with
``keep_firing_steps`` K stays firing K steps after its condition first stops holding and resolves
at the K-th (Prometheus ``keep_firing_for``); a condition back within them continues the same
firing. Only state changes are returned, so a resync callback runs once per firing.

    evaluator = AlertEvaluator()
    events = evaluator.observe(step, time.time(), metrics.report(stats, by=["pool"]))

After a restart, :meth:`AlertEvaluator.replay` rebuilds the state from the stored history.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Literal, Mapping

import numpy as np
import pandas as pd

from mismatch_monitor.metrics import GroupMetrics
from mismatch_monitor.label_text import label_text
from mismatch_monitor.report_keys import NULL_TEXT
from .conditions import Scope, Snapshot
from .counts import INACTIVE
from .coverage import Coverage
from .definitions import DEFAULT_RULES
from .history import TrailingValues
from .levels import expected_note, with_bounds, with_levels
from .resync import NUMERIC_NOTE, RELAPSE_NOTE, ResyncOutcome, ResyncPolicy
from .rules import AlertRule, Fix, Severity, check_rules
from .steps import _snapshot, iter_steps

# a resync whose pool's k3 falls below this share of its value at the request, at the next step,
# had an effect (the pool ran stale or wrong weights) even if its alert came back: a step's k3
# wobbles by about a factor e^0.5 on a clean pool, so a fourfold fall is not one step's noise
EFFECT_METRIC = "mismatch/k3_kl"
RESYNC_EFFECT = 0.25

# pools are named by their label text (report_keys.py), as the exporter labels their series, so
# an event's pool is the pool label Prometheus shows; rows logged without a pool are "%null"
UNKNOWN_POOL = NULL_TEXT
State = Literal["firing", "resolved"]


@dataclass(frozen=True)
class AlertEvent:
    """One state change of one alert (a rule, for one pool or the fleet)."""

    step: int
    wall_time: float
    alert: str
    severity: Severity
    pool: str | None          # the pool's label text (report_keys.parse_label_text reads the value
                              # back; "%null": rows without a pool); None for fleet-wide rules
    state: State
    value: float              # the alert's value at this step (its last value when resolved)
    threshold: float
    summary: str
    description: str
    runbook: str
    resync: bool              # this firing asks the trainer to resynchronise the pool
    fix: Fix
    since_step: int           # the step the condition started to hold

    def to_row(self) -> dict[str, Any]:
        """A flat, Parquet-friendly row for the run's ``alerts`` table."""
        return asdict(self)


@dataclass
class _Active:
    since: int
    value: float
    firing: bool = False
    clear_since: int | None = None    # held firing (keep_firing_steps) since this step, its condition clear


@dataclass
class _Watch:
    """A resync request being watched: its step, the alert that asked, the pool's k3 then and at
    the next observed step, and the step the alert fired again within the watch (if it did)."""

    step: int
    alert: str
    before: float
    after: float = math.nan
    refired: int | None = None


class AlertEvaluator:
    def __init__(self, rules: tuple[AlertRule, ...] = DEFAULT_RULES, *,
                 resync_policy: ResyncPolicy = ResyncPolicy(),
                 pools: Mapping[str, Mapping[str, object]] | None = None) -> None:
        """``pools``: pool label value -> the pool's metadata (``run.json``'s ``pools``, keyed as the
        collector was given them: precision, engine, max_staleness); a firing's summary then says how
        many times its pool's expected healthy level the metric is, and declared bounds are judged.
        The keys are turned into label texts here, as the exporter does (``a/b`` is pool ``a%2Fb``)."""
        rules = tuple(rules)
        check_rules(rules)
        self.rules = rules
        self.resync_policy = resync_policy
        # keyed by the pool's label value as given (run.json's keys); the snapshots name pools by label text
        self.pools = {label_text(str(k)): dict(v) for k, v in (pools or {}).items()}
        self._values: dict[str, dict[str, float]] = {}   # pool -> metric -> value at the last step
        windows: dict[tuple[str, Scope], int] = {}
        for rule in rules:
            for key, w in rule.condition.windows.items():
                windows[(key, rule.scope)] = max(w, windows.get((key, rule.scope), 0))
        self._history = TrailingValues(windows)
        self._keys = {scope: sorted({k for r in rules if r.scope == scope for k in r.condition.metrics})
                      for scope in ("pool", "fleet")}
        if any(r.resync for r in rules) and EFFECT_METRIC not in self._keys["pool"]:   # what a resync did
            self._keys["pool"] = sorted(self._keys["pool"] + [EFFECT_METRIC])
        # metrics whose per-pool expected levels / declared bounds the pool rules read
        self._levels, self._bounds = (tuple(sorted({k for r in rules if r.scope == "pool"
                                                    for k in getattr(r.condition, attr, ())}))
                                      for attr in ("levels", "bounds"))
        self._active: dict[tuple[str, str | None], _Active] = {}
        # per (rule, pool): pool-steps observed, without input, undecided ("not enough tokens")
        self._coverage = Coverage()
        self._last_resync: dict[str | None, int] = {}
        self._watching: dict[str | None, _Watch] = {}     # pool -> its watched resync request
        self._held = frozenset(r.name for r in rules if r.keep_firing_steps)
        self._outcomes: list[ResyncOutcome] = []
        self._ineffective: dict[str | None, ResyncOutcome] = {}
        self._relapsed: dict[str | None, ResyncOutcome] = {}   # pool -> the last resync that did not hold
        self._repeats: list[AlertEvent] = []   # the last step's resyncs asked by held alerts (a relapse)
        self._last_step: int | None = None

    def set_pools(self, pools: Mapping[str, Mapping[str, object]] | None) -> None:
        """The collector's pools (what it writes to ``run.json``): a pool this evaluator was not
        given is judged by them; one it was given with other metadata is refused, so a firing never
        judges a pool by a declaration the run does not record."""
        for key, meta in (pools or {}).items():
            label, meta = label_text(str(key)), dict(meta)
            if self.pools.setdefault(label, meta) != meta:
                raise ValueError(f"pool {key!r}: the alert evaluator was given {self.pools[label]!r}, the "
                                 f"collector {meta!r}; pass the pools once (to the collector)")

    # ------------------------------------------------------------------ one step
    def observe(self, step: int, wall_time: float, by_pool: pd.DataFrame | GroupMetrics, *,
                fleet: pd.DataFrame | GroupMetrics | None = None) -> list[AlertEvent]:
        """Evaluate every rule on one step's metrics; returns the alerts that fired or resolved.

        ``by_pool``: ``metrics.report(stats, by=["pool"])`` (one row per pool, NaN = no
        observation) or the first of ``metrics.report_by_label(stats, "pool")``; ``fleet``:
        ``metrics.report(stats)`` or the second, read by fleet-scoped rules only.
        """
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            self._history.rewind(step)
        self._last_step = step
        pooled = _snapshot(by_pool, self._keys["pool"], pooled=True)
        snapshots = {"pool": with_bounds(with_levels(pooled, self._levels, self.pools), self._bounds, self.pools),
                     "fleet": _snapshot(fleet, self._keys["fleet"], pooled=False)}
        now = snapshots["pool"]
        self._values = {p: {k: float(v[i]) for k, v in now.values.items()} for i, p in enumerate(now.pools)}
        events: list[AlertEvent] = []
        requested: set[str | None] = set()
        self._repeats = []
        self._coverage.start_step()
        for rule in self.rules:
            now = snapshots[rule.scope]
            values = rule.condition.evaluate(now, self._history, rule.scope, step)
            self._coverage.count(rule, now, self._history, rule.scope, step,
                                 [_pool(p, rule.scope) for p in now.pools], values)
            holding = {_pool(p, rule.scope): float(v) for p, v in zip(now.pools, values) if not np.isnan(v)}
            holding.update(self._still_firing(rule, now, step, holding))
            for pool, value in holding.items():
                state = self._active.get((rule.name, pool))
                if state is None:
                    state = self._active[(rule.name, pool)] = _Active(since=step, value=value)
                elif state.clear_since is not None:   # back while held firing: the same firing goes on
                    state.clear_since = None
                    if self._relapse(rule, pool, step, state) and self._may_resync(rule, pool, step, requested):
                        self._repeats.append(self._event(rule, pool, "firing", step, wall_time, state, True, note=True))
                state.value = value
                if not state.firing and step - state.since >= rule.for_steps:
                    state.firing = True
                    watch = self._watching.get(pool)
                    if watch is not None and watch.alert == rule.name and watch.refired is None:
                        watch.refired = step     # fired again while its resync is watched
                    resync = rule.resync and self._may_resync(rule, pool, step, requested)
                    events.append(self._event(rule, pool, "firing", step, wall_time, state, resync, note=True))
            for (name, pool) in [k for k in self._active if k[0] == rule.name and k[1] not in holding]:
                state = self._active[(name, pool)]
                if state.firing and rule.keep_firing_steps:
                    state.clear_since = step if state.clear_since is None else state.clear_since
                    if step - state.clear_since < rule.keep_firing_steps:
                        continue
                del self._active[(name, pool)]
                if state.firing:
                    events.append(self._event(rule, pool, "resolved", step, wall_time, state, False))
                    if pool in self._relapsed and self._relapsed[pool].alert == rule.name:
                        del self._relapsed[pool]   # caught up and stayed so: its pipeline works again
        self._check_resyncs(step)
        for scope, now in snapshots.items():
            derived = _with_derived(now, self.rules, scope, set(self._active))   # after this step
            self._history.push(scope, step, derived)  # type: ignore[arg-type]
        return events

    def _still_firing(self, rule: AlertRule, now: Snapshot, step: int, holding: dict[str | None, float]
                      ) -> dict[str | None, float]:
        """Hysteresis: a firing alert whose condition has a clear test stays firing while its
        statistic is observed and the test does not say the condition cleared."""
        clears = getattr(rule.condition, "clears", None)
        if clears is None or not now.pools:
            return {}
        statistic = rule.condition.statistic(now, self._history, rule.scope, step)
        cleared = clears(now, self._history, rule.scope, step)
        out = {}
        for label, value, clear in zip(now.pools, statistic, cleared):
            pool = _pool(label, rule.scope)
            state = self._active.get((rule.name, pool))
            if pool not in holding and state is not None and state.firing and not np.isnan(value) and not clear:
                out[pool] = float(value)
        return out

    def undecided(self) -> list[tuple[str, str | None]]:
        """(alert, pool) pairs the last step could not decide: "not enough tokens" (too small a
        pool, or too short a baseline, for a rise by the rule's factor to be significant) and the
        rule did not fire; they are not a healthy verdict either."""
        return list(self._coverage.undecided_now)

    def undecided_counts(self) -> dict[tuple[str, str | None], int]:
        """Per (alert, pool): how many observed steps were undecided, over the evaluator's life."""
        return self._coverage.undecided_counts()

    @property
    def last_step(self) -> int | None:
        """The last step observed (replayed ones included); None before the first."""
        return self._last_step

    def coverage(self) -> list[dict[str, Any]]:
        """Per (alert, pool) seen, over the evaluator's life: observed ``steps``, steps with
        ``no_input`` (no watched metric, expected level or declared bound) and ``undecided`` ones
        (``coverage.py``); the rule judged the rest. Pools by label text, None: the fleet."""
        return self._coverage.rows()

    def _may_resync(self, rule: AlertRule, pool: str | None, step: int, requested: set[str | None]) -> bool:
        last = self._last_resync.get(pool)
        # one request in flight per pool: a second alert asking while the first is watched adds nothing
        if pool in requested or pool in self._ineffective or pool in self._watching or (
                last is not None and step - last < self.resync_policy.cooldown_steps):
            return False
        requested.add(pool)
        self._last_resync[pool] = step
        if self.resync_policy.watch_steps:
            self._watching[pool] = _Watch(step, rule.name, self._values.get(pool, {}).get(EFFECT_METRIC, math.nan))
        return True

    def _relapse(self, rule: AlertRule, pool: str | None, step: int, state: _Active) -> bool:
        """The condition of a held firing came back. True when the resync this firing asked last
        had cleared it: that resync did not hold (lag again: one more resync helps, for a while)."""
        for i in range(len(self._outcomes) - 1, -1, -1):
            outcome = self._outcomes[i]
            if outcome.pool == pool and outcome.alert == rule.name and outcome.requested_step >= state.since:
                if outcome.helped and outcome.relapsed_step is None:
                    self._outcomes[i] = self._relapsed[pool] = replace(outcome, relapsed_step=step)
                    return True
                return False
        return False

    def repeat_requests(self) -> list[AlertEvent]:
        """The resyncs the last step asked for without a state change: a held firing (a rule with
        ``keep_firing_steps``) whose pool fell behind again after the resync it asked. Each is the
        alert as firing, ``resync=True``, its description naming the resync that did not hold; it
        is not a new firing (the alerts table does not store it), the run's events do."""
        return list(self._repeats)

    def _check_resyncs(self, step: int) -> None:
        """Decide each watched request. A rule held by ``keep_firing_steps`` (exact bookkeeping:
        staleness) is helped at the first step its condition clears (a relapse is then lag again);
        any other at the end of the watch: helped when its alert is not firing then and did not
        fire again since (one quiet step of a statistical rule is not a fix)."""
        for pool, watch in list(self._watching.items()):
            if step > watch.step and math.isnan(watch.after):
                watch.after = self._values.get(pool, {}).get(EFFECT_METRIC, math.nan)
            state = self._active.get((watch.alert, pool))
            firing = state is not None and state.firing and state.clear_since is None
            held = watch.alert in self._held
            if step - watch.step < self.resync_policy.watch_steps and (firing or not held):
                continue
            helped, relapsed = not firing and watch.refired is None, None
            if not helped and not held and watch.after < RESYNC_EFFECT * watch.before:
                # the pool's k3 fell fourfold at the step after the resync: it fixed the pool, and
                # the fault came back (weights that go wrong again at each sync), not a numeric one
                helped, relapsed = True, watch.refired if watch.refired is not None else step
            outcome = ResyncOutcome(pool, watch.alert, watch.step, step, helped=helped, relapsed_step=relapsed)
            self._outcomes.append(outcome)
            del self._watching[pool]
            if not outcome.helped:
                self._ineffective[pool] = outcome

    def resync_outcomes(self) -> list[ResyncOutcome]:
        """Every decided resync request, in order (benchmarks report whether each helped)."""
        return list(self._outcomes)

    def _event(self, rule: AlertRule, pool: str | None, state: State, step: int, wall_time: float,
               active: _Active, resync: bool, note: bool = False) -> AlertEvent:
        description = rule.text("description", pool, active.value)
        futile = self._ineffective.get(pool)
        if note and rule.resync and state == "firing" and futile is not None:
            description += NUMERIC_NOTE.format(pool=pool, step=futile.requested_step, alert=futile.alert,
                                               watch=self.resync_policy.watch_steps)
        stuck = self._relapsed.get(pool)
        if note and rule.resync and state == "firing" and stuck is not None:
            description += RELAPSE_NOTE.format(pool=pool, step=stuck.requested_step, alert=stuck.alert,
                                               relapse=stuck.relapsed_step)
        return AlertEvent(
            step=step, wall_time=float(wall_time), alert=rule.name, severity=rule.severity, pool=pool,
            state=state, value=active.value, threshold=rule.threshold,
            summary=rule.text("summary", pool, active.value) + (
                expected_note(rule, pool, self.pools, self._values.get(pool, {})) if state == "firing" else ""),
            description=description,
            runbook=rule.text("runbook", pool, active.value), resync=resync, fix=rule.fix,
            since_step=active.since)

    def firing(self) -> list[AlertEvent]:
        """The alerts firing after the last observed step, with their current values."""
        step = -1 if self._last_step is None else self._last_step
        by_name = {r.name: r for r in self.rules}
        return [self._event(by_name[name], pool, "firing", step, math.nan, state, False)
                for (name, pool), state in self._active.items() if state.firing]

    # ------------------------------------------------------------------ history
    @classmethod
    def replay(cls, history: pd.DataFrame, *, rules: tuple[AlertRule, ...] = DEFAULT_RULES,
               fleet_history: pd.DataFrame | None = None, steps: Iterable[int] = (),
               resync_policy: ResyncPolicy = ResyncPolicy(), pools: Mapping[str, Mapping[str, object]] | None = None
               ) -> tuple["AlertEvaluator", list[AlertEvent]]:
        """Rebuild an evaluator from a metric history and return it with every event it emitted.

        ``history``: columns ``step``, ``pool``, metric keys and optionally ``wall_time``, one row
        per (step, pool), as ``query.metric_series(con, run_dir, ["pool"])`` returns it;
        ``fleet_history``: the same without ``pool``, for fleet-scoped rules; ``steps``: steps
        logged without any observation (``query.steps_index``), which resolve what was firing.
        """
        evaluator = cls(rules, resync_policy=resync_policy, pools=pools)
        events: list[AlertEvent] = []
        for step, by_pool, fleet in iter_steps(history, fleet_history, steps):
            wall = float(by_pool["wall_time"].iloc[0]) if "wall_time" in by_pool and len(by_pool) else math.nan
            events += evaluator.observe(step, wall, by_pool, fleet=fleet)
        return evaluator, events


def _with_derived(now: Snapshot, rules: tuple[AlertRule, ...], scope: Scope,
                  active: set[tuple[str, str | None]]) -> Snapshot:
    """The snapshot plus the per-step series the rules' baselines sum (their recording rules);
    a rule that ``excludes_active`` keeps a pool's step out of them while its alert for that pool
    is pending or firing (as ``unless on(pool) ALERTS{...}`` does in the rules file)."""
    values = dict(now.values)
    for rule in rules:
        derive = getattr(rule.condition, "derived", None)
        if rule.scope != scope or derive is None or not now.pools:
            continue
        series = derive(now, scope)
        values.update(series)
        if getattr(rule.condition, "excludes_active", False):
            mask = np.array([(rule.name, _pool(p, scope)) in active for p in now.pools])
            values.update({k + INACTIVE: np.where(mask, np.nan, v) for k, v in series.items()})
    return Snapshot(now.pools, values)


def _pool(label: str, scope: Scope) -> str | None:
    return None if scope == "fleet" else label
