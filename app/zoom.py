"""A time-series chart's zoom (its x range) kept in the URL, so a copied link reopens the same
zoomed view, and a live refresh keeps it: Streamlit replaces a chart's element whenever its
figure changes (plotly's ``uirevision`` state goes with the old element), so the range the
server draws from the URL is what holds the zoom.

Plotly's zoom lives in the browser. A small component (JavaScript in the page, no iframe)
listens to the chart's ``plotly_relayout`` event and hands the new x range to the script, which
writes it as ``<chart key>_x=LO~HI`` (steps, or UTC times on a wall-time axis); a double-click
(autorange) removes it. The chart is then drawn with that range, on this and every later run.
A value that does not parse as a range of the axis shown is ignored (a crafted URL).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from .figures import XAxis

SEPARATOR = "~"
MAX_TEXT = 80     # characters of a URL value read: a range is two numbers or two times

# finds the chart by its element key, re-attaches when Streamlit replaces the plot element, and
# sends a range once (a redraw that reports the same range again does not rerun the script)
_JS = """
export default function(component) {
  const { data, setTriggerValue } = component;
  let last = null, timer = null;
  const send = (value) => {
    const text = JSON.stringify(value);
    if (text === last) return;
    last = text;
    setTriggerValue('zoom', value);
  };
  const attach = () => {
    const el = document.querySelector('.st-key-' + CSS.escape(data.key) + ' .js-plotly-plot');
    if (!el || typeof el.on !== 'function' || el.__mmZoom === data.key) return;
    el.__mmZoom = data.key;
    last = JSON.stringify(data.range);
    el.on('plotly_relayout', (ev) => {
      let lo = null, hi = null, reset = false;
      for (const [k, v] of Object.entries(ev)) {
        const m = k.match(/^xaxis\\d*\\.range\\[([01])\\]$/);
        if (m) { if (m[1] === '0') lo = v; else hi = v; }
        else if (/^xaxis\\d*\\.range$/.test(k) && Array.isArray(v)) { lo = v[0]; hi = v[1]; }
        else if (/^xaxis\\d*\\.autorange$/.test(k) && v) reset = true;
      }
      if (lo !== null && hi !== null) send([String(lo), String(hi)]);
      else if (reset) send([]);
    });
  };
  attach();
  timer = setInterval(attach, 400);
  return () => clearInterval(timer);
}
"""
_keeper = st.components.v2.component("mismatch_monitor.zoom", js=_JS)


def param(key: str) -> str:
    return f"{key}_x"


def parse(text: str | None, x: XAxis) -> list[Any] | None:
    """``LO~HI`` as an x range of the axis ``x`` (floats for steps, UTC times for wall time), or
    None when absent or not such a range."""
    if not text or len(text) > MAX_TEXT or text.count(SEPARATOR) != 1:
        return None
    lo, hi = text.split(SEPARATOR)
    try:
        if x == "step":
            a, b = float(lo), float(hi)
            if not (math.isfinite(a) and math.isfinite(b)):
                return None
            return [a, b] if a < b else None
        ta, tb = pd.Timestamp(lo), pd.Timestamp(hi)
    except (ValueError, TypeError, OverflowError):
        return None
    if pd.isna(ta) or pd.isna(tb) or not ta < tb:
        return None
    return [lo, hi]


def text(value: list[Any], x: XAxis) -> str | None:
    """The URL text of a range the browser reported (None: not a range of this axis)."""
    if len(value) != 2:
        return None
    shown = SEPARATOR.join(str(v) for v in value)
    return shown if parse(shown, x) is not None else None


def keep(fig: go.Figure, key: str, x: XAxis) -> go.Figure:
    """Mount the zoom listener of chart ``key``, record a zoom it reports in the URL, and draw
    ``fig`` with the URL's x range (every x axis: subplots share theirs)."""
    current = parse(st.query_params.get(param(key)), x)
    reported = _keeper(key=f"{key}-zoom", data={"key": key, "range": current},
                       on_zoom_change=lambda: None, height=0).zoom
    if isinstance(reported, list):
        shown = text(reported, x)
        if not reported:
            st.query_params.pop(param(key), None)
            current = None
        elif shown is not None:
            st.query_params[param(key)] = shown
            current = parse(shown, x)
    if current is not None:
        fig.update_xaxes(range=current, autorange=False)
    return fig
