"""Page state in the URL, runs confined to the runs root, live runs refreshed in place, and the
``mismatch-monitor dashboard`` command line. Runtime: about 10 s (plus the shared runs, ~10 s)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mismatch_monitor.app import data
from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.cli import build_parser, main
from mismatch_monitor.cli.dashboard import streamlit_command
from mismatch_monitor.store import compact_run
from test_app_pages import headline, open_page
from test_app_runs import DashboardRoot, dashboard_root, fleet_case


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DashboardRoot:
    return dashboard_root(str(tmp_path_factory.getbasetemp() / "dashboard"))


def test_a_shared_url_reopens_the_same_view(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[1], "fleet-upgrade", x="wall time", smooth="0.5",
                   window="last 100", pools_metrics=["k3 KL", "ESS"])   # options by their label
    side = at.sidebar
    assert side.selectbox(key="run").value == "fleet-upgrade"
    assert side.selectbox(key="window").value == "last 100"
    assert side.slider(key="smooth").value == pytest.approx(0.5)
    assert at.multiselect(key="pools_metrics").value == ["mismatch/k3_kl", "mismatch/ess"]
    spec = at.get("plotly_chart")[1].proto.spec
    assert "wall time (UTC)" in spec and "(raw)" in spec          # time axis; raw line under the smoothed one
    assert at.query_params["run"] == "fleet-upgrade" and at.query_params["smooth"] == "0.5"


def test_a_page_control_redraws_the_page(monkeypatch, runs: DashboardRoot) -> None:
    # the browser writes a changed control into the URL (see test_dashboard_browser.py)
    at = open_page(monkeypatch, runs.root, PAGES[2], "fleet")
    at.selectbox(key="tails_pool").set_value("fp8").run()
    assert at.subheader[0].value == "|log ρ| histogram over steps · fp8"
    at.sidebar.selectbox(key="run").set_value("fleet-upgrade").run()
    assert "Run **fleet-upgrade**" in " ".join(c.value for c in at.caption)


@pytest.mark.parametrize("requested", ["../outside", "/etc", "fleet/../../.."])
def test_a_run_outside_the_root_is_refused_with_a_clear_message(monkeypatch, runs: DashboardRoot,
                                                                 requested: str) -> None:
    at = open_page(monkeypatch, runs.root, PAGES[0], requested)
    refusals = [e.value for e in at.error if "outside the runs root" in e.value]
    assert len(refusals) == 1 and "refused to open" in refusals[0]
    assert at.sidebar.selectbox(key="run").value != requested     # another run is shown instead


def test_a_run_nested_under_the_root_can_be_opened_by_path(monkeypatch, runs: DashboardRoot, tmp_path) -> None:
    nested = runs.root / "team" / "exp"
    if not nested.exists():
        shutil.copytree(runs.upgrade.path, nested)
    at = open_page(monkeypatch, runs.root, PAGES[0], "team/exp")
    assert at.sidebar.selectbox(key="run").value == "team/exp"
    assert not [e for e in at.error if "refused" in e.value]
    missing = open_page(monkeypatch, runs.root, PAGES[0], "team/none")
    assert any("not a run" in e.value for e in missing.error)


def test_a_live_run_refreshes_when_its_files_change(monkeypatch, runs: DashboardRoot) -> None:
    live = runs.live
    at = open_page(monkeypatch, runs.root, PAGES[0], "live")
    assert at.sidebar.caption[0].value == "● live"
    shown = [h.value for h in at.subheader if h.value.startswith("Fleet at step")]
    step = int(shown[0].rsplit(" ", 1)[1]) + 1
    k3 = headline(at)["k3 KL"]
    live.log_step(step, fleet_case(step, 3, 1.5).batch())   # not yet flushed: not visible
    at.run()
    assert f"Fleet at step {step - 1}" in [h.value for h in at.subheader]
    live.flush()                                            # the flush makes it visible
    at.run()
    assert f"Fleet at step {step}" in [h.value for h in at.subheader]
    assert headline(at)["k3 KL"] != k3


def test_the_cache_key_changes_on_flush_and_compaction(runs: DashboardRoot, tmp_path: Path) -> None:
    run = tmp_path / "copy"
    shutil.copytree(runs.fleet.path, run)
    before = data.fingerprint(run)
    assert before == data.fingerprint(run)                          # stable while nothing changes
    compact_run(run)
    after = data.fingerprint(run)
    assert after != before and len(after) < len(before)
    (run / "tokens" / "part-x.parquet").write_bytes(b"orphan")      # data without an index: same view
    assert data.fingerprint(run) == after


def test_dashboard_command_binds_loopback_without_telemetry(tmp_path: Path) -> None:
    args = build_parser("dashboard").parse_args(["dashboard", str(tmp_path)])
    assert (args.address, args.port) == ("127.0.0.1", 8501)
    cmd = streamlit_command(tmp_path, port=8765, address=args.address, python="python")
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert cmd[:4] == ["python", "-m", "streamlit", "run"] and cmd[4].endswith("app/main.py")
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.port"] == "8765"
    assert flags["--browser.gatherUsageStats"] == "false" and flags["--server.headless"] == "true"
    assert cmd[-3:] == ["--", "--runs-root", str(tmp_path)]


def test_dashboard_command_refuses_a_missing_runs_root(tmp_path: Path, capsys) -> None:
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
