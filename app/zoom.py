"""A time-series chart's view (its x range, the y range of each of its y axes, and the legend
entries hidden) kept in the URL, so a copied link reopens the same view, and a live refresh keeps
it: Streamlit replaces a chart's element whenever its figure changes (plotly's ``uirevision``
state goes with the old element), so the view the server draws from the URL is what holds it.

Plotly's zoom and legend live in the browser. A small component (JavaScript in the page, no
iframe) listens to the chart's ``plotly_relayout`` and ``plotly_restyle`` events and hands the
view to the script, which writes ``<key>_x=LO~HI`` (steps, or UTC times on a wall-time axis),
one ``<key>_yr=N~TYPE~LO~HI`` per zoomed y axis (axis number, its type: a log axis' range is in
decades, so a range is drawn only on an axis of the type it was taken on) and one
``<key>_hide=NAME`` per legend entry hidden; a double-click (autorange) removes the ranges. The
chart is then drawn with that view, on this and every later run. A value that does not parse
as a range of the axis shown is ignored (a crafted URL).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from .figures import XAxis

SEPARATOR = "~"
MAX_TEXT = 80     # characters of a URL value read: a range is two numbers or two times
MAX_HIDDEN = 64   # legend entries hidden, read from the URL
MAX_NAME = 200
_Y = re.compile(r"^([1-9]\d?)~([a-z]{1,12})~([^~]+)~([^~]+)$")

# finds the chart by its element key, re-attaches when Streamlit replaces the plot element, and
# sends the view once per change (a redraw that reports the same view again does not rerun the
# script); the view a listener starts from is the one the server drew last (``data``)
_JS = """
export default function(component) {
  const { data, setTriggerValue } = component;
  const views = window.__mmViews = window.__mmViews || {};
  views[data.key] = {x: data.x || [], y: data.y || {}, hidden: data.hidden || []};
  const attach = () => {
    const el = document.querySelector('.st-key-' + CSS.escape(data.key) + ' .js-plotly-plot');
    if (!el || typeof el.on !== 'function' || el.__mmZoom === data.key) return;
    el.__mmZoom = data.key;
    let last = JSON.stringify(views[data.key]);
    const send = (change) => {
      const view = Object.assign({}, views[data.key], change);
      const text = JSON.stringify(view);
      if (text === last) return;
      last = text;
      views[data.key] = view;
      setTriggerValue('zoom', view);
    };
    el.on('plotly_relayout', (ev) => {
      let lo = null, hi = null, reset = false;
      const y = Object.assign({}, views[data.key].y), ys = {};
      for (const [k, v] of Object.entries(ev)) {
        let m = k.match(/^xaxis\\d*\\.range\\[([01])\\]$/);
        if (m) { if (m[1] === '0') lo = v; else hi = v; continue; }
        if (/^xaxis\\d*\\.range$/.test(k) && Array.isArray(v)) { lo = v[0]; hi = v[1]; continue; }
        if (/^xaxis\\d*\\.autorange$/.test(k) && v) { reset = true; continue; }
        m = k.match(/^yaxis(\\d*)\\.(range\\[([01])\\]|range|autorange)$/);
        if (!m) continue;
        const n = m[1] || '1', axis = el._fullLayout['yaxis' + (m[1] || '')];
        ys[n] = ys[n] || [axis ? axis.type : 'linear', null, null];
        if (m[2] === 'autorange') { if (v) { delete y[n]; delete ys[n]; } }
        else if (m[3] !== undefined) ys[n][m[3] === '0' ? 1 : 2] = Number(v);
        else if (Array.isArray(v)) { ys[n][1] = Number(v[0]); ys[n][2] = Number(v[1]); }
      }
      for (const [n, r] of Object.entries(ys)) if (r[1] !== null && r[2] !== null) y[n] = r;
      const change = {y};
      if (lo !== null && hi !== null) change.x = [String(lo), String(hi)];
      else if (reset) change.x = [];
      send(change);
    });
    el.on('plotly_restyle', () => {
      const hidden = new Set();
      for (const t of el._fullData || [])
        if (t.visible === 'legendonly') hidden.add(t.legendgroup || t.name);
      send({hidden: [...hidden].filter(Boolean).map(String).sort()});
    });
  };
  attach();
  const timer = setInterval(attach, 400);
  return () => clearInterval(timer);
}
"""
_keeper = st.components.v2.component("mismatch_monitor.zoom", js=_JS)


def param(key: str) -> str:
    return f"{key}_x"


def y_param(key: str) -> str:
    return f"{key}_yr"


def hide_param(key: str) -> str:
    return f"{key}_hide"


def parse(text: str | None, x: XAxis) -> list[Any] | None:
    """``LO~HI`` as an x range of the axis ``x`` (floats for steps, UTC times for wall time), or
    None when absent or not such a range."""
    if not text or len(text) > MAX_TEXT or text.count(SEPARATOR) != 1:
        return None
    lo, hi = text.split(SEPARATOR)
    try:
        if x == "step":
            return _floats(lo, hi)
        ta, tb = pd.Timestamp(lo), pd.Timestamp(hi)
    except (ValueError, TypeError, OverflowError):
        return None
    if pd.isna(ta) or pd.isna(tb) or not ta < tb:
        return None
    return [lo, hi]


def _floats(lo: Any, hi: Any) -> list[float] | None:
    a, b = float(lo), float(hi)
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return [a, b] if a < b else None


def text(value: list[Any], x: XAxis) -> str | None:
    """The URL text of a range the browser reported (None: not a range of this axis)."""
    if len(value) != 2:
        return None
    shown = SEPARATOR.join(str(v) for v in value)
    return shown if parse(shown, x) is not None else None


def parse_y(values: list[str]) -> dict[int, tuple[str, list[float]]]:
    """``N~TYPE~LO~HI`` values as y axis number -> (axis type, range); others left out."""
    out: dict[int, tuple[str, list[float]]] = {}
    for value in values[:99]:
        m = _Y.match(value) if len(value) <= MAX_TEXT else None
        try:
            rng = _floats(m.group(3), m.group(4)) if m else None
        except (ValueError, OverflowError):
            rng = None
        if rng is not None:
            out[int(m.group(1))] = (m.group(2), rng)
    return out


def y_text(reported: Mapping[str, Any]) -> list[str]:
    """The URL values of the y ranges the browser reported ({"2": [type, lo, hi]})."""
    out = []
    for n, r in sorted(reported.items(), key=lambda kv: str(kv[0])):
        if isinstance(r, list) and len(r) == 3:
            out.append(SEPARATOR.join(str(v) for v in (n, *r)))
    return sorted(v for v in out if parse_y([v]))


def parse_hidden(values: list[str]) -> set[str]:
    return {v for v in values[:MAX_HIDDEN] if 0 < len(v) <= MAX_NAME}


def _store(name: str, values: list[str]) -> None:
    if values:
        if st.query_params.get_all(name) != values:
            st.query_params[name] = values
    else:
        st.query_params.pop(name, None)


def _record(key: str, reported: Mapping[str, Any], x: XAxis) -> None:
    """Write a view the browser reported to the URL (a part it does not name is left as is)."""
    rx = reported.get("x")
    if isinstance(rx, list):
        shown = text(rx, x)
        if not rx:
            st.query_params.pop(param(key), None)
        elif shown is not None:
            st.query_params[param(key)] = shown
    if isinstance(reported.get("y"), Mapping):
        _store(y_param(key), y_text(reported["y"]))
    if isinstance(reported.get("hidden"), list):
        _store(hide_param(key), sorted(parse_hidden([str(v) for v in reported["hidden"]])))


def _axis_type(axis: Any) -> str:
    return axis.type if axis.type not in (None, "-") else "linear"


def draw(fig: go.Figure, x_range: list[Any] | None, y_ranges: Mapping[int, tuple[str, list[float]]],
         hidden: set[str]) -> go.Figure:
    """``fig`` with the view: the x range on every x axis (subplots share theirs), each y range on
    its axis where that axis is of the type the range was taken on, the hidden legend entries
    (a trace's legend group, else its name) left to the legend."""
    if x_range is not None:
        fig.update_xaxes(range=x_range, autorange=False)
    for n, (kind, rng) in y_ranges.items():
        name = "yaxis" if n == 1 else f"yaxis{n}"
        axis = fig.layout[name] if name in fig.layout else None
        if axis is not None and _axis_type(axis) == kind:
            axis.update(range=rng, autorange=False)
    if hidden:
        for trace in fig.data:
            if (getattr(trace, "legendgroup", None) or trace.name) in hidden:
                trace.visible = "legendonly"
    return fig


def keep(fig: go.Figure, key: str, x: XAxis) -> go.Figure:
    """Mount the view listener of chart ``key``, record a view it reports in the URL, and draw
    ``fig`` with the URL's view."""
    def current() -> tuple[list[Any] | None, dict[int, tuple[str, list[float]]], set[str]]:
        return (parse(st.query_params.get(param(key)), x), parse_y(st.query_params.get_all(y_param(key))),
                parse_hidden(st.query_params.get_all(hide_param(key))))

    xr, yr, hidden = current()
    reported = _keeper(key=f"{key}-zoom", on_zoom_change=lambda: None, height=0,
                       data={"key": key, "x": [str(v) for v in xr] if xr else [],
                             "y": {str(n): [k, *r] for n, (k, r) in yr.items()}, "hidden": sorted(hidden)}).zoom
    if isinstance(reported, Mapping):
        _record(key, reported, x)
        xr, yr, hidden = current()
    return draw(fig, xr, yr, hidden)
