"""run.json's ``alerting`` record: what evaluated the run's alerts in process, and what each rule
could judge, so that a run without alert events says whether that means "healthy" or "not looked at".

    "alerting": {"evaluator": "mismatch_monitor.alerts.AlertEvaluator",   # null: alert_evaluator=None
                 "rules": ["MismatchTailGrowth", ...],    # null: an evaluator that does not list them
                 "through_step": 119,                     # the last step the coverage counts include
                 "coverage": [{"alert": ..., "pool": ..., "steps": 120, "no_input": 0,
                               "undecided": 120, "missing": null}, ...]}   # null: not counted

``coverage`` is ``AlertEvaluator.coverage()`` (``alerts/coverage.py``): per (alert, pool) by label
text (null: the fleet), the pool-steps observed, those without input (no watched metric, expected
level or declared bound; ``missing`` names which, e.g. ``"expected level of
mismatch/abs_log_ratio/p99"``) and those undecided (too few tokens or decisions for the rule's test); the rule
judged the rest. The collector writes the record when it opens the run, every few seconds of
steps and when it closes. A run.json without it was written before the record existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

ALERTING_KEY = "alerting"
COVERAGE_COLUMNS = ["alert", "pool", "steps", "no_input", "undecided", "missing"]
PROMETHEUS_NOTE = ("Prometheus evaluates the same rules from `alerts/mismatch_rules.yml` on the exported "
                   "series; its firings reach Alertmanager, not this run.")


@dataclass(frozen=True)
class Alerting:
    evaluator: str | None
    rules: tuple[str, ...] | None
    through_step: int | None
    coverage: pd.DataFrame | None   # COVERAGE_COLUMNS + judged

    @property
    def short_name(self) -> str:
        return (self.evaluator or "").rsplit(".", 1)[-1]


def read_alerting(info: Mapping[str, Any]) -> Alerting | None:
    """The record of ``info`` (run.json's content); None where it has none."""
    record = info.get(ALERTING_KEY)
    if not isinstance(record, Mapping):
        return None
    rules = record.get("rules")
    rows = record.get("coverage")
    coverage = None
    if isinstance(rows, list):
        coverage = pd.DataFrame([{c: r.get(c) for c in COVERAGE_COLUMNS} for r in rows if isinstance(r, Mapping)],
                                columns=COVERAGE_COLUMNS)
        for c in ("steps", "no_input", "undecided"):
            coverage[c] = pd.to_numeric(coverage[c], errors="coerce").fillna(0).astype("int64")
        coverage["judged"] = coverage["steps"] - coverage["no_input"] - coverage["undecided"]
    through = record.get("through_step")
    return Alerting(evaluator=record.get("evaluator"),
                    rules=None if rules is None else tuple(str(r) for r in rules),
                    through_step=None if through is None else int(through), coverage=coverage)


def never_judged(alerting: Alerting) -> pd.DataFrame:
    """Rules that judged no step of any pool they saw: ``alert``, ``pools``, ``steps``, ``why``
    (the larger of the two reasons), in rule order."""
    cov = alerting.coverage
    if cov is None or cov.empty:
        return pd.DataFrame(columns=["alert", "pools", "steps", "why"])
    per = cov.groupby("alert", sort=False).agg(
        pools=("pool", "size"), steps=("steps", "sum"), judged=("judged", "sum"), no_input=("no_input", "sum"),
        undecided=("undecided", "sum"),
        missing=("missing", lambda m: m.dropna().mode().iloc[0] if m.notna().any() else None)).reset_index()
    per = per[(per["judged"] == 0) & (per["steps"] > 0)].copy()
    per["why"] = ["too small a sample for its test" if u >= n else f"no {m or 'input'}"
                  for u, n, m in zip(per["undecided"], per["no_input"], per["missing"])]
    order = {name: i for i, name in enumerate(alerting.rules or ())}
    per = per.sort_values("alert", key=lambda s: s.map(lambda a: order.get(a, len(order))), kind="stable")
    return per[["alert", "pools", "steps", "why"]].reset_index(drop=True)


def coverage_line(alerting: Alerting) -> str:
    """One sentence: how many rules judged every pool on every step, and which judged nothing."""
    cov = alerting.coverage
    if cov is None:
        return f"The evaluator {alerting.short_name} does not count which steps its rules could judge."
    if cov.empty:
        return "No step has been evaluated yet."
    through = "" if alerting.through_step is None else f" (through step {alerting.through_step})"
    per = cov.groupby("alert")[["judged", "steps"]].sum()
    full = int((per["judged"] == per["steps"]).sum())
    blind = never_judged(alerting)
    text = f"{full} of {len(per)} rules judged every pool on every observed step{through}."
    if len(blind):
        text += (f" {len(blind)} judged none: " + ", ".join(f"{a} ({why})" for a, why in zip(blind["alert"],
                                                                                          blind["why"])) + ".")
    return text


def evaluation_note(alerting: Alerting | None) -> str:
    """What judged the run's alerts, as its run.json records it: the words after "No alert event"."""
    if alerting is None:
        return ("This run's run.json does not record whether its collector evaluated alerts (it was written "
                "before that was recorded). " + PROMETHEUS_NOTE)
    if alerting.evaluator is None:
        return ("This run's collector had no alert evaluator (`alert_evaluator=None`): nothing in it was judged. "
                + PROMETHEUS_NOTE)
    n = "its" if alerting.rules is None else f"{len(alerting.rules)}"
    return f"The collector evaluated {n} rules ({alerting.short_name}). " + coverage_line(alerting)


def judged_everything(alerting: Alerting | None) -> bool:
    """True when an evaluator's every rule judged at least one step: a quiet run then means healthy."""
    return (alerting is not None and alerting.evaluator is not None and alerting.coverage is not None
            and not alerting.coverage.empty and never_judged(alerting).empty)
