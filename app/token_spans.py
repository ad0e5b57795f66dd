"""A sequence's stored exemplar tokens drawn as text spans coloured by |log ρ|, as escaped HTML.

Only the K worst tokens of a step are stored, so a sequence shows the tokens it holds among them,
in position order, with "…" where stored positions are not adjacent. Token text is shown when the
run stores it (``token_text``), else the token id, else the position. Everything is escaped: token
text comes from a tokenizer and may hold markup.
"""

from __future__ import annotations

import html
import math

import pandas as pd

# sequential scale: light yellow (|lr| = 0) to dark red (|lr| >= the scale's top)
LOW = (255, 245, 204)
HIGH = (165, 15, 21)


def color(value: float, top: float) -> str:
    """Colour of ``value`` (an |lr|) on the 0..top scale; grey when there is no value."""
    if value is None or not math.isfinite(value) or not math.isfinite(top) or top <= 0:
        return "rgb(200,200,200)"
    f = min(max(value / top, 0.0), 1.0)
    r, g, b = (round(lo + (hi - lo) * f) for lo, hi in zip(LOW, HIGH))
    return f"rgb({r},{g},{b})"


def _text(row: pd.Series) -> str:
    text = row.get("token_text")
    if isinstance(text, str):
        return text
    tid = row.get("token_id")
    return f"#{int(tid)}" if tid is not None and not pd.isna(tid) else f"@{int(row['position'])}"


def spans(tokens: pd.DataFrame, top: float) -> str:
    """One sequence's tokens (rows with position, abs_log_ratio, log_ratio) as coloured spans."""
    parts: list[str] = []
    last = None
    for _, r in tokens.sort_values("position").iterrows():
        pos = int(r["position"])
        if last is not None and pos > last + 1:
            parts.append('<span class="mm-gap">…</span>')
        last = pos
        a = float(r["abs_log_ratio"])
        fg = "#fff" if a / top > 0.55 else "#000" if top > 0 else "#000"
        title = f"position {pos} · |log ρ| = {a:.4g} · log ρ = {float(r['log_ratio']):.4g}"
        parts.append(f'<span class="mm-token" data-abs-lr="{a!r}" title="{html.escape(title)}" '
                     f'style="background:{color(a, top)};color:{fg};padding:1px 4px;margin:1px;'
                     f'border-radius:3px;font-family:monospace;white-space:pre">{html.escape(_text(r))}</span>')
    return '<div class="mm-tokens" style="line-height:2">' + "".join(parts) + "</div>"


def legend(top: float) -> str:
    """What the colours mean: the scale from |log ρ| = 0 to ``top``."""
    stops = ", ".join(color(top * i / 4, top) for i in range(5))
    return ('<div class="mm-legend" style="display:flex;align-items:center;gap:6px;font-size:0.85em">'
            f'<span>|log ρ| = 0</span><span style="width:160px;height:12px;background:linear-gradient('
            f'to right, {stops})"></span><span>{html.escape(f"{top:.3g}")} or more</span>'
            '<span>(hover a token for its value)</span></div>')
