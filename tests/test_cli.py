"""The CLI on a real run: summary, export and compact, and their errors."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import pytest

from mismatch_monitor import query
from mismatch_monitor.cli import main
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.store.schema_doc import render

from synthetic import make_batch


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    pools = {"bf16": {"hardware": "H100", "precision": "bf16"}, "fp8": {"hardware": "H100", "precision": "fp8"}}
    with MismatchCollector(run, pools=pools, flush_every_steps=2) as mc:
        for s in range(4):
            mc.log_step(s, make_batch(s))
    return run


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_summary_shows_latest_step_per_pool(run):
    code, out = _run("summary", str(run))
    assert code == 0
    latest = query.latest(query.connect(), run, ["pool"]).set_index("pool")
    assert "latest step 3, per pool:" in out
    assert "bf16 [H100/bf16]" in out and "stale" in out
    k3 = latest.loc["fp8", "mismatch/k3_kl"]
    fp8_line = next(line for line in out.splitlines() if line.startswith("fp8"))
    assert f"{k3:.3g}" in fp8_line
    assert "worst slices at step 3" in out


def test_summary_names_an_empty_pool_name_as_the_labels_write_it(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        mc.log_step(0, make_batch(0, pools=("", "bf16")))
    code, out = _run("summary", str(run))
    assert code == 0
    rows = out.split("per pool:")[1].splitlines()
    assert any(line.startswith("%empty ") for line in rows), out
    assert "pool=%empty len>=" in out and "pool= " not in out, out


def test_export_csv_equals_query_layer(run, tmp_path):
    target = tmp_path / "k3.csv"
    code, _ = _run("export", str(run), "--metric", "k3_kl", "--metric", "abs_log_ratio/p99",
                   "--by", "pool", "-o", str(target))
    assert code == 0
    got = pd.read_csv(target)
    want = query.metric_series(query.connect(), run, ["pool"],
                               metrics=["mismatch/k3_kl", "mismatch/abs_log_ratio/p99"])
    assert list(got.columns) == list(want.columns)
    pd.testing.assert_series_equal(got["mismatch/k3_kl"], want["mismatch/k3_kl"], rtol=1e-12)
    code, _ = _run("export", str(run), "--metric", "ess", "--format", "parquet", "-o", str(tmp_path / "e.parquet"))
    assert code == 0 and len(pd.read_parquet(tmp_path / "e.parquet")) == 4


def test_errors_are_clear(run, tmp_path, capsys):
    assert main(["summary", str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(run), "--metric", "not_a_metric"])
    assert "unknown metric 'not_a_metric'" in capsys.readouterr().err
    assert main(["export", str(run), "--metric", "k3_kl", "--by", "pool; DROP TABLE x"]) == 2
    assert "--by pool; DROP TABLE x: not a label or bucket of this run" in capsys.readouterr().err


def test_compact_keeps_the_summary(run):
    _, before = _run("summary", str(run))
    code, out = _run("compact", str(run))
    assert code == 0 and "file(s) merged" in out
    _, after = _run("summary", str(run))
    assert before.splitlines()[1:] == after.splitlines()[1:]


def test_empty_run_summary(tmp_path):
    MismatchCollector(tmp_path / "e").close()
    code, out = _run("summary", str(tmp_path / "e"))
    assert code == 0 and "no observations yet" in out


def test_schema_doc_is_current():
    doc = Path(__file__).parents[1] / "docs" / "SCHEMA.md"
    assert doc.read_text() == render(), "run: python -m mismatch_monitor.store.schema_doc > docs/SCHEMA.md"


def _listening_socket() -> socket.socket:
    """A real server socket on 127.0.0.1 (listening, as another dashboard's would be)."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mismatch_monitor.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_demo_refuses_a_dashboard_port_in_use(tmp_path):
    with _listening_socket() as held:
        port = held.getsockname()[1]
        result = _cli("demo", "--steps", "2", "--variant", "dense", "--warmstart-steps", "2", "--quiet",
                      "--no-alerts", "--runs-root", str(tmp_path), "--dashboard", "--dashboard-port", str(port))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "dashboard on http" not in result.stdout          # never claims a dashboard it has not got
    assert not any(tmp_path.iterdir())                        # refused before the run started


def test_dashboard_refuses_a_port_in_use(tmp_path):
    with _listening_socket() as held:
        port = held.getsockname()[1]
        result = _cli("dashboard", str(tmp_path), "--port", str(port), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr


def test_dashboard_port_zero_serves_on_the_free_port_it_prints(tmp_path):
    from mismatch_monitor.cli.dashboard import claim_port

    with _listening_socket() as held:
        with pytest.raises(ValueError, match="is in use"):
            claim_port("127.0.0.1", held.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "mismatch_monitor.cli", "dashboard", str(tmp_path), "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        assert port != 0
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    assert r.read() == b"ok"
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the dashboard did not come up"
                time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGTERM)             # the CLI stops its streamlit child
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)       # the process group this test started
            proc.wait()


def test_export_by_step_and_internal_columns_are_refused(run, capsys):
    assert main(["export", str(run), "--metric", "k3_kl", "--by", "step"]) == 2
    err = capsys.readouterr().err
    assert "--by step: every row is one step already" in err
    for internal in ("file_id", "write_id"):
        assert internal not in err                               # never offered as a choice
        assert main(["export", str(run), "--metric", "k3_kl", "--by", internal]) == 2
        assert f"--by {internal}: not a label or bucket of this run" in capsys.readouterr().err
    assert main(["export", str(run), "--metric", "k3_kl", "--by", "pool", "--by", "pool"]) == 2
    assert "names a column twice" in capsys.readouterr().err


def test_export_steps_reversed_is_an_error_and_an_empty_range_is_said(run, capsys):
    assert main(["export", str(run), "--metric", "k3_kl", "--steps", "3", "1"]) == 2
    assert "--steps 3 1: expected FIRST <= LAST" in capsys.readouterr().err
    assert main(["export", str(run), "--metric", "k3_kl", "--steps", "50", "60"]) == 0
    captured = capsys.readouterr()
    assert "no observations in steps 50..60 (the run has steps 0..3)" in captured.err
    assert captured.out.strip() == "step,wall_time,mismatch/k3_kl"


def test_export_bad_output_path_is_a_clear_error(run, tmp_path):
    for target, says in ((tmp_path / "missing" / "k3.csv", "does not exist"), (tmp_path, "is a directory")):
        result = _cli("export", str(run), "--metric", "k3_kl", "-o", str(target), timeout=60)
        assert result.returncode == 2, result.stderr
        assert says in result.stderr and "Traceback" not in result.stderr
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    if os.access(readonly, os.W_OK):
        return                                     # root writes anywhere: nothing more to check
    result = _cli("export", str(run), "--metric", "k3_kl", "-o", str(readonly / "k3.csv"), timeout=60)
    assert result.returncode == 2 and "cannot write --output" in result.stderr, result.stderr


def test_every_export_and_summary_option_has_help():
    from mismatch_monitor.cli import build_parser

    for command in ("export", "summary"):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        missing = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert not missing, (command, missing)


def test_export_total_merges_the_steps_from_sums(run, tmp_path):
    target = tmp_path / "total.csv"
    assert main(["export", str(run), "--metric", "k3_kl", "--by", "pool", "--total", "--steps", "1", "3",
                 "-o", str(target)]) == 0
    got = pd.read_csv(target).set_index("pool")["mismatch/k3_kl"]
    cells = _token_cells(run)
    cells = cells[cells["step"].between(1, 3)].groupby("pool")[["sum_k3", "n_tokens"]].sum()
    pd.testing.assert_series_equal(got.sort_index(), (cells["sum_k3"] / cells["n_tokens"]).sort_index(),
                                   check_names=False, rtol=1e-12)


def _token_cells(run_dir: Path) -> pd.DataFrame:
    """The stored token cells, read straight from the Parquet files (one write per step here)."""
    frames = [pd.read_parquet(f) for f in sorted((run_dir / "tokens").glob("*.parquet"))]
    cells = pd.concat(frames, ignore_index=True)
    assert not cells.duplicated(["step", "pool", "length_bucket", "turn_bucket"]).any()
    return cells


def test_summary_window_merges_the_last_steps_from_sums(tmp_path):
    run_dir = tmp_path / "window"
    with MismatchCollector(run_dir, flush_every_steps=100) as mc:
        for s in range(6):
            mc.log_step(s, make_batch(s))
    code, out = _run("summary", str(run_dir), "--window", "3")
    assert code == 0
    assert "last 3 steps (steps 3..5), per pool, merged from their sums:" in out
    assert "worst slices over steps 3..5" in out
    cells = _token_cells(run_dir)
    fp8 = cells[(cells["pool"] == "fp8") & cells["step"].between(3, 5)]
    merged = fp8["sum_k3"].sum() / fp8["n_tokens"].sum()
    per_step = fp8.groupby("step")[["sum_k3", "n_tokens"]].sum()
    mean_of_steps = float((per_step["sum_k3"] / per_step["n_tokens"]).mean())
    assert f"{merged:.3g}" != f"{mean_of_steps:.3g}"         # the two readings differ here
    fp8_line = next(line for line in out.splitlines() if line.startswith("fp8"))
    assert fp8_line.split()[1:3] == [f"{fp8['n_tokens'].sum():.0f}", f"{merged:.3g}"]
    p99 = query.metric_series(query.connect(), run_dir, ["pool"], steps=(3, 5), per_step=False,
                              metrics=["mismatch/abs_log_ratio/p99"]).set_index("pool")
    assert f"{p99.loc['fp8', 'mismatch/abs_log_ratio/p99']:.3g}" in fp8_line
    assert main(["summary", str(run_dir), "--window", "0"]) == 2
