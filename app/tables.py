"""Tables as the pages show them: readable column titles, each column in its format, and a null
written as what it means (no observation, an empty slice) instead of Streamlit's "None".

The values stay numbers (a pandas ``Styler`` formats what is shown), so a column still sorts by
value.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pandas as pd
from pandas.io.formats.style import Styler

from mismatch_monitor.metrics import METRIC_BY_KEY

from . import formatting

NO_VALUE = formatting.NO_VALUE
NO_POOL = "(no pool)"
FLEET = "(fleet)"      # an alert event or rule row of the whole fleet (pool null)


def _percent(v: Any) -> str:
    return f"{float(v):.1%}"


def _count(v: Any) -> str:
    return f"{float(v):,.0f}"


def _float(v: Any) -> str:
    return format(float(v), ".4g")


def percent(v: Any) -> str:
    """A signed relative change in percent."""
    return f"{float(v):+.1%}"


def _ratio(v: Any) -> str:
    return f"{float(v):.2f}×"


def column_format(col: str) -> Callable[[Any], str] | None:
    """The format of a query-layer column, from its name: a metric's declared format, shares in
    percent, counts whole, the tail-to-sample ratio to two decimals, else none (as it is)."""
    if col in METRIC_BY_KEY:
        return lambda v: formatting.value(col, v)
    if col.endswith("_share") or col == "share":
        return _percent
    if col.startswith("n_") or col in ("count", "tokens", "sequences"):
        return _count
    if col == "tail_to_sample":
        return _ratio
    if col in ("mean_abs_lr", "k3_kl", "value", "threshold"):
        return lambda v: format(float(v), ".4g")
    return None


def styled(frame: pd.DataFrame, empty: Mapping[str, str] | None = None,
           titles: Mapping[str, str] | None = None,
           formats: Mapping[str, Callable[[Any], str]] | None = None) -> Styler:
    """``frame`` for ``st.dataframe``: columns titled by ``titles`` (else ``formatting.column_name``),
    formatted by ``formats`` or :func:`column_format` (other floats to 4 significant digits), a null
    shown as ``empty[col]`` (default "—"; a null pool is "(no pool)")."""
    empty = dict(empty or {})
    names = {c: (titles or {}).get(c, formatting.column_name(c)) for c in frame.columns}
    out = frame.copy()
    for col in out.columns:     # a text column's null is shown by its own value, not "None"
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col]):
            fill = NO_POOL if col == "pool" else empty.get(col, NO_VALUE)
            out[col] = out[col].astype(object).where(out[col].notna(), fill)
    style = out.rename(columns=names).style
    for col in frame.columns:
        fmt = (formats or {}).get(col) or column_format(col)
        if fmt is None and pd.api.types.is_float_dtype(frame[col]):
            fmt = _float
        style = style.format(fmt, subset=[names[col]], na_rep=empty.get(col, NO_VALUE))
    return style


def pool_shares(shares: pd.DataFrame) -> Styler:
    """The Pools page's share table: a share of an empty total (no sequence, token or
    extreme-ratio token in the steps shown) says so; a pool holding none of a non-empty total is 0%."""
    no_tail = "no extreme tokens" if "extreme_share" in shares and shares["extreme_share"].isna().all() else NO_VALUE
    return styled(shares, empty={"sample_share": "no sequences", "token_share": "no tokens",
                                 "extreme_share": "no extreme tokens", "tail_to_sample": no_tail})
