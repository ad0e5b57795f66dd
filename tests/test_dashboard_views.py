"""Views that hold, in a real Chromium: a log axis with exact zeros present, one colour per pool
across runs and pages, a copied URL reopening the same view from a sub-page, and crafted URLs and
damaged runs answered in the page (no traceback, no server path) while the other runs stay usable.

One Streamlit server and one browser for the module, on copies of the project's sample runs.
Runtime: about 60 s (server start ~5 s, each page visit 2-8 s).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from external_tools import find, needs

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, LAUNCH_ARGS, VIEW_STATE, chart, drag_zoom, serve, wait_drawn  # noqa: E402

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
RUNS = ("stable_fleet", "fault_midrun", "collapse_no_correction")
POOLS = {"async", "bf16", "fp8", "int4", "topp"}                 # the sample runs' pools
pytestmark = [pytest.mark.timeout(300), needs("chromium"),
              pytest.mark.skipif(not all((SAMPLE_DATA / r).is_dir() for r in RUNS),
                                 reason="the sample runs are not in sample_data/")]
# of one chart: the (first) y axis type, whether a trace on it holds an exact zero (the decoded
# data plotly.js draws), and each trace's colour
FIGURE = """el => ({type: el.layout.yaxis.type || 'linear',
  zero: el._fullData.some(t => t.yaxis === 'y' && Array.from(t.customdata || []).some(v => v === 0)),
  colors: Object.fromEntries(el.data.filter(t => t.line && t.name).map(t => [t.name, t.line.color]))})"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("views") / "runs"
    for run in RUNS:
        shutil.copytree(SAMPLE_DATA / run, root / run)
    shutil.copytree(SAMPLE_DATA / "stable_fleet", root / "broken")
    (root / "broken" / "run.json").write_text('{"run_id": "broken", "start')         # cut short
    shutil.copytree(SAMPLE_DATA / "stable_fleet", root / "corrupt")
    (root / "corrupt" / "tokens" / "part-99999999.parquet").write_bytes(b"not parquet")  # unlisted
    return root


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+") as log:
        yield from serve(root, log)


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser) -> Iterator[object]:  # noqa: ANN001
    ctx = browser.new_context(viewport={"width": 1400, "height": 2000})
    p = ctx.new_page()
    p.problems = []
    p.on("pageerror", lambda exc: p.problems.append(f"page error: {exc}"))
    yield p
    ctx.close()


def figure(page, key: str) -> dict:  # noqa: ANN001
    return page.locator(f".st-key-{key} .js-plotly-plot").first.evaluate(FIGURE)


def clean(page, root: Path) -> str:  # noqa: ANN001
    """The page's text, checked for a traceback and a server path."""
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()
    text = page.locator('[data-testid="stApp"]').inner_text()
    assert str(root.parent) not in text and "Traceback" not in text, text[:2000]
    return text


def test_a_log_axis_with_zeros_present(server: str, page, root: Path) -> None:  # noqa: ANN001
    page.goto(f"{server}/pools?run=fault_midrun")
    wait_drawn(page)
    got = figure(page, "pools_series")
    assert got["zero"], "the sample run's k3 has exact zeros: the test needs them"
    assert got["type"] == "log"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "pools_log_with_zeros.png"), full_page=True)
    clean(page, root)


def test_a_pool_has_one_colour_across_runs_and_pages(server: str, page, root: Path) -> None:  # noqa: ANN001
    seen: dict[str, set[str]] = {}
    for run, path, key in (("stable_fleet", "pools", "pools_series"), ("collapse_no_correction", "pools",
                                                                       "pools_series"),
                           ("stable_fleet", "tails", "tails_drift")):
        page.goto(f"{server}/{path}?run={run}")
        wait_drawn(page)
        for name, color in figure(page, key)["colors"].items():
            if name.removesuffix(" (raw)") in POOLS:            # not the bands' own traces
                seen.setdefault(name.removesuffix(" (raw)"), set()).add(color)
    assert {"bf16", "fp8", "int4"} <= set(seen)
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == len(seen)   # and pools are told apart
    clean(page, root)


