"""A live refresh while a demo writes a run, in a real Chromium: the user's zoom (x, and y of the
subplot zoomed) and legend choices (a pool hidden) survive the refreshes that bring new steps, and
what is shown never blanks or greys out.

``mismatch-monitor demo`` runs in its own process (the simulator, the collector, its store) and the
dashboard follows the run it writes, refreshing every 15 s (``st.fragment(run_every=...)``, see
``layout.live``). The user drags a box on the Pools chart; its x range goes to the URL and the
server draws it on every rerun (``zoom.keep``). That, not plotly's ``uirevision``, is what keeps
the zoom: Streamlit 1.67 replaces a keyed chart's element whenever its figure changes (a new
element id, so plotly's per-element UI state is gone), which is every refresh that brings steps.
The test fails when ``zoom.keep`` stops drawing the URL's x range, y range or hidden legend entries.

Every wait is bounded and says what it waited for. (An earlier version read the largest step from
``el.data[i].x``: plotly.py ships numpy arrays base64-encoded there, so no value was numeric and an
unbounded loop polled for 15 minutes; the decoded arrays are in ``el._fullData``.)
Runtime: about 2-3 minutes on a loaded machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import unquote_plus

import pytest

from external_tools import find, needs

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, LAUNCH_ARGS, chart, serve, wait_drawn  # noqa: E402

pytestmark = [pytest.mark.timeout(900), needs("chromium")]
RUN = "demo"
KEY = "pools_series"
# of a chart: the largest step its decoded traces draw (null while plotly redraws), each axis's
# range, and which traces the legend hides
STATE = """el => {
  if (!el._fullData || !el._fullLayout) return null;
  const xs = el._fullData.filter(t => t.type === 'scatter' && t.name && !t.name.startsWith('_'))
    .flatMap(t => Array.from(t.x || [])).filter(v => typeof v === 'number' && isFinite(v));
  const axes = k => Object.keys(el._fullLayout).filter(a => new RegExp('^' + k + 'axis\\\\d*$').test(a))
    .sort().map(a => el._fullLayout[a].range.map(Number));
  return {last: xs.length ? Math.max(...xs) : null, x: axes('x'), y: axes('y'),
          hidden: el._fullData.filter(t => t.visible === 'legendonly').map(t => t.name)};
}"""
# sampled every 50 ms from now on: the fewest drawn charts, the lowest opacity of any element,
# and how often the title was missing (a blank page)
WATCH = """key => { const w = window.__watch = {charts: 1e9, opacity: 1, untitled: 0, samples: 0};
  setInterval(() => {
    w.samples += 1;
    w.charts = Math.min(w.charts, document.querySelectorAll(`.st-key-${key} .js-plotly-plot .main-svg`).length);
    for (const e of document.querySelectorAll('[data-testid="stElementContainer"]'))
      w.opacity = Math.min(w.opacity, parseFloat(getComputedStyle(e).opacity));
    if (!document.querySelector('h1')) w.untitled += 1;
  }, 50); }"""


def until(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    """``probe()``'s first truthy value, polled for at most ``timeout`` seconds; else fail, saying
    what was awaited and the last value seen."""
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        seen = probe()
        if seen:
            return seen
        time.sleep(every)
    pytest.fail(f"waited {timeout:.0f} s for {what}; last seen: {seen!r}; last read problems: {SEEN[-3:]}")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A runs root with a demo writing run ``demo`` into it until the module ends."""
    root = tmp_path_factory.mktemp("live") / "runs"
    log = open(root.parent / "demo.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mismatch_monitor.cli", "demo", "--steps", "2000",
                             "--variant", "dense", "--warmstart-steps", "0", "--runs-root", str(root),
                             "--name", RUN, "--quiet"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    def flushed() -> bool:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the demo stopped (exit {proc.poll()}):\n{log.read()[-3000:]}")
        return len(list((root / RUN / "steps").glob("*.parquet"))) >= 3   # steps to draw
    try:
        until("the demo's first flushes", flushed, timeout=300, every=1)
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


SEEN: list[str] = []     # why the last reads of the chart gave nothing (in a failure's message)


def state(page) -> dict | None:  # noqa: ANN001
    try:
        got = chart(page, KEY).evaluate(STATE, timeout=10_000)
        if got is None:
            SEEN.append("the chart had no drawn data")
        return got
    except sync_api.Error as exc:   # the element replaced while read (a refresh): read again
        SEEN.append(str(exc).splitlines()[0][:200])
        return None


def box_zoom(page) -> None:  # noqa: ANN001
    """A user's drag of a box across the first subplot's middle (an x and a y zoom)."""
    box = until("the chart's plot area (a refresh may be replacing it)", lambda: page.evaluate(
        f"""() => {{ const a = document.querySelector('.st-key-{KEY} .js-plotly-plot .nsewdrag');
        if (!a) return null; a.scrollIntoView({{block: 'center'}}); const r = a.getBoundingClientRect();
        return r.width > 0 ? {{x: r.x, y: r.y, w: r.width, h: r.height}} : null; }}"""), 30, every=0.2)
    page.mouse.move(box["x"] + box["w"] * 0.2, box["y"] + box["h"] * 0.25)
    page.mouse.down()
    for f in (0.25, 0.5, 0.75, 1.0):
        page.mouse.move(box["x"] + box["w"] * (0.2 + 0.6 * f), box["y"] + box["h"] * (0.25 + 0.5 * f), steps=3)
    page.mouse.up()


def hide_pool(page) -> str:  # noqa: ANN001
    """A user's click on the legend entry of the last pool listed: that pool is hidden and named
    in the URL (``<key>_hide``); the pool's name."""
    hide = re.compile(rf"{KEY}_hide=([^&]+)")
    names: list[str] = []

    def click() -> None:
        entry = page.locator(f".st-key-{KEY} .js-plotly-plot .legend .traces").last
        names.append(entry.locator(".legendtext").text_content(timeout=30_000))
        entry.locator(".legendtoggle").click(timeout=30_000)

    until_url(page, click, hide, "the legend click")
    assert unquote_plus(hide.search(page.url).group(1)) == names[-1], (page.url, names)
    return names[-1]


def until_url(page, act, pattern: re.Pattern, what: str) -> None:  # noqa: ANN001
    """``act()`` until the URL matches ``pattern``, three times at most: a click or drag made while
    a refresh replaces the chart is lost."""
    for _ in range(3):
        act()
        try:
            page.wait_for_url(pattern, timeout=30_000)
            break
        except sync_api.TimeoutError:
            continue
    assert pattern.search(page.url), f"{what} never reached the URL: {page.url}"


def test_a_live_refresh_keeps_the_zoom_and_legend_and_never_blanks(server: str) -> None:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 2000})
        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.goto(f"{server}/pools?run={RUN}&refresh=15+s")
        wait_drawn(page)
        full = until("the chart's first drawn steps", lambda: (s := state(page)) and s["last"] is not None and s, 240)
        zoomed = re.compile(rf"{KEY}_x=([\d.]+)~([\d.]+)")
        until_url(page, lambda: box_zoom(page), zoomed, "the drag")
        lo, hi = (float(v) for v in zoomed.search(page.url).groups())
        assert full["x"][0][0] < lo < hi, (full["x"][0], lo, hi)     # a zoom into the run's steps
        # the box's y zoom of the first subplot (y axis 1; on a log axis in decades) and a pool
        # hidden by a click on its legend entry go to the URL too
        y_zoomed = re.compile(rf"{KEY}_yr=1~(\w+)~([-\d.e]+)~([-\d.e]+)")
        page.wait_for_url(y_zoomed, timeout=30_000)
        y_lo, y_hi = (float(v) for v in y_zoomed.search(page.url).groups()[1:])
        hidden = hide_pool(page)
        drawn = lambda: (s := state(page)) and s["last"] is not None and s                   # noqa: E731
        before = until(f"the chart drawn with the zoom {lo}~{hi}, y {y_lo}~{y_hi}, {hidden} hidden",
                       lambda: (s := drawn()) and s["x"][0] == pytest.approx([lo, hi], rel=1e-9)
                       and s["y"][0] == pytest.approx([y_lo, y_hi], rel=1e-9) and hidden in s["hidden"] and s, 60)
        page.evaluate(WATCH, KEY)
        after = until(f"a live refresh that draws a step past {before['last']} (no reload, no click)",
                      lambda: (s := drawn()) and s["last"] > before["last"] and s, 240)
        page.wait_for_timeout(1000)
        # a refresh that comes soon after the sampling starts leaves few samples: sample on (bounded)
        page.wait_for_function("() => window.__watch.samples > 20", timeout=20_000)
        watched = page.evaluate("() => window.__watch")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "live_zoom_kept.png"))    # the page: a refresh replaces the chart
        assert all(r == pytest.approx([lo, hi], rel=1e-9) for r in after["x"]), \
            f"the zoom {lo}~{hi} was not kept across the refresh: {after['x']}"
        assert after["y"][0] == pytest.approx([y_lo, y_hi], rel=1e-9), \
            f"the y zoom {y_lo}~{y_hi} was not kept across the refresh: {after['y'][0]}"
        assert hidden in after["hidden"] and set(after["hidden"]) == set(before["hidden"]), \
            f"the legend choice ({hidden} hidden) was not kept across the refresh: {after['hidden']}"
        assert watched["samples"] > 20 and watched["charts"] >= 1, watched   # never blank
        assert watched["opacity"] == 1 and watched["untitled"] == 0, watched  # never greyed out
        assert page.locator('[data-testid="stException"]').count() == 0
        assert not problems, problems
        browser.close()
