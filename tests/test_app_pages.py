"""Every dashboard page under Streamlit's AppTest: on the project's sample runs, on a run with
growing tails and alerts, and on empty and half-written runs. No page may raise; each shows its
expected elements, or an explicit empty state; the headline numbers match an independent float64
reference computed from the very tokens that were logged.

Runtime: about 40 s (the runs are built once, ~10 s; each page run takes 0.1-0.5 s).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from streamlit.testing.v1 import AppTest

from mismatch_monitor.app.navigation import APP_DIR, PAGES, PageSpec
from mismatch_monitor.app.runs import ROOT_ENV, list_runs
from mismatch_monitor.config import MetricConfig
from reference import reference_metrics, token_frame
from test_app_runs import DashboardRoot, dashboard_root

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
PAGE = {p.url_path: p for p in PAGES}
SAMPLE_RUNS = sorted(list_runs(SAMPLE_DATA)) if SAMPLE_DATA.is_dir() else []
EMPTY_KINDS = ("empty", "no-observation", "half-written", "half-written-tail")
CONFIG = MetricConfig()
ALPHA = CONFIG.hist_relative_accuracy


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DashboardRoot:
    return dashboard_root(str(tmp_path_factory.getbasetemp() / "dashboard"))


def open_page(monkeypatch: pytest.MonkeyPatch, root: Path, page: PageSpec, run: str | None,
              **params: str) -> AppTest:
    monkeypatch.setenv(ROOT_ENV, str(root))
    at = AppTest.from_file(str(APP_DIR / "main.py"), default_timeout=60)
    at.query_params.update(params, **({"run": run} if run is not None else {}))
    at.run()
    if page.file != PAGES[0].file:
        at.switch_page(page.file).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at: AppTest) -> list:
    return at.get("plotly_chart")


def headline(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def number(text: str) -> float:
    """A displayed value back as a float ("12.5%" -> 0.125, "1,234" -> 1234)."""
    text = text.replace(",", "").strip()
    if text.endswith("%"):
        return float(text[:-1]) / 100.0
    return float(text)


def close(shown: str, want: float, rel: float) -> bool:
    """``shown`` equals ``want`` within ``rel``, or within the rounding of the digits shown."""
    text = shown.replace(",", "").strip()
    decimals = len(text.rstrip("%").partition(".")[2]) if "e" not in text else 0
    rounding = 0.5 * 10.0 ** -decimals / (100.0 if text.endswith("%") else 1.0) if "e" not in text else 0.0
    return math.isclose(number(shown), want, rel_tol=rel, abs_tol=max(1e-12, rounding * 1.0001))


# what each page shows on a run with observations: (charts at least, dataframes at least)
EXPECTED = {"overview": (1, 2), "pools": (2, 2), "tails": (3, 0), "lowprob": (4, 1), "length-turn": (3, 1),
            "routing": (2, 0), "corrections": (1, 1), "alerts": (2, 1), "compare": (2, 1), "exemplars": (0, 2),
            "runs": (1, 1)}


@pytest.mark.parametrize("page", PAGES, ids=[p.url_path for p in PAGES])
def test_every_page_lays_out_a_run_with_growing_tails(monkeypatch, runs: DashboardRoot, page: PageSpec) -> None:
    at = open_page(monkeypatch, runs.root, page, "fleet")
    assert at.title[0].value == page.title
    assert not at.error or page.url_path == "overview"   # the overview lists firing alerts as errors
    n_charts, n_frames = EXPECTED[page.url_path]
    assert len(charts(at)) >= n_charts
    assert len(at.dataframe) >= n_frames
    assert at.sidebar.selectbox(key="run").value == "fleet"


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_every_page_has_an_explicit_empty_state(monkeypatch, runs: DashboardRoot, kind: str) -> None:
    """One session walks every page of an empty or half-written run."""
    at = open_page(monkeypatch, runs.root, PAGES[0], kind)
    for page in PAGES:
        at.switch_page(page.file).run()
        assert not at.exception, (page.url_path, [e.value for e in at.exception])
        assert at.title[0].value == page.title
        if kind == "half-written-tail":  # one committed flush: the orphan files of the next are ignored
            steps = re.search(r"steps (\d+)–(\d+)", " ".join(c.value for c in at.caption))
            assert steps is not None and steps.groups() == ("0", "5"), page.url_path
            continue
        assert not charts(at), page.url_path
        assert at.info, f"{page.url_path}: an empty run must say why the page is empty"


@pytest.mark.parametrize("page", PAGES, ids=[p.url_path for p in PAGES])
def test_every_page_opens_the_sample_data_with_no_setup(monkeypatch, page: PageSpec) -> None:
    if not SAMPLE_RUNS:  # sample_data/ without runs: the page says so instead of failing
        at = open_page(monkeypatch, SAMPLE_DATA, page, None)
        assert any("No run to show" in i.value for i in at.info)
        return
    for run in SAMPLE_RUNS:
        at = open_page(monkeypatch, SAMPLE_DATA, page, run)
        assert at.title[0].value == page.title
        assert at.sidebar.selectbox(key="run").value == run


def test_overview_headline_numbers_match_an_independent_reference(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[0], "fleet")
    last = max(runs.fleet.cases)
    fleet = reference_metrics(runs.fleet.cases[last], CONFIG, by=[]).iloc[0]
    shown = headline(at)
    assert close(shown["k3 KL"], fleet["mismatch/k3_kl"], 5e-4)
    assert close(shown["max |lr|"], fleet["mismatch/abs_log_ratio/max"], 5e-4)
    assert close(shown["ESS"], fleet["mismatch/ess"], 5e-4)
    assert close(shown["extreme share"], fleet["mismatch/extreme_fraction"], 5e-4)
    # quantiles come from the log histogram: within its relative accuracy (plus display rounding)
    assert close(shown["p99 |lr|"], fleet["mismatch/abs_log_ratio/p99"], ALPHA + 5e-4)
    pools = reference_metrics(runs.fleet.cases[last], CONFIG, by=["pool"]).set_index("pool")
    assert close(shown["routing flip rate"], fleet["mismatch/routing/flip_rate"], 5e-4)
    table = next(d.value for d in at.dataframe if "routing flip rate" in d.value.columns)   # per pool
    for pool, row in pools.iterrows():
        assert close(table.loc[table["pool"] == pool, "routing flip rate"].item(), row["mismatch/routing/flip_rate"],
                     5e-4)
    assert f"Fleet at step {last}" in [h.value for h in at.subheader]


def test_overview_lists_the_alerts_firing_at_the_end_of_the_run(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[0], "fleet")
    state: dict[tuple[str, str], str] = {}
    for event in runs.fleet.events:
        state[(event["alert"], event["pool"])] = event["state"]
    firing = sorted(k for k, v in state.items() if v == "firing")
    table = at.dataframe[1].value          # what changed: firing first, then recently resolved
    now = table[table["state"] == "firing"]
    assert sorted(zip(now["alert"], now["pool"])) == firing
    assert list(table["state"]) == sorted(table["state"], key=lambda v: v != "firing")
    assert at.error[0].value == f"{len(firing)} alert(s) firing"


def test_pools_page_shows_each_pools_share_of_samples_and_of_the_tail(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[1], "fleet")
    per_step = [reference_metrics(c, CONFIG, by=["pool"]) for c in runs.fleet.cases.values()]
    ref = pd.concat(per_step)
    ref["n_extreme"] = ref["mismatch/extreme_fraction"] * ref["mismatch/n_tokens"]
    totals = ref.groupby("pool")[["mismatch/seq/n_sequences", "n_extreme"]].sum()
    shares = at.dataframe[0].value.set_index("pool")
    for pool, row in totals.iterrows():
        assert shares.loc[pool, "share of samples"] == pytest.approx(
            row["mismatch/seq/n_sequences"] / totals["mismatch/seq/n_sequences"].sum(), rel=1e-12)
        assert shares.loc[pool, "share of extreme-ratio tokens"] == pytest.approx(row["n_extreme"] / totals["n_extreme"].sum(),
                                                                  rel=1e-9)
        assert shares.loc[pool, "precision"] == pool          # pool metadata from run.json


def test_length_page_gives_the_crossing_length_of_each_pool(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[4], "fleet")
    last = max(runs.fleet.cases)
    frame, _ = token_frame(runs.fleet.cases[last], CONFIG)
    table = at.dataframe[0].value.set_index("pool")
    for pool, g in frame[frame["valid"]].groupby("pool"):
        want = math.log(CONFIG.tis_cap) / np.mean(np.abs(g["lr"].to_numpy()))
        assert close(table.loc[pool, "T* (tokens)"], want, 5e-4)


def test_alerts_page_counts_every_event_and_resync(monkeypatch, runs: DashboardRoot) -> None:
    events = runs.fleet.events
    # an alert the run raised, named in the URL (the last in name order: not the page's default)
    chosen = sorted({e["alert"] for e in events if e["state"] == "firing"})[-1]
    at = open_page(monkeypatch, runs.root, PAGES[7], "fleet", alerts_alert=chosen)
    shown = headline(at)
    assert number(shown["alert events"]) == len(events)
    assert number(shown["resync triggers"]) == sum(e["state"] == "firing" and e["resync"] for e in events)
    assert any(h.value.startswith(f"{chosen} on ") for h in at.subheader)
    assert len(at.dataframe[0].value) == len(events)


def test_exemplars_page_ranks_the_worst_token_of_the_step_first(monkeypatch, runs: DashboardRoot) -> None:
    step = 12
    at = open_page(monkeypatch, runs.root, PAGE["exemplars"], "fleet", step=str(step))
    frame, _ = token_frame(runs.fleet.cases[step], CONFIG)
    tokens = at.dataframe[0].value
    assert tokens["abs log ratio"].iloc[0] == pytest.approx(np.nanmax(np.abs(frame["lr"])), rel=1e-12)
    assert list(tokens["abs log ratio"]) == sorted(tokens["abs log ratio"], reverse=True)


def test_compare_page_flags_the_pool_the_upgrade_changed(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGE["compare"], "fleet", cmp_run="fleet-upgrade", cmp_rel="0.5")
    table = at.dataframe[0].value.rename(columns={"A: fleet": "a", "B: fleet-upgrade": "b", "B / A − 1": "rel"})
    p99 = table[(table["slice"] == "pool=fp8") & (table["metric"] == "p99 |lr|")].iloc[0]
    assert p99["flagged"] == "⚠" and p99["b"] < p99["a"]    # the grown fp8 tail is gone after the upgrade
    assert set(table.loc[table["flagged"] == "", "rel"].abs().dropna()) <= set(
        table["rel"].abs()[table["rel"].abs() < 0.5])


def test_lowprob_page_draws_each_pools_sharpness_contrast_as_the_reference_has_it(monkeypatch, runs: DashboardRoot
                                                                                  ) -> None:
    import plotly.io as pio

    at = open_page(monkeypatch, runs.root, PAGE["lowprob"], "fleet")
    assert any("Sharpness contrast" in s.value for s in at.subheader)
    found = [c for c in charts(at) if c.proto.id.endswith("-lowprob_sharpness")]
    assert len(found) == 1
    fig = pio.from_json(found[0].proto.spec)                 # arrays decoded as the browser does
    from test_dashboard_run_events import array

    drawn = {t.name: dict(zip(array(t.x), array(t.y))) for t in fig.data if t.y is not None}
    checked = 0
    for step, case in runs.fleet.cases.items():
        want = reference_metrics(case, CONFIG, by=["pool"]).set_index("pool")["mismatch/sharpness/contrast_t"]
        for pool, value in want.items():
            got = drawn.get(str(pool), {}).get(step)
            if np.isnan(value):
                assert got is None or np.isnan(got), (step, pool, got)
            else:
                assert math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-12), (step, pool, got, value)
                checked += value != 0.0
    assert checked > 0            # some step has a non-zero contrast to compare


SHARPNESS_FIELDS = ("n_top_p", "sum_dev_top_p", "sum_rho2_top_p", "n_low_p", "sum_dev_low_p", "sum_rho2_low_p")


def test_lowprob_page_says_a_run_written_before_the_sharpness_fields_has_no_contrast(monkeypatch, tmp_path) -> None:
    run = "stable_fleet"
    if run not in SAMPLE_RUNS:
        pytest.skip(f"the sample run {run} is not in sample_data/")
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["lowprob"], run)        # written with them: a contrast
    assert not any("before the sharpness fields" in i.value for i in at.info)
    assert any(c.proto.id.endswith("-lowprob_sharpness") for c in charts(at))
    # the same run as an older version wrote it: its token tables without the sharpness sums
    shutil.copytree(SAMPLE_DATA / run, tmp_path / run)
    for part in [*(tmp_path / run / "tokens").glob("*.parquet"), *(tmp_path / run / "rollups" / "tokens").glob("*.parquet")]:
        table = pq.read_table(part)
        assert set(SHARPNESS_FIELDS) <= set(table.column_names), part
        pq.write_table(table.drop_columns(list(SHARPNESS_FIELDS)), part)
    at = open_page(monkeypatch, tmp_path, PAGE["lowprob"], run)
    assert any("before the sharpness fields" in i.value for i in at.info)
    assert not any(c.proto.id.endswith("-lowprob_sharpness") for c in charts(at))
