"""How every number and name is shown: one place for the dashboard's formats.

A metric's unit and format come from its one declaration (``metrics.unit_of`` / ``format_of``):
a share is shown in percent on cards, in tables and on axes alike; KL and log ratios in plain or
scientific notation, never with SI prefixes ("100μ" reads as micro-nats of nothing); "—" is no
observation (never "None" or "nan"); quantile names read "p99.9", not "p999".
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from mismatch_monitor.formulas import Value
from mismatch_monitor.metrics import METRIC_BY_KEY, METRICS, format_of, unit_of

NO_VALUE = "—"
FALLBACK_FORMAT = ".4g"
_QUANTILE = re.compile(r"\bp(\d\d)(\d+)\b")          # p999 -> p99.9, p9999 -> p99.99
# raw column names of the query layer's frames, as tables show them
COLUMN_NAMES = {"mean_abs_lr": "mean |lr|", "k3_kl": "k3 KL", "n_tokens": "tokens", "tail_to_sample":
                "extreme share / sample share", "sample_share": "share of samples", "token_share":
                "share of tokens", "extreme_share": "share of extreme-ratio tokens", "last_step": "last step",
                "first_fired": "first fired (step)", "since": "since step", "run_id": "run id",
                "last_update": "last update", "crossing_length": "crossing length T*",
                "n_extreme": "extreme-ratio tokens"}
# a stored field shown as such (a total) is named by the metric that declares it: n_sequences -> "sequences"
FIELD_METRIC = {m.formula.field: m.key for m in METRICS if isinstance(m.formula, Value)}


def is_null(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def quantile_name(text: str) -> str:
    return _QUANTILE.sub(lambda m: f"p{m.group(1)}.{m.group(2)}", text)


def metric_label(key: str) -> str:
    metric = METRIC_BY_KEY.get(key)
    return quantile_name(metric.label if metric is not None else key)


def spec(key: str) -> str:
    return format_of(key) if key in METRIC_BY_KEY else FALLBACK_FORMAT


def value(key: str, v: Any) -> str:
    """A metric value for display with its declared format; "—" for no observation."""
    if is_null(v) or (not isinstance(v, str) and pd.isna(v)):
        return NO_VALUE
    x = float(v)
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return format(x, spec(key))


def tick_format(key: str) -> str:
    """A d3 tick format for an axis of the metric: percent for shares (as on the cards), plain
    or scientific otherwise ("~" trims zeros; no SI prefix)."""
    unit = unit_of(key) if key in METRIC_BY_KEY else ""
    if unit == "share":
        return "~%"
    if unit == "count":
        return ",~r"
    return "~g"


def column_name(name: str) -> str:
    """A column's title: a metric's or a stored field's declared label, else the query layer's
    column named in words."""
    if name in METRIC_BY_KEY:
        return metric_label(name)
    if name in COLUMN_NAMES:
        return COLUMN_NAMES[name]
    if name in FIELD_METRIC:
        return metric_label(FIELD_METRIC[name])
    return quantile_name(name.replace("_", " "))


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame as a table shows it: readable column names, metric columns in their format, other
    nulls as "—"."""
    out = pd.DataFrame(index=frame.index)
    for col in frame.columns:
        if col in METRIC_BY_KEY:
            out[column_name(col)] = [value(col, v) for v in frame[col]]
        else:
            out[column_name(col)] = [NO_VALUE if is_null(v) or (not isinstance(v, str) and pd.isna(v))
                                     else v for v in frame[col]]
    return out