def test_a_copied_url_reopens_the_same_view_from_a_sub_page(server: str, browser, page, root: Path) -> None:  # noqa: ANN001
    page.goto(f"{server}/?run=collapse_no_correction")
    wait_drawn(page)
    page.locator('[data-testid="stSidebarNav"] a[href$="/pools"]').first.click()
    page.wait_for_url(re.compile(r"/pools"))
    wait_drawn(page)
    page.locator(".st-key-pools_series_y button", has_text="linear").click()
    page.wait_for_url(re.compile(r"pools_series_y=linear"))
    wait_drawn(page)
    assert figure(page, "pools_series")["type"] == "linear"
    copied = page.url
    assert "run=collapse_no_correction" in copied
    other = browser.new_context(viewport={"width": 1400, "height": 2000}).new_page()
    other.goto(copied)
    wait_drawn(other)
    assert other.locator("h1").first.inner_text().strip() == "Pools"
    assert other.get_by_text(re.compile(r"^Run collapse_no_correction · ")).count() == 1
    assert figure(other, "pools_series")["type"] == "linear"        # not the automatic log
    clean(other, root)
    other.context.close()


def test_a_zoom_is_kept_in_a_copied_url_from_a_sub_page(server: str, browser, page, root: Path) -> None:  # noqa: ANN001
    page.goto(f"{server}/?run=fault_midrun")
    wait_drawn(page)
    page.locator('[data-testid="stSidebarNav"] a[href$="/tails"]').first.click()
    page.wait_for_url(re.compile(r"/tails"))
    wait_drawn(page)
    before = chart(page, "tails_drift").evaluate(VIEW_STATE)["x"][0]
    drag_zoom(page, "tails_drift")
    page.wait_for_url(re.compile(r"tails_drift_x=[\d.]+~[\d.]+"), timeout=30_000)
    wait_drawn(page)
    zoomed = chart(page, "tails_drift").evaluate(VIEW_STATE)["x"][0]
    lo, hi = (float(v) for v in zoomed)
    assert float(before[0]) < lo < hi < float(before[1])          # a zoom into the run's steps
    copied = page.url
    other = browser.new_context(viewport={"width": 1400, "height": 2000}).new_page()
    other.goto(copied)
    wait_drawn(other)
    assert other.locator("h1").first.inner_text().strip() == "Tails"
    got = chart(other, "tails_drift").evaluate(VIEW_STATE)["x"][0]
    assert [float(v) for v in got] == pytest.approx([lo, hi], rel=1e-9)
    unzoomed = chart(other, "tails_bands").evaluate(VIEW_STATE)["x"][0]   # other charts: their own
    assert [float(v) for v in unzoomed] != pytest.approx([lo, hi], rel=1e-9)
    other.screenshot(path=str(ARTIFACTS / "zoom_copied_url.png"), full_page=True)
    clean(other, root)
    other.context.close()


def test_the_default_run_is_written_to_the_url(server: str, page, root: Path) -> None:  # noqa: ANN001
    page.goto(f"{server}/tails")
    wait_drawn(page)
    page.wait_for_url(re.compile(r"run=\w+"), timeout=30_000)
    clean(page, root)


@pytest.mark.parametrize("query, shown", [
    ("run=a%00b", "control characters"),
    ("run=..%2F..%2Fetc", "outside the runs root"),
    ("run=broken", "cannot be read"),
    ("run=corrupt", "not served"),
], ids=["null-byte", "outside-root", "broken-run-json", "corrupt-unlisted-part"])
def test_crafted_urls_and_damaged_runs_are_answered_in_the_page(server: str, page, root: Path, query: str,
                                                                 shown: str) -> None:  # noqa: ANN001
    for path in ("", "pools", "tails"):
        page.goto(f"{server}/{path}?{query}")
        wait_drawn(page)
        assert shown in clean(page, root), path
    page.screenshot(path=str(ARTIFACTS / f"damaged_{query.split('=')[1][:8].replace('%', '')}.png"),
                    full_page=True)
    page.goto(f"{server}/pools?run=stable_fleet")                   # the rest of the app unaffected
    wait_drawn(page)
    assert figure(page, "pools_series")["type"] in ("log", "linear")
    clean(page, root)
    assert not page.problems, page.problems
