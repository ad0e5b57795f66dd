"""A click on a point of a binned chart (a run longer than the chart's points: each point a bin of
several steps) opens the step the user means, in a real Chromium: the bin's step with the clicked
pool's worst stored token, which the point's hover names, not the bin's first step.

Runtime: about 60-90 s (a 650-step run written by the collector ~30 s, server start ~5 s).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import duckdb
import pytest

from external_tools import needs
from synthetic import make_batch

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, serve, wait_drawn  # noqa: E402
from test_dashboard_exemplars import POINT, _browser_page  # noqa: E402

from mismatch_monitor.collectors import MismatchCollector  # noqa: E402

pytestmark = [pytest.mark.timeout(600), needs("chromium")]
RUN, STEPS, POOL = "long", 650, "fp8"     # more steps than a chart's 600 points: bins of 2 steps
# the bin starts the first subplot's raw trace of ``pool`` draws
BINS = "(el, pool) => Array.from(el._fullData.find(t => t.legendgroup === pool && t.xaxis === 'x').x)"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("binned") / "runs"
    with MismatchCollector(root / RUN, flush_every_steps=200) as mc:
        for step in range(STEPS):
            mc.log_step(step, make_batch(step, sequences=6, max_len=12))
    return root


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+") as log:
        yield from serve(root, log)


def test_a_click_on_a_bin_opens_its_step_with_the_pools_worst_token(server: str, root: Path) -> None:
    files = str(root / RUN / "exemplar_tokens" / "*.parquet")
    # each step's largest stored |log ρ| of the pool, read from the Parquet files
    worst = dict(duckdb.sql(f"select step, max(abs_log_ratio) from read_parquet('{files}') "
                            f"where pool = '{POOL}' group by step").fetchall())
    with sync_api.sync_playwright() as pw:
        b, page = _browser_page(pw)
        # zoomed to the first 120 steps (a bin a few pixels wide, as a user would click one)
        page.goto(f"{server}/pools?run={RUN}&refresh=off&pools_series_x=0~120")
        wait_drawn(page)
        text = page.locator('[data-testid="stApp"]').inner_text()
        width = int(re.search(r"shown in bins of (\d+) steps", text).group(1))
        plot = page.locator(".st-key-pools_series .js-plotly-plot").first
        plot.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        starts = [int(v) for v in plot.evaluate(BINS, POOL)]
        # a bin whose worst step is not its first: a click on it opening the first step is wrong
        i, start, want = next((i, s, max((t for t in range(s, s + width) if t in worst), key=worst.get))
                              for i, s in enumerate(starts[10:], 10) if s < 110
                              if worst.get(s + 1, -1) > worst.get(s, -1))
        at = plot.evaluate(f"el => ({POINT})([el, {POOL!r}, {i}])")
        assert int(at["step"]) == start
        page.mouse.move(at["x"], at["y"])
        page.locator(".st-key-pools_series .hoverlayer .hovertext").first.wait_for(timeout=30_000)
        hover = page.locator(".st-key-pools_series .hoverlayer").text_content()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "binned_click_hover.png"))
        page.mouse.click(at["x"], at["y"])
        page.wait_for_function("() => location.pathname.endsWith('/exemplars')", timeout=60_000)
        wait_drawn(page)
        url = page.url
        b.close()
    assert width > 1
    assert f"steps {start}–{start + width - 1}" in hover and "worst stored token" in hover, hover
    assert re.search(rf"[?&]step={want}(&|$)", url) and f"pool={POOL}" in url, (url, start, want)
    assert want != start
