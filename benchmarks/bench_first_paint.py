"""Where the browser's time goes on each dashboard page: first paint in Debian's Chromium.

    python benchmarks/bench_first_paint.py                    # the sample runs, run fault_midrun
    python benchmarks/bench_first_paint.py --root RUNS --run NAME --pages overview pools

One dashboard server (``streamlit run app/main.py``, as the tests start it) on a copy of the runs
root. For each page, twice: in a new browser context (nothing cached: a first visit) and on a
reload of that page. Each visit is timed from navigation to the page fully drawn (the script
finished, no placeholder, every plotly chart rendered: the browser tests' READY), and split into
what the browser can tell apart, from a script injected before the page loads:

- ``html``: navigation to DOMContentLoaded (the app's HTML and JavaScript);
- ``script``: until the page's script first reported ``notRunning`` after running (the server's
  part, seen from the browser: the session, the queries, the elements sent);
- ``draw``: from there to fully drawn (plotly and Vega rendering the elements received);
- ``busy``: the main thread's long tasks (> 50 ms) summed over the visit (JavaScript work);
- the number of plotly charts, Vega charts and layout shapes drawn, and of Vega's "Infinite
  extent" warnings (a chart drawn from empty or all-null data).

The machine's load counts: measure a change before and after, back to back, with the same
command, and say so. Prints one table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from dashboard_server import LAUNCH_ARGS, READY, serve  # noqa: E402
from external_tools import find  # noqa: E402

from mismatch_monitor.app.navigation import PAGES  # noqa: E402

# timestamps (performance.now(), ms) of the script state's changes and the long tasks' total
PROBE = """(() => {
  const t = window.__paint = {states: [], busy: 0};
  try {
    new PerformanceObserver(l => l.getEntries().forEach(e => t.busy += e.duration))
      .observe({type: 'longtask', buffered: true});
  } catch (e) {}
  let last = null;
  const poll = () => {
    const app = document.querySelector('[data-testid="stApp"]');
    const s = app && app.getAttribute('data-test-script-state');
    if (s !== last) { t.states.push([s, performance.now()]); last = s; }
    requestAnimationFrame(poll);
  };
  requestAnimationFrame(poll);
})();"""
COUNTS = """() => ({plotly: document.querySelectorAll('.js-plotly-plot').length,
  vega: document.querySelectorAll('[data-testid="stVegaLiteChart"], .vega-embed').length,
  shapes: [...document.querySelectorAll('.js-plotly-plot')].reduce((n, e) => n + ((e.layout || {}).shapes || []).length, 0),
  dcl: performance.getEntriesByType('navigation')[0]?.domContentLoadedEventEnd ?? null, now: performance.now()})"""


def visit(page, url: str, reload: bool, warnings: list[str]) -> dict[str, float]:  # noqa: ANN001
    """One visit of ``page`` (a Playwright page; ``warnings`` collects its console messages)."""
    warnings.clear()
    t0 = time.perf_counter()
    if reload:
        page.reload()
    else:
        page.goto(url)
    page.wait_for_function(READY, timeout=600_000)
    total = time.perf_counter() - t0
    page.wait_for_timeout(300)                       # a rerun right after the first paint
    page.wait_for_function(READY, timeout=600_000)
    probe = page.evaluate("() => window.__paint")
    counts = page.evaluate(COUNTS)
    ran = [t for (s, t), (prev, _) in zip(probe["states"][1:], probe["states"]) if s == "notRunning"
           and prev == "running"]
    script = (ran[0] if ran else counts["now"]) / 1000.0
    return {"total": total, "html": (counts["dcl"] or 0.0) / 1000.0, "script": script,
            "draw": max(0.0, total - script), "busy": probe["busy"] / 1000.0, "plotly": counts["plotly"],
            "vega": counts["vega"], "shapes": counts["shapes"],
            "infinite": sum("Infinite extent" in w for w in warnings)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT / "sample_data")
    ap.add_argument("--run", default="fault_midrun")
    ap.add_argument("--pages", nargs="*", default=[p.url_path for p in PAGES])
    ap.add_argument("--repeat", type=int, default=1, help="visits of each kind per page (median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    rows: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "w+") as log:
        root = Path(tmp) / "runs"
        shutil.copytree(args.root, root, ignore=shutil.ignore_patterns("writer.lock"))
        for url in serve(root, log):
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
                warm = browser.new_page()              # the server's first session: imports, caches
                warm.goto(f"{url}/?run={args.run}")
                warm.wait_for_function(READY, timeout=600_000)
                warm.close()
                for path in args.pages:
                    got: dict[str, list[dict[str, float]]] = {"new": [], "reload": []}
                    for _ in range(args.repeat):
                        ctx = browser.new_context(viewport={"width": 1400, "height": 2000})
                        ctx.add_init_script(PROBE)
                        page = ctx.new_page()
                        warnings: list[str] = []
                        page.on("console", lambda msg, w=warnings: w.append(msg.text))
                        target = f"{url}/{'' if path == PAGES[0].url_path else path}?run={args.run}"
                        got["new"].append(visit(page, target, False, warnings))
                        got["reload"].append(visit(page, target, True, warnings))
                        ctx.close()
                    rows[path] = {k: {f: statistics.median(v[f] for v in vs) for f in vs[0]} for k, vs in got.items()}
                browser.close()
    print(f"first paint in Chromium, run {args.run}, median of {args.repeat} (s; busy: long tasks)")
    print(f"{'page':<12} {'visit':<7} {'total':>6} {'html':>6} {'script':>7} {'draw':>6} {'busy':>6} "
          f"{'plotly':>6} {'vega':>5} {'shapes':>6} {'inf.ext':>7}")
    for path, kinds in rows.items():
        for kind, r in kinds.items():
            print(f"{path:<12} {kind:<7} {r['total']:6.2f} {r['html']:6.2f} {r['script']:7.2f} {r['draw']:6.2f} "
                  f"{r['busy']:6.2f} {r['plotly']:6.0f} {r['vega']:5.0f} {r['shapes']:6.0f} {r['infinite']:7.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
