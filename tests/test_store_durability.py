"""Crash safety, restarts, concurrent readers and compaction of the run store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.store import compact_run, read_run_info

from synthetic import make_batch

HERE = Path(__file__).parent


def _writer(run: Path, first: int, count: int | None = None, scale: float = 1e-2,
            mode: str = "flush") -> subprocess.Popen:
    args = [sys.executable, str(HERE / "writer_process.py"), str(run), str(first)]
    args += [str(count if count is not None else 10**9), str(scale), mode]
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)


def _wait_flushed(proc: subprocess.Popen, n: int, timeout: float = 120.0) -> list[int]:
    flushed = []
    deadline = time.time() + timeout
    while len(flushed) < n:
        line = proc.stdout.readline()
        assert line, f"writer exited early with {proc.poll()}"
        flushed.append(int(line.split()[1]))
        assert time.time() < deadline, "writer too slow"
    return flushed


def test_sigkill_loses_no_flushed_step_and_restart_appends(tmp_path):
    run = tmp_path / "crashy"
    proc = _writer(run, 0)
    try:
        flushed = _wait_flushed(proc, 8)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # a half-written file of a crashed flush: not a *.parquet name, readers never glob it
    (run / "tokens" / ".part-99999999999999999999.parquet.123.tmp").write_bytes(b"PAR1 garbage")
    # an orphan data file (its flush died before the index): ignored by every reader
    orphan = sorted((run / "tokens").glob("*.parquet"))[0].read_bytes()
    (run / "tokens" / "part-00000000000000000001.parquet").write_bytes(orphan)

    con = query.connect()
    steps = query.steps_index(con, run)
    assert set(flushed) <= set(steps["step"])          # every acknowledged step survived
    assert steps["step"].tolist() == list(range(len(steps)))
    series = query.metric_series(con, run, ["pool"], metrics=["mismatch/k3_kl"])
    assert set(series["step"]) == set(steps["step"])
    assert series.groupby("step").size().eq(3).all()   # the orphan did not add rows
    info = read_run_info(run)
    assert info["closed_at"] is None

    last = int(steps["step"].max())
    done = _writer(run, last + 1, 3)
    assert done.wait(timeout=120) == 0
    steps2 = query.steps_index(con, run)
    assert steps2["step"].tolist() == list(range(last + 4))
    info = read_run_info(run)
    assert len(info["restarts"]) == 1 and info["closed_at"] is not None


def test_sigkill_during_background_flushes_leaves_only_whole_steps(tmp_path):
    run = tmp_path / "crashy-bg"
    proc = _writer(run, 0, mode="background")
    try:
        logged = _wait_flushed(proc, 12)                # a flush is due at every step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    con = query.connect()
    steps = query.steps_index(con, run)
    assert len(steps) >= 1
    assert steps["step"].tolist() == list(range(len(steps)))   # a prefix, in order: no gap
    assert int(steps["step"].max()) <= max(logged) + 1
    series = query.metric_series(con, run, ["pool"], metrics=["mismatch/n_tokens"])
    assert set(series["step"]) == set(steps["step"])
    assert series.groupby("step").size().eq(3).all()         # every visible step is whole
    totals = series.groupby("step")["mismatch/n_tokens"].sum()
    for step, n in totals.items():
        assert n == int(compute_stats(make_batch(step, sequences=12, max_len=24))["tokens"]["n_tokens"].sum())
    last = int(steps["step"].max())
    done = _writer(run, last + 1, 3)                    # a restart appends after the last whole step
    assert done.wait(timeout=120) == 0
    assert query.steps_index(con, run)["step"].tolist() == list(range(last + 4))


def test_relogged_steps_latest_write_wins(tmp_path):
    run = tmp_path / "relog"
    with MismatchCollector(run, flush_every_steps=2) as mc:
        for s in range(5):
            mc.log_step(s, make_batch(s, scale=1e-2))
    with MismatchCollector(run, flush_every_steps=2) as mc:       # a restart from a checkpoint
        for s in range(3, 7):
            mc.log_step(s, make_batch(s, seed=7, scale=0.1))
    con = query.connect()
    got = query.metric_series(con, run, metrics=["mismatch/k3_kl", "mismatch/n_tokens"])
    assert got["step"].tolist() == list(range(7))
    for s in range(7):
        b = make_batch(s, scale=1e-2) if s < 3 else make_batch(s, seed=7, scale=0.1)
        st = compute_stats(b)
        want = st["tokens"]["sum_k3"].sum() / st["tokens"]["n_tokens"].sum()
        assert got.loc[got.step == s, "mismatch/k3_kl"].item() == pytest.approx(want, rel=1e-12)


def _reader_loop(run: Path, stop: threading.Event, errors: list, seen: list, expect_rows: int) -> None:
    con = query.connect()
    while not stop.is_set():
        try:
            df = query.metric_series(con, run, ["pool"], metrics=["mismatch/k3_kl", "mismatch/n_tokens"])
            if len(df):
                per_step = df.groupby("step").size()
                if not per_step.eq(expect_rows).all():
                    errors.append(f"a step seen with {per_step.unique()} rows")
                seen.append(int(df["step"].max()))
        except (duckdb.Error, OSError, ValueError) as exc:  # any reader failure counts
            errors.append(repr(exc))


def test_reader_while_writer_appends_sees_no_error(tmp_path):
    run = tmp_path / "live"
    MismatchCollector(run).close()
    stop, errors, seen = threading.Event(), [], []
    reader = threading.Thread(target=_reader_loop, args=(run, stop, errors, seen, 3))
    reader.start()
    proc = _writer(run, 0, 25, mode="background")     # flushes on the writer's thread
    try:
        assert proc.wait(timeout=180) == 0
    finally:
        stop.set()
        reader.join(timeout=60)
    assert errors == []
    assert len(seen) > 5 and seen == sorted(seen)       # progress only moves forward
    assert query.steps_index(query.connect(), run)["step"].tolist() == list(range(25))


def test_compaction_under_readers_never_shows_a_step_twice_or_not_at_all(tmp_path):
    run = tmp_path / "compact"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        for s in range(12):
            mc.log_step(s, make_batch(s, sequences=12, max_len=24))
    con = query.connect()
    before = query.metric_series(con, run, ["pool"])
    stop, errors, seen = threading.Event(), [], []
    reader = threading.Thread(target=_reader_loop, args=(run, stop, errors, seen, 3))
    reader.start()
    try:
        time.sleep(0.2)
        removed = compact_run(run)
        time.sleep(0.2)
    finally:
        stop.set()
        reader.join(timeout=60)
    assert errors == []
    assert removed["tokens"] == 12 and removed["steps"] == 12
    assert len(list((run / "tokens").glob("*.parquet"))) == 1
    after = query.metric_series(con, run, ["pool"])
    assert before[["step", "pool", "mismatch/n_tokens"]].equals(after[["step", "pool", "mismatch/n_tokens"]])
    # SQL sums may add cells in another order: equal to float tolerance
    metric_cols = [c for c in before.columns if c.startswith("mismatch/")]
    np.testing.assert_allclose(after[metric_cols].to_numpy(np.float64), before[metric_cols].to_numpy(np.float64),
                               rtol=1e-12, atol=1e-15, equal_nan=True)
    # a compacted run keeps appending, and compacts again
    with MismatchCollector(run, flush_every_steps=1) as mc:
        mc.log_step(12, make_batch(12))
    compact_run(run)
    assert query.steps_index(con, run)["step"].tolist() == list(range(13))


def test_repeated_compaction_while_a_writer_appends_and_readers_read(tmp_path):
    """Compactions race a live writer and a reader: every visible step shows its 3 pools once,
    visible steps never go backwards, and nothing a reader runs fails."""
    run = tmp_path / "busy"
    MismatchCollector(run).close()
    stop, errors, seen = threading.Event(), [], []
    reader = threading.Thread(target=_reader_loop, args=(run, stop, errors, seen, 3))
    reader.start()
    proc = _writer(run, 0, 30)
    compactions = 0
    try:
        while proc.poll() is None:
            compact_run(run)
            compactions += 1
        assert proc.wait(timeout=180) == 0
        compact_run(run)
    finally:
        stop.set()
        reader.join(timeout=60)
    assert errors == []
    assert compactions >= 3 and seen == sorted(seen)
    steps = query.steps_index(query.connect(), run)["step"].tolist()
    assert steps == list(range(30))
