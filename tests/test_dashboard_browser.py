"""The whole dashboard in a real browser: ``mismatch-monitor dashboard`` on a free port bound to
127.0.0.1, Debian's Chromium driven by Playwright (``executable_path``; browsers are never
downloaded). Every page is visited through the sidebar; a page passes when its charts are drawn,
no Streamlit exception is shown and the browser logged no console error. Screenshots go to
``artifacts/dashboard/`` (git-ignored). The server is stopped by its PID. Chromium is found on PATH
or at ``MISMATCH_MONITOR_CHROMIUM``; where it is absent the tests skip (CI fails on that).

Runtime: about 45 s (server start ~5 s, first paint ~8 s, each further page ~1.5 s, the live
refresh ~10 s).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from playwright.sync_api import ConsoleMessage, Page, sync_playwright

from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.cli.dashboard import DashboardError, wait_until_serving
from test_app_pages import EXPECTED
from external_tools import find, needs
from test_app_runs import DashboardRoot, dashboard_root, fleet_case

CHROMIUM = find("chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "dashboard"
# drawn: the script finished, the page's title is shown, no placeholder left, every chart rendered
READY = """(title) => {
  const app = document.querySelector('[data-testid="stApp"]');
  const h1 = document.querySelector('h1');
  return app && app.getAttribute('data-test-script-state') === 'notRunning'
    && h1 && (title === null || h1.innerText.trim() === title)
    && !document.querySelector('[data-testid="stSkeleton"]')
    && [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].every(e => e.querySelector('.main-svg'));
}"""

pytestmark = [pytest.mark.timeout(240), needs("chromium")]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli() -> str:
    beside = Path(sys.executable).parent / "mismatch-monitor"
    found = str(beside) if beside.exists() else shutil.which("mismatch-monitor")
    assert found, "the mismatch-monitor command is not installed (pip install -e .)"
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DashboardRoot:
    return dashboard_root(str(tmp_path_factory.getbasetemp() / "dashboard"))


@pytest.fixture(scope="module")
def server(runs: DashboardRoot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+")
    proc = subprocess.Popen([cli(), "dashboard", str(runs.root), "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_serving(proc, url, timeout=90)
        except DashboardError as exc:
            log.seek(0)
            pytest.fail(f"{exc}:\n{log.read()}")
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        local = [line.split()[3] for line in listening.splitlines() if line.strip()]
        assert local and all(a.startswith("127.0.0.1:") for a in local), listening   # loopback only
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)     # the CLI stops its streamlit child and exits
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser_page(server: str) -> Iterator[tuple[Page, list[str]]]:
    problems: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            problems.append(f"console error: {msg.text} ({msg.location.get('url', '')})")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.on("console", on_console)
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} {req.failure}"))
        yield page, problems
        browser.close()


def wait_drawn(page: Page, title: str | None = None) -> None:
    page.wait_for_function(READY, arg=title, timeout=60_000)
    page.wait_for_timeout(300)            # a rerun may start right after the first paint
    page.wait_for_function(READY, arg=title, timeout=60_000)


def no_exception(page: Page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


def test_every_page_renders_in_chromium(server: str, browser_page) -> None:
    page, problems = browser_page
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.goto(f"{server}/?run=fleet")
    for spec in PAGES:
        if spec is not PAGES[0]:
            page.locator(f'[data-testid="stSidebarNav"] a[href$="/{spec.url_path}"]').first.click()
            page.wait_for_url(re.compile(rf"/{spec.url_path}\?"))
        wait_drawn(page, spec.title)
        no_exception(page)
        assert page.locator("h1").first.inner_text().strip() == spec.title
        assert "run=fleet" in page.url                      # the run stays in the URL across pages
        n_charts, n_frames = EXPECTED[spec.url_path]
        assert page.locator(".js-plotly-plot .main-svg").count() >= n_charts, spec.url_path
        assert page.locator('[data-testid="stDataFrame"]').count() >= n_frames, spec.url_path
        page.screenshot(path=str(ARTIFACTS / f"{spec.url_path}.png"), full_page=True)
    assert not problems, problems


def test_a_changed_control_is_written_to_the_url(server: str, browser_page) -> None:
    page, problems = browser_page
    page.goto(f"{server}/?run=fleet")
    wait_drawn(page)
    page.locator('[data-testid="stSidebarNav"] a[href$="/tails"]').first.click()
    wait_drawn(page, "Tails")
    page.locator('[data-testid="stSelectbox"]', has_text="Histogram of pool").click()
    page.get_by_role("option", name="fp8", exact=True).click()
    page.wait_for_url(re.compile(r"tails_pool=fp8"))
    wait_drawn(page)
    assert page.get_by_text("histogram over steps · fp8").count() == 1
    page.goto(f"{server}/?run=fleet-upgrade&x=wall+time&window=last+100")   # a shared link
    wait_drawn(page)
    assert page.get_by_text(re.compile(r"^Run fleet-upgrade · ")).count() == 1
    page.locator(".js-plotly-plot", has_text="wall time (UTC)").first.wait_for(timeout=30_000)
    no_exception(page)
    assert not problems, problems


def test_a_run_outside_the_root_is_refused(server: str, browser_page) -> None:
    page, problems = browser_page
    page.goto(f"{server}/?run=..%2F..%2Fetc")
    wait_drawn(page)
    assert page.get_by_text("outside the runs root").count() >= 1
    no_exception(page)
    assert not problems, problems


def test_a_live_run_refreshes_in_place_keeping_the_controls(server: str, browser_page, runs: DashboardRoot) -> None:
    page, problems = browser_page
    live = runs.live
    step = 100
    live.log_step(step, fleet_case(step, 3, 1.0).batch())    # a fresh step: the run is live
    live.flush()
    page.goto(f"{server}/?run=live&refresh=5+s")
    wait_drawn(page)
    assert page.get_by_text(f"Fleet at step {step}").count() == 1
    slider = page.locator('[data-testid="stSidebar"] [data-testid="stSlider"] input[type="range"]')
    slider.focus()
    for _ in range(6):
        page.keyboard.press("ArrowRight")                    # smoothing 0.30
    page.wait_for_url(re.compile(r"smooth=0\.3"))
    wait_drawn(page)
    url = page.url
    live.log_step(step + 1, fleet_case(step + 1, 3, 1.0).batch())
    live.flush()
    page.get_by_text(f"Fleet at step {step + 1}").wait_for(timeout=30_000)   # no reload, no click
    assert page.url == url
    assert float(slider.input_value()) == pytest.approx(0.3)
    no_exception(page)
    assert not problems, problems
