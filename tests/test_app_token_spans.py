"""Token spans of the Exemplars page: token text escaped, colour monotone in |lr|, id when no text."""

from __future__ import annotations

import re

import pandas as pd

from mismatch_monitor.app import exemplar_links, token_spans


def _rgb(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", s).groups())


def test_script_token_text_is_escaped() -> None:
    tokens = pd.DataFrame({"position": [0, 3], "abs_log_ratio": [0.5, 1.0], "log_ratio": [-0.5, 1.0],
                           "token_text": ["<script>alert(1)</script>", '"a&b'], "token_id": [7, 8]})
    html = token_spans.spans(tokens, 1.0)
    assert "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&quot;a&amp;b" in html
    assert html.count('class="mm-token"') == 2 and "…" in html    # positions 0 and 3 are not adjacent


def test_token_id_when_no_text_and_value_in_title() -> None:
    tokens = pd.DataFrame({"position": [2, 1], "abs_log_ratio": [0.25, 2.0], "log_ratio": [0.25, -2.0],
                           "token_id": pd.array([42, None], dtype="Int64")})
    html = token_spans.spans(tokens, 2.0)
    assert html.index(">@1<") < html.index(">#42<")                 # position order; no id: position
    assert "|log ρ| = 0.25" in html


def test_colour_is_monotone_in_abs_lr() -> None:
    values = [0.0, 0.1, 0.3, 0.7, 1.2, 2.0, 5.0]
    rgbs = [_rgb(token_spans.color(v, 2.0)) for v in values]
    below = rgbs[:6]                                                # |lr| up to the scale's top
    for a, b in zip(below, below[1:]):
        assert all(y <= x for x, y in zip(a, b)) and a != b           # strictly darker as |lr| grows
    assert rgbs[-1] == rgbs[-2] == token_spans.HIGH                # clipped at the scale's top
    assert token_spans.color(float("nan"), 2.0) == "rgb(200,200,200)"


def test_link_carries_run_step_pool() -> None:
    assert exemplar_links.url("a b", 7, "fp8") == "exemplars?run=a+b&step=7&pool=fp8"
