"""Render the alert definitions to a Prometheus rules file (and a table for the docs).

    mismatch-monitor alerts render --step-seconds 60 > mismatch_rules.yml

Group ``mismatch-monitor`` holds the recording rules the alerts read (trailing medians, pool
medians) followed by the alerts: rules of one group run in order at the same timestamp, so an
alert always reads the recording rules of its own evaluation. Group ``mismatch-monitor-rates``
records ratios of counters over a rate window, the one correct way to aggregate them across
cells, ranks and exporters (sum the numerator and the denominator, then divide).

Hysteresis uses the classic self-reference to ``ALERTS`` (the series Prometheus writes for every
pending and firing alert, read at the next evaluation): ``(enter) or on(pool) (statistic and
on(pool) ALERTS{alertstate="firing"} unless on(pool) (clear))``, and a rule's baseline series
record a step only ``unless on(pool) ALERTS{alertname=...}``.

Compatible with Prometheus 2.42: no ``query_offset``, no group ``labels`` (``keep_firing_for``
came in 2.42 and is used).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mismatch_monitor.exporter import COUNTER_BY_FIELD, HISTOGRAM
from mismatch_monitor.formulas import promql
from mismatch_monitor.metric_defs import counter_ratios

from .counts import INACTIVE
from .promql import Recording, duration
from .definitions import DEFAULT_RULES
from .levels import note_template
from .rules import AlertRule, check_rules
from .yaml_text import dump

ALERT_GROUP = "mismatch-monitor"
RATE_GROUP = "mismatch-monitor-rates"
DEFAULT_STEP_SECONDS = 60.0
RULES_FILE = Path(__file__).with_name("mismatch_rules.yml")
RULES_TEST_FILE = Path(__file__).with_name("mismatch_rules_test.yml")
ALERTMANAGER_EXAMPLE = Path(__file__).with_name("alertmanager.example.yml")

# (numerator field, metric) of each recorded ratio of counters: the metrics declared with
# counters=True whose formula is a ratio (metric_defs.py)
RATIOS = counter_ratios()
SHARES: tuple[str, ...] = ("n_tokens", "n_extreme")   # a pool's share of the fleet's count


def _on(rule: AlertRule) -> str:
    return "on(pool)" if rule.scope == "pool" else "on()"


def alert_expr(rule: AlertRule, step_seconds: float) -> tuple[str, tuple[Recording, ...]]:
    """The alert's expression; with a clear test, a firing alert (its ``ALERTS`` series from the
    previous evaluation) stays while its statistic is there and the clear test is not."""
    expression = rule.condition.promql(rule.scope, step_seconds)
    if not expression.clear:
        return expression.expr, expression.recordings
    on = _on(rule)
    firing = f'ALERTS{{alertname="{rule.name}",alertstate="firing"}}'
    return (f"({expression.expr}) or {on} (({expression.statistic}) and {on} {firing} "
            f"unless {on} ({expression.clear}))"), expression.recordings


def excluded_while_active(rules: tuple[AlertRule, ...]) -> dict[str, tuple[str, str]]:
    """Recording name -> (matcher, alert regex) of the baseline series a step enters only while
    the rules reading it are inactive (``ALERTS`` of any state, from the previous evaluation)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for rule in rules:
        if not getattr(rule.condition, "excludes_active", False):
            continue
        for name in rule.condition.windows:
            if name.endswith(INACTIVE):
                record = name.removesuffix(INACTIVE).replace("pool:", f"{rule.scope}:", 1)
                out.setdefault(record, (_on(rule), []))[1].append(rule.name)
    return {k: (on, "|".join(sorted(names))) for k, (on, names) in out.items()}


def alert_rule(rule: AlertRule, step_seconds: float) -> tuple[dict[str, Any], tuple[Recording, ...]]:
    expr, recordings = alert_expr(rule, step_seconds)
    out: dict[str, Any] = {"alert": rule.name, "expr": expr}
    if rule.for_steps:
        out["for"] = duration(rule.for_steps * step_seconds)
    if rule.keep_firing_steps:
        out["keep_firing_for"] = duration(rule.keep_firing_steps * step_seconds)
    out["labels"] = rule.labels
    out["annotations"] = {f: rule.template(f) for f in ("summary", "description", "runbook")}
    out["annotations"]["summary"] += note_template(rule)   # "x times its expected healthy level"
    return out, recordings


