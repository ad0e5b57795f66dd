"""The Exemplars page opened from a link (?run=&step=&pool=), in a real Chromium: the chosen step's
stored tokens of that pool drawn as spans coloured by |log ρ|, each with its value.

Runtime: about 20 s (server start ~5 s, one page visit).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Iterator

import duckdb
import numpy as np
import pytest

from external_tools import find, needs
from mismatch_monitor import query

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, LAUNCH_ARGS, serve, wait_drawn  # noqa: E402

RUN = Path(__file__).resolve().parent.parent / "sample_data" / "fault_midrun"
pytestmark = [pytest.mark.timeout(300), needs("chromium"),
              pytest.mark.skipif(not RUN.is_dir(), reason="the sample run fault_midrun is not in sample_data/")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exemplars") / "runs"
    shutil.copytree(RUN, root / RUN.name)
    return root


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+") as log:
        yield from serve(root, log)


def _browser_page(pw):
    """A headless Chromium and a tall page of it (every test here reads the whole app)."""
    b = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
    return b, b.new_context(viewport={"width": 1400, "height": 2000}).new_page()


def test_link_opens_coloured_tokens_of_step_and_pool(server: str, root: Path) -> None:
    files = str(root / RUN.name / "exemplar_tokens" / "*.parquet")
    # a middle step and the pool of its worst token, read from the Parquet files, not through the app
    step, pool = duckdb.sql(f"""select step, arg_max(pool, abs_log_ratio) from read_parquet('{files}')
                                group by step order by step""").fetchall()[5]
    stored = {round(v, 9) for (v,) in duckdb.sql(
        f"select abs_log_ratio from read_parquet('{files}') where step = {step} and pool = '{pool}'").fetchall()}
    with sync_api.sync_playwright() as pw:
        b, page = _browser_page(pw)
        page.goto(f"{server}/exemplars?run={RUN.name}&step={step}&pool={pool}")
        wait_drawn(page)
        page.locator(".mm-token").first.wait_for(timeout=60_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "exemplars_tokens.png"), full_page=True)
        text = page.locator('[data-testid="stApp"]').inner_text()
        spans = page.locator(".mm-token").evaluate_all(
            "els => els.map(e => [Number(e.dataset.absLr), getComputedStyle(e).backgroundColor, e.title])")
        errors = page.locator('[data-testid="stException"]').count()
        b.close()
    assert errors == 0
    assert f"Tokens of a sequence at step {step}" in text
    files = str(root / RUN.name / "exemplar_tokens" / "*.parquet")
    (worst,) = duckdb.sql(f"select arg_max(pool, abs_log_ratio) from read_parquet('{files}') where step = {step}"
                          ).fetchall()[0]
    assert pool == worst                         # the link opens the pool of the step's worst token
    values = [round(v, 9) for v, _, _ in spans]
    assert values and set(values) <= stored                       # only that step's and pool's tokens
    assert max(values) == max(stored)                             # its worst sequence is the one shown
    assert all(c.startswith("rgb(") and c != "rgba(0, 0, 0, 0)" for _, c, _ in spans)   # coloured
    assert all("|log ρ| = " in t for _, _, t in spans)


def test_pools_page_links_a_worst_step_to_its_exemplars(server: str, root: Path) -> None:
    with sync_api.sync_playwright() as pw:
        b, page = _browser_page(pw)
        page.goto(f"{server}/pools?run={RUN.name}")
        wait_drawn(page)
        link = page.locator('a[href*="exemplars?run="]').first
        link.wait_for(timeout=60_000)
        href = link.get_attribute("href")
        step = int(href.split("step=")[1].split("&")[0])
        pool = href.split("pool=")[1].split("&")[0]
        page.goto(f"{server}/{href.lstrip('/')}")
        wait_drawn(page)
        page.locator(".mm-token").first.wait_for(timeout=60_000)
        text = page.locator('[data-testid="stApp"]').inner_text()
        b.close()
    assert f"Tokens of a sequence at step {step}" in text
    files = str(root / RUN.name / "exemplar_tokens" / "*.parquet")
    (worst,) = duckdb.sql(f"select arg_max(pool, abs_log_ratio) from read_parquet('{files}') where step = {step}"
                          ).fetchall()[0]
    assert pool == worst                         # the link opens the pool of the step's worst token


# the page position of point ``i`` of the first subplot's raw trace of ``pool`` (plotly's own axes)
POINT = """([el, pool, i]) => {
  const t = el._fullData.find(t => t.legendgroup === pool && t.xaxis === 'x');
  const xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis, r = el.getBoundingClientRect();
  const x = Array.from(t.x)[i], y = Array.from(t.y)[i];
  return {step: x, x: r.left + xa._offset + xa.c2p(x), y: r.top + ya._offset + ya.c2p(y)};
}"""


def apart(run_dir: Path, pool: str, metric: str = "mismatch/k3_kl") -> int:
    """The step (in 20-99) at which ``pool``'s point of ``metric`` lies farthest, on the log axis,
    from every other pool's: a click there cannot land on another pool's point."""
    wide = query.metric_series(query.connect(), run_dir, ["pool"], metrics=[metric]).pivot(
        index="step", columns="pool", values=metric).loc[20:99]
    logs = np.log10(wide.clip(lower=1e-12))
    gap = logs.drop(columns=pool).sub(logs[pool], axis=0).abs().min(axis=1)
    return int(gap.idxmax())


def test_clicking_a_point_of_the_pools_series_opens_its_step_and_pool(server: str, root: Path) -> None:
    pool = "fp8"
    i = apart(root / RUN.name, pool)              # one bin per step: point i is step i
    with sync_api.sync_playwright() as pw:
        b, page = _browser_page(pw)
        page.goto(f"{server}/pools?run={RUN.name}&refresh=off")
        wait_drawn(page)
        plot = page.locator(".st-key-pools_series .js-plotly-plot").first
        plot.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        at = plot.evaluate(f"el => ({POINT})([el, {pool!r}, {i}])")
        page.mouse.move(at["x"], at["y"])
        page.wait_for_timeout(300)
        page.mouse.click(at["x"], at["y"])
        page.wait_for_function("() => location.pathname.endsWith('/exemplars')", timeout=60_000)
        wait_drawn(page)
        page.locator(".mm-token").first.wait_for(timeout=60_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "exemplars_from_click.png"), full_page=True)
        url = page.url
        spans = page.locator(".mm-token").evaluate_all("els => els.map(e => Number(e.dataset.absLr))")
        b.close()
    step = int(at["step"])
    assert f"step={step}" in url and f"pool={pool}" in url
    files = str(root / RUN.name / "exemplar_tokens" / "*.parquet")
    stored = {round(v, 9) for (v,) in duckdb.sql(
        f"select abs_log_ratio from read_parquet('{files}') where step = {step} and pool = '{pool}'").fetchall()}
    assert stored and spans and {round(v, 9) for v in spans} <= stored   # that step's and pool's tokens


# what a selectbox of the Exemplars page shows chosen, by its widget key
CHOSEN = """key => { const e = document.querySelector(`.st-key-${key} input[role="combobox"]`);
  return e ? e.value.trim() : null; }"""


def _options(page, key: str) -> list[str]:  # noqa: ANN001
    """The options selectbox ``key`` offers (its list opened and closed again)."""
    page.locator(f".st-key-{key} button[aria-label='Open']").click()
    page.locator('[role="option"]').first.wait_for(timeout=30_000)
    texts = page.locator('[role="option"]').all_inner_texts()
    page.keyboard.press("Escape")
    return [t.strip() for t in texts]


def _pick(page, key: str, option: str) -> None:  # noqa: ANN001
    """A user's choice of ``option`` (its shown text) in selectbox ``key``."""
    page.locator(f".st-key-{key} button[aria-label='Open']").click()
    page.locator('[role="option"]', has_text=option).first.click()
    page.wait_for_function(f"() => ({CHOSEN})({key!r}) === {option!r}", timeout=60_000)
    wait_drawn(page)


