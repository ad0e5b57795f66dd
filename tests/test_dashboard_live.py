"""A live refresh while a demo writes a run, in a real Chromium: the user's zoom and legend
choices survive the refresh that brings new steps (plotly ``uirevision``; the zoom is also in the
URL), and what is shown never blanks or greys out while the page redraws.

``mismatch-monitor demo`` runs in its own process (the simulator, the collector, its store,
flushing every 2 s) and the dashboard follows the run it writes. Runtime: about 2-3 minutes on a
loaded machine (the demo's first flush ~40 s, a refresh every 5 s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from external_tools import find, needs

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, LAUNCH_ARGS, VIEW_STATE, chart, drag_zoom, serve, wait_drawn  # noqa: E402

pytestmark = [pytest.mark.timeout(900), needs("chromium")]
RUN = "demo"
# the largest step a chart's traces draw
LAST_X = """el => el.data ? Math.max(...el.data.flatMap(t => Array.from(t.x || []).filter(v => typeof v === 'number')))
  : -1"""   # -1: the chart is being redrawn (no data for a moment)
# sampled every 50 ms from now on: the fewest drawn charts, the lowest opacity of any element,
# and whether the title was ever missing (a blank page)
WATCH = """key => { const w = window.__watch = {charts: 1e9, opacity: 1, untitled: 0, samples: 0};
  setInterval(() => {
    w.samples += 1;
    w.charts = Math.min(w.charts, document.querySelectorAll(`.st-key-${key} .js-plotly-plot .main-svg`).length);
    for (const e of document.querySelectorAll('[data-testid="stElementContainer"]'))
      w.opacity = Math.min(w.opacity, parseFloat(getComputedStyle(e).opacity));
    if (!document.querySelector('h1')) w.untitled += 1;
  }, 50); }"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A runs root with a demo writing run ``demo`` into it until the module ends."""
    root = tmp_path_factory.mktemp("live") / "runs"
    log = open(root.parent / "demo.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mismatch_monitor.cli", "demo", "--steps", "2000",
                             "--variant", "dense", "--runs-root", str(root), "--name", RUN, "--quiet"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while len(list((root / RUN / "steps").glob("*.parquet"))) < 2:   # two flushes: steps to draw
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"the demo wrote no step (exit {proc.poll()}):\n{log.read()[-3000:]}")
            time.sleep(1)
        yield root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)           # the process group this fixture started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+") as log:
        yield from serve(root, log)


def last_step(page) -> int:  # noqa: ANN001
    caption = page.get_by_text(re.compile(rf"^Run {RUN} · ")).first.inner_text()
    found = re.search(r"steps (\d+)–(\d+)", caption)
    assert found, caption
    return int(found.group(2))


def test_a_live_refresh_keeps_zoom_and_legend_choices_and_never_blanks(server: str) -> None:
    key = "pools_series"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 2000})
        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.goto(f"{server}/pools?run={RUN}&refresh=5+s")
        wait_drawn(page)
        page.wait_for_function(f"""() => {{ const a = document.querySelector('.st-key-{key} .js-plotly-plot .nsewdrag');
            return a && a.getBoundingClientRect().width > 0; }}""", timeout=180_000)   # the chart's plot area
        zoomed = re.compile(rf"{key}_x=[\d.]+~[\d.]+")
        for _ in range(3):              # a drag made while plotly redraws (a refresh) is dropped: again
            drag_zoom(page, key, 0.2, 0.7)
            try:
                page.wait_for_url(zoomed, timeout=30_000)
                break
            except sync_api.TimeoutError:
                continue
        assert zoomed.search(page.url), page.url
        wait_drawn(page)
        entry = chart(page, key).locator(".legend .traces").first        # hide the first pool
        pool = entry.locator(".legendtext").text_content()
        entry.click()
        page.wait_for_function(f"el => el._fullData.some(t => t.name === {pool!r} && t.visible === 'legendonly')",
                               arg=chart(page, key).element_handle(), timeout=30_000)
        before = chart(page, key).evaluate(VIEW_STATE)
        drawn_up_to, shown_up_to = -1, last_step(page)
        while drawn_up_to < 0:
            drawn_up_to = chart(page, key).evaluate(LAST_X)
        page.evaluate(WATCH, key)
        deadline = time.monotonic() + 240
        while chart(page, key).evaluate(LAST_X) <= drawn_up_to:             # no reload, no click
            assert time.monotonic() < deadline, "no new step was drawn by the live refresh"
            page.wait_for_timeout(500)
        assert last_step(page) > shown_up_to
        page.wait_for_timeout(1000)
        after = chart(page, key).evaluate(VIEW_STATE)
        watched = page.evaluate("() => window.__watch")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        chart(page, key).screenshot(path=str(ARTIFACTS / "live_zoom_kept.png"), timeout=120_000)
        assert after["x"] == before["x"]                                    # the zoom kept
        assert [pool, "legendonly"] in after["visible"]                     # the legend choice kept
        assert watched["samples"] > 20 and watched["charts"] >= 1, watched  # never blank
        assert watched["opacity"] == 1 and watched["untitled"] == 0, watched  # never greyed out
        assert page.locator('[data-testid="stException"]').count() == 0
        assert not problems, problems
        browser.close()
