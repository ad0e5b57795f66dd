"""One dashboard server and one headless Chromium for a browser-test module: Streamlit on a free
127.0.0.1 port (stopped by its process group), Debian's Chromium driven by Playwright through
``executable_path`` (browsers are never downloaded)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Iterator

from mismatch_monitor.app.navigation import APP_DIR
from mismatch_monitor.cli.dashboard import DashboardError, wait_until_serving

LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "dashboard"
# drawn: the script finished, a title is shown, no placeholder left, every chart rendered
READY = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  return app && app.getAttribute('data-test-script-state') === 'notRunning'
    && document.querySelector('h1')
    && !document.querySelector('[data-testid="stSkeleton"]')
    && [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].every(e => e.querySelector('.main-svg'));
}"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(root: Path, log: IO[str]) -> Iterator[str]:
    """Yield the base URL of a dashboard on ``root``; stop it (its whole process group) after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(APP_DIR / "main.py"),
                             "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--server.headless", "true", "--browser.gatherUsageStats", "false",
                             "--", "--runs-root", str(root)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_serving(proc, url, timeout=120)
        except DashboardError as exc:
            log.seek(0)
            raise RuntimeError(f"{exc}:\n{log.read()}") from exc
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_drawn(page) -> None:  # noqa: ANN001 - a Playwright page
    try:
        page.wait_for_function(READY, timeout=120_000)
    except Exception:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "not_drawn.png"), full_page=True)   # what was shown instead
        raise
    page.wait_for_timeout(300)            # a rerun may start right after the first paint
    page.wait_for_function(READY, timeout=120_000)


# the x range each x axis of a chart shows, and its traces' visibility (legend choices)
VIEW_STATE = """el => ({x: Object.keys(el._fullLayout).filter(k => /^xaxis\\d*$/.test(k))
    .map(k => el._fullLayout[k].range.map(String)),
  visible: el._fullData.map(t => [t.name, t.visible])})"""


def chart(page, key: str):  # noqa: ANN001, ANN201 - Playwright page and locator
    return page.locator(f".st-key-{key} .js-plotly-plot").first


def drag_zoom(page, key: str, start: float = 0.3, stop: float = 0.6) -> None:  # noqa: ANN001
    """Zoom chart ``key`` as a user does: a mouse drag across its first subplot, from ``start``
    to ``stop`` of its width (a horizontal drag: an x zoom)."""
    # in one step, retried: a live page redraws (plotly replaces its drag layers meanwhile)
    for _ in range(300):
        box = page.evaluate("""key => { const area = document.querySelector(`.st-key-${key} .js-plotly-plot .nsewdrag`);
            if (!area) return null;
            area.scrollIntoView({block: 'center'}); const r = area.getBoundingClientRect();
            return r.width > 0 ? {x: r.x, y: r.y, width: r.width, height: r.height} : null; }""", key)
        if box:
            break
        page.wait_for_timeout(200)
    assert box, f"chart {key} has no plot area"
    y = box["y"] + box["height"] * 0.5
    page.mouse.move(box["x"] + box["width"] * start, y)
    page.mouse.down()
    for f in (0.25, 0.5, 0.75, 1.0):
        page.mouse.move(box["x"] + box["width"] * (start + (stop - start) * f), y + 2, steps=3)
    page.mouse.up()