def test_a_copied_exemplars_url_reopens_the_same_choices(server: str, root: Path) -> None:
    """Step, pool and sequence chosen in the page (none the page's default: the last step, every
    pool, the worst sequence) are in the URL, and that URL opened in a new session shows them."""
    files = str(root / RUN.name / "exemplar_tokens" / "*.parquet")
    step = duckdb.sql(f"select distinct step from read_parquet('{files}') order by step").fetchall()[5][0]
    with sync_api.sync_playwright() as pw:
        b, page = _browser_page(pw)
        page.goto(f"{server}/exemplars?run={RUN.name}&refresh=off&ex_k=64")
        wait_drawn(page)
        page.locator(".st-key-ex_step input").fill(str(step))
        page.locator(".st-key-ex_step input").press("Enter")
        page.wait_for_function(f"() => document.body.innerText.includes('Tokens of a sequence at step {step}')",
                               timeout=60_000)
        wait_drawn(page)
        pool = _options(page, "ex_pool")[-1]
        _pick(page, "ex_pool", pool)
        seq = _options(page, "ex_seq")[-1]
        _pick(page, "ex_seq", seq)
        number = int(seq.split()[1])
        page.wait_for_url(re.compile(rf"[?&]seq={number}(&|$)"), timeout=30_000)
        url = page.url
        chosen = {k: page.evaluate(CHOSEN, k) for k in ("ex_pool", "ex_seq")}
        tokens = page.locator(".mm-token").evaluate_all("els => els.map(e => Number(e.dataset.absLr))")
        fresh = b.new_context(viewport={"width": 1400, "height": 2000}).new_page()   # a new session
        fresh.goto(url)
        wait_drawn(fresh)
        fresh.locator(".mm-token").first.wait_for(timeout=60_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        fresh.screenshot(path=str(ARTIFACTS / "exemplars_copied_url.png"), full_page=True)
        reopened = {k: fresh.evaluate(CHOSEN, k) for k in ("ex_pool", "ex_seq")}
        again = fresh.locator(".mm-token").evaluate_all("els => els.map(e => Number(e.dataset.absLr))")
        step_shown = fresh.locator(".st-key-ex_step input").input_value()
        b.close()
    assert f"step={step}" in url and f"pool={pool}" in url, url
    assert chosen == {"ex_pool": pool, "ex_seq": seq} and pool != "(every pool)"
    assert reopened == chosen and step_shown == str(step), (reopened, step_shown)
    stored = {round(v, 9) for (v,) in duckdb.sql(f"""select abs_log_ratio from read_parquet('{files}')
        where step = {step} and pool = '{pool}' and seq_index = {number}""").fetchall()}
    assert tokens and again == tokens and {round(v, 9) for v in tokens} <= stored   # that sequence's