def rate_rules(rate_window: str = "5m") -> list[dict[str, str]]:
    if not re.fullmatch(r"[0-9]+(ms|s|m|h)", rate_window):
        raise ValueError(f"expected a rate window such as '5m', got {rate_window!r}")
    suffix = f"rate{rate_window}"

    def rate(field: str) -> str:
        return f"rate({COUNTER_BY_FIELD[field].name}_total[{rate_window}])"

    out: list[dict[str, str]] = []
    for num, metric in RATIOS:
        name = COUNTER_BY_FIELD[num].name
        for level, by in (("pool", "sum by (pool) "), ("hardware", "sum by (hardware) "), ("fleet", "sum ")):
            series = {f: f"{by}({rate(f)})" for f in metric.formula.fields()}
            out.append({"record": f"{level}:{name}:ratio_{suffix}", "expr": promql(metric.formula, series)})
    for field in SHARES:
        name = COUNTER_BY_FIELD[field].name
        out.append({"record": f"pool:{name}:fleet_share_{suffix}",
                    "expr": f"sum by (pool) ({rate(field)}) / ignoring(pool) group_left() sum({rate(field)})"})
    for level, by in (("pool", "pool, le"), ("fleet", "le")):
        out.append({"record": f"{level}:{HISTOGRAM}:p99_{suffix}",
                    "expr": f"histogram_quantile(0.99, sum by ({by}) (rate({HISTOGRAM}_bucket[{rate_window}])))"})
    return out


def rules_document(rules: tuple[AlertRule, ...] = DEFAULT_RULES, *,
                   step_seconds: float = DEFAULT_STEP_SECONDS, rate_window: str = "5m") -> dict[str, Any]:
    check_rules(rules)
    if not step_seconds > 0:
        raise ValueError(f"expected step_seconds > 0, got {step_seconds}")
    duration(step_seconds)  # a whole number of milliseconds
    recordings: dict[str, str] = {}
    alerts = []
    for rule in rules:
        alert, needed = alert_rule(rule, step_seconds)
        for rec in needed:
            if recordings.setdefault(rec.record, rec.expr) != rec.expr:
                raise ValueError(f"recording rule {rec.record} defined twice with different expressions")
        alerts.append(alert)
    group = [{"record": name, "expr": expr} for name, expr in recordings.items()] + alerts
    # after the alerts: a step enters a baseline only if the alert is inactive *after* this
    # evaluation (ALERTS of this timestamp), so a fault's first step stays out of it too
    for name, (on, alerts_regex) in excluded_while_active(rules).items():
        group.append({"record": f"{name}{INACTIVE}",
                      "expr": f'{name} unless {on} ALERTS{{alertname=~"{alerts_regex}"}}'})
    return {"groups": [{"name": ALERT_GROUP, "rules": group},
                       {"name": RATE_GROUP, "rules": rate_rules(rate_window)}]}


def render_rules(rules: tuple[AlertRule, ...] = DEFAULT_RULES, *,
                 step_seconds: float = DEFAULT_STEP_SECONDS, rate_window: str = "5m") -> str:
    """The Prometheus rules file for ``rules`` when one training step takes ``step_seconds``."""
    header = (f"Prometheus rules for mismatch-monitor, rendered from mismatch_monitor.alerts.definitions\n"
              f"for one training step every {duration(step_seconds)} "
              f"(mismatch-monitor alerts render --step-seconds {step_seconds:g}).\n"
              f"Do not edit: change the definitions and render again.")
    return dump(rules_document(rules, step_seconds=step_seconds, rate_window=rate_window), header)


def markdown_table(rules: tuple[AlertRule, ...] = DEFAULT_RULES) -> str:
    """The alerts as a Markdown table (docs/ALERTS.md embeds it)."""
    rows = ["| alert | severity | fires when | holds for | resync | first fix |",
            "|---|---|---|---|---|---|"]
    for r in rules:
        scope = "per pool" if r.scope == "pool" else "fleet"
        rows.append(f"| `{r.name}` | {r.severity} | {r.condition.explain()} ({scope}) | "
                    f"{r.for_steps + 1} step{'s' if r.for_steps else ''}"
                    f"{f'; stays firing {r.keep_firing_steps} steps after it clears' if r.keep_firing_steps else ''} | "
                    f"{'yes' if r.resync else 'no'} | "
                    f"`{r.fix}` |")
    return "\n".join(rows) + "\n"
