"""Fault injection: what a long run on a fleet does to the store, and the exact outcome of each.

A disk that fills (a real tmpfs of a few MB), SIGTERM/SIGINT sent to real processes while they
buffer and while they flush, a pause with steps in memory, a second writer, a dead writer's
lock, a clock an hour behind, a corrupt and a foreign file among good ones, what killed
processes leave, label names that clash with the store's columns, a symlink out of the runs root
and an absurd step range. The statistics are computed with the torch kernel: these tests are
about the store, not the compiled engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_monitor import query
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.store import RunWriter, compact_run
from mismatch_monitor.store.faults import Backoff
from mismatch_monitor.store.health import set_aside
from mismatch_monitor.store.runlock import RunLocked
from mismatch_monitor.store.writer import FlushError

from synthetic import make_batch

CONFIG = MetricConfig(kernel="torch")
HERE = Path(__file__).parent
ENV = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _stats(step: int = 0):
    return compute_stats(make_batch(step, sequences=6, max_len=12), CONFIG)


def _index(run: Path) -> pd.DataFrame:
    return query.steps_index(query.connect(), run)


def _raw_steps(run: Path) -> list[int]:
    return sorted(query.core.raw_index(query.connect(), query.table_files(run, "steps"))["step"].tolist())


# --------------------------------------------------------------------------- a disk that fills


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 6 MiB tmpfs (the tests run as root in CI); its ``fill()`` takes every free byte."""
    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.decode().strip()}")

    class Disk:
        path = disk
        filler = disk / "filler"

        def fill(self) -> None:
            # unbuffered: a buffered file keeps the bytes a short write left and raises at close
            with open(self.filler, "ab", buffering=0) as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                except OSError:
                    pass
            while True:                       # the last partial block too
                try:
                    with open(self.filler, "ab", buffering=0) as fh:
                        fh.write(b"\0" * 512)
                except OSError:
                    break

        def free(self) -> None:
            self.filler.unlink()

    yield Disk()
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _leftovers(run: Path) -> list[str]:
    """Temporary files, and data files no index names (a failed flush's orphans)."""
    indexed = {p.name for p in (run / "steps").glob("*.parquet")}
    tmp = [str(p) for p in run.rglob("*.tmp")]
    orphans = [str(p) for p in run.rglob("part-*.parquet") if p.name not in indexed]
    return tmp + orphans


def test_a_full_disk_keeps_the_newest_steps_up_to_the_bound_counts_the_dropped_and_writes_the_rest_once(
        small_disk, caplog):
    caplog.set_level(logging.WARNING, logger="mismatch_monitor")
    run = small_disk.path / "run"
    stats = _stats()
    writer = RunWriter(run, config=CONFIG, flush_every_steps=5, flush_every_seconds=1e9, background=False,
                       max_buffered_steps=20, retry=Backoff(0.05, 0.2))
    for step in range(5):
        writer.append_step(step, stats, wall_time=float(step))
    assert writer.pending_steps == 0 and writer.take_errors() == []
    small_disk.fill()
    for step in range(5, 55):
        writer.append_step(step, stats, wall_time=float(step))
        time.sleep(0.002)                                   # retries fall due between steps
    assert writer.pending_steps == 20                       # the bound, not 50
    assert writer.dropped_steps == 30
    errors = writer.take_errors()
    assert len(errors) == 1                                 # one report for the whole episode
    assert "No space left on device" in str(errors[0]) and "steps 5-9" in str(errors[0])
    assert _leftovers(run) == []                            # failed writes left no .tmp, no orphan
    small_disk.free()
    assert writer.flush() == 20
    errors = writer.take_errors()
    assert [str(e) for e in errors] == [
        f"30 step(s) (steps 5-34) were dropped while {run} could not be written (the writer keeps at most "
        "max_buffered_steps unwritten steps, the oldest go first)"]
    writer.close()
    assert _index(run)["step"].tolist() == list(range(5)) + list(range(35, 55))
    assert _raw_steps(run) == list(range(5)) + list(range(35, 55))   # each kept step written once
    assert json.loads((run / "run.json").read_text())["dropped_steps"] == 30
    assert [r for r in caplog.records if "writable again" in r.getMessage()] == []   # the error says it


def test_an_episode_without_drops_ends_with_one_line_and_writes_every_step(small_disk, caplog):
    caplog.set_level(logging.WARNING, logger="mismatch_monitor")
    run = small_disk.path / "run"
    writer = RunWriter(run, config=CONFIG, flush_every_steps=2, flush_every_seconds=1e9, background=False,
                       retry=Backoff(0.05, 0.2))
    small_disk.fill()
    for step in range(6):
        writer.append_step(step, _stats(), wall_time=float(step))
    assert writer.pending_steps == 6 and len(writer.take_errors()) == 1
    small_disk.free()
    time.sleep(0.25)
    writer.append_step(6, _stats(), wall_time=6.0)          # due, past the backoff: written
    assert writer.pending_steps == 0 and writer.take_errors() == []
    lines = [r.getMessage() for r in caplog.records if "writable again" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("7 kept step(s) written")
    writer.close()
    assert _raw_steps(run) == list(range(7))


def test_leaving_the_collector_on_a_full_disk_never_raises_and_counts_what_was_lost(small_disk, caplog):
    from mismatch_monitor.collectors import MismatchCollector

    run = small_disk.path / "run"
    after = []
    with MismatchCollector(run, config=CONFIG, flush_every_steps=4, flush_every_seconds=1e9,
                           alert_evaluator=None) as mc:
        for step in range(4):
            mc.log_step(step, make_batch(step, sequences=6, max_len=12))
        mc.flush()
        small_disk.fill()
        for step in range(4, 10):
            mc.log_step(step, make_batch(step, sequences=6, max_len=12))
    after.append("the code after training ran")             # close did not raise
    assert after == ["the code after training ran"]
    assert mc.writer.closed and mc.writer.dropped_steps == 6
    assert mc.error_count == 2                               # the episode's start, and what it lost
    assert "6 step(s) (steps 4-9) were dropped" in mc.last_error and "writer was closed" in mc.last_error
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 2 and "No space left on device" in logged[0] and "were dropped" in logged[1]
    small_disk.free()
    assert _index(run)["step"].tolist() == [0, 1, 2, 3]
    assert _leftovers(run) == []


def test_the_collectors_buffer_bound_is_the_writers(small_disk):
    from mismatch_monitor.collectors import MismatchCollector

    run = small_disk.path / "run"
    with MismatchCollector(run, config=CONFIG, flush_every_steps=2, flush_every_seconds=1e9,
                           max_buffered_steps=3, alert_evaluator=None) as mc:
        small_disk.fill()
        for step in range(8):
            mc.log_step(step, make_batch(step, sequences=4, max_len=8))
        assert mc.writer.pending_steps <= 3
        assert mc.writer.dropped_steps == 5                  # the oldest, counted
        small_disk.free()
    assert _index(run)["step"].tolist() == [5, 6, 7]


def test_exemplar_rows_built_by_failed_flushes_go_with_their_dropped_steps(small_disk):
    from mismatch_monitor.engine import compute_stats_with_sequences
    from mismatch_monitor.exemplars import select_exemplars
    from mismatch_monitor.store.pending import _APPEND

    run = small_disk.path / "run"
    writer = RunWriter(run, config=CONFIG, flush_every_steps=2, flush_every_seconds=1e9, background=False,
                       max_buffered_steps=4, retry=Backoff(0.01, 0.01))
    small_disk.fill()
    for step in range(20):
        batch = make_batch(step, sequences=6, max_len=12)
        stats, per_seq = compute_stats_with_sequences(batch, CONFIG)
        writer.append_step(step, stats, select_exemplars(batch, 4, CONFIG, per_seq))
        time.sleep(0.02)                                       # every due flush is tried, and fails
    pending = writer._queue._pending
    built = {int(a) for entries in pending.buffer.values() for s, _, df in entries
             if s is None and _APPEND in df.columns for a in df[_APPEND]}
    assert built and built <= set(pending.appends)             # no row of a dropped step is held
    assert writer.dropped_steps == 16
    writer.close(raise_errors=False)


def test_ten_thousand_steps_on_a_full_disk_hold_only_the_bound(small_disk):
    run = small_disk.path / "run"
    stats = _stats()
    writer = RunWriter(run, config=CONFIG, flush_every_steps=100, flush_every_seconds=1e9,
                       max_buffered_steps=500, retry=Backoff(0.5, 5.0))
    small_disk.fill()
    for step in range(10_000):
        writer.append_step(step, stats, wall_time=float(step))
    assert writer.pending_steps <= 500
    writer.close(raise_errors=False)
    assert writer.dropped_steps == 10_000
    errors = [str(e) for e in writer.take_errors()]
    assert len(errors) == 2 and "No space left on device" in errors[0]
    assert errors[1].startswith("10000 step(s) (steps 0-9999) were dropped")


# --------------------------------------------------------------------------- signals and pauses

CHILD = """
import os, signal, sys, time, threading
mode, run, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "user-handler":
    def mine(signum, frame):            # ends at once, as some launchers' handlers do
        print("user handler", signum, flush=True)
        os._exit(7)
    signal.signal(signal.SIGTERM, mine)
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.store import flush_files
from synthetic import make_batch
if mode == "slow-flush":       # the background flush takes a while: the signal lands during it
    real = flush_files.write_parquet_atomic
    def slow(table, path):
        if threading.current_thread() is not threading.main_thread():
            open(run + ".flushing", "w").close()
            time.sleep(0.2)
        real(table, path)
    flush_files.write_parquet_atomic = slow
every = 10 if mode == "slow-flush" else 1000
mc = MismatchCollector(run, config=MetricConfig(kernel="torch"), flush_every_steps=every,
                       flush_every_seconds=1e9, alert_evaluator=None)
for step in range(n):
    mc.log_step(step, make_batch(step, sequences=6, max_len=12))
print("ready", mc.writer.pending_steps, flush=True)
time.sleep(120)
"""


def _child(mode: str, run: Path, n: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(run), str(n)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_while_steps_are_buffered_writes_them_then_acts_as_before(tmp_path, sig, code):
    run = tmp_path / "run"
    proc = _child("buffering", run, 12)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == code           # ended by the signal, as without the monitor
    assert _index(run)["step"].tolist() == list(range(12))


def test_sigterm_during_a_flush_waits_for_it_and_writes_the_rest(tmp_path):
    run = tmp_path / "run"
    proc = _child("slow-flush", run, 15)            # steps 0-9 flushing in the background, 10-14 buffered
    deadline = time.monotonic() + 60
    while not Path(str(run) + ".flushing").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert _index(run)["step"].tolist() == list(range(15))
    assert _raw_steps(run) == list(range(15))


SYNC_FLUSH = """
import sys, time
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.store import RunWriter
from mismatch_monitor.store import flush_files
from synthetic import make_batch
run = sys.argv[1]
real = flush_files.write_parquet_atomic
def slow(table, path):                 # the flush runs on the main thread: the signal lands in it
    open(run + ".flushing", "w").close()
    time.sleep(0.1)
    real(table, path)
flush_files.write_parquet_atomic = slow
w = RunWriter(run, flush_every_steps=4, flush_every_seconds=1e9, background=False)
stats = compute_stats(make_batch(0, sequences=6, max_len=12), MetricConfig(kernel="torch"))
for step in range(6):
    w.append_step(step, stats)         # steps 0-3 flush inside the 4th call
time.sleep(120)
"""


def test_sigterm_inside_a_flush_on_the_main_thread_lets_it_finish_then_writes_the_rest(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SYNC_FLUSH, str(run)], env=ENV, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not Path(str(run) + ".flushing").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    steps = _raw_steps(run)
    assert steps in (list(range(4)), list(range(6)))        # the flush it was in finished; nothing half
    assert _index(run)["step"].tolist() == steps


def test_handlers_are_installed_from_the_main_thread_only_and_given_back_on_close(tmp_path):
    import threading

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        made = []
        t = threading.Thread(target=lambda: made.append(RunWriter(tmp_path / "thread")))
        t.start()
        t.join()
        assert signal.getsignal(signal.SIGTERM) is mine        # untouched from another thread
        made[0].close()
        writer = RunWriter(tmp_path / "main")
        assert signal.getsignal(signal.SIGTERM) is not mine    # chained in front of it
        writer.close()
        assert signal.getsignal(signal.SIGTERM) is mine        # and given back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_users_sigterm_handler_still_runs_after_the_flush(tmp_path):
    run = tmp_path / "run"
    proc = _child("user-handler", run, 5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 7                # the user's handler chose the exit
    assert proc.stdout.read().strip() == f"user handler {int(signal.SIGTERM)}"
    assert _index(run)["step"].tolist() == list(range(5))


def test_a_pause_is_flushed_on_time_without_another_step(tmp_path):
    run = tmp_path / "run"
    writer = RunWriter(run, config=CONFIG, flush_every_steps=1000, flush_every_seconds=0.3)
    for step in range(3):
        writer.append_step(step, _stats(), wall_time=float(step))
    deadline = time.monotonic() + 30                  # no step arrives meanwhile
    while writer.pending_steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.pending_steps == 0
    assert _index(run)["step"].tolist() == [0, 1, 2]
    writer.close()


# --------------------------------------------------------------------------- writers and clocks

HOLDER = """
import sys, time
from mismatch_monitor.store import RunWriter
w = RunWriter(sys.argv[1])
print("holding", flush=True)
time.sleep(120)
"""


def _holder(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run)
    try:
        with pytest.raises(RunLocked, match=f"pid {proc.pid} on host {socket.gethostname()}"):
            RunWriter(run)
        first = RunWriter(tmp_path / "other")
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):   # in one process too
            RunWriter(tmp_path / "other")
        first.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_writers_lock_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    proc = _holder(run)
    proc.kill()
    proc.wait()
    with caplog.at_level(logging.WARNING):
        writer = RunWriter(run)
    assert [r.getMessage() for r in caplog.records if "took over" in r.getMessage()] == [
        f"mismatch-monitor: took over the lock of {run} left by writer pid {proc.pid} on host "
        f"{socket.gethostname()} (it ended without releasing it)"]
    writer.append_step(0, _stats(), wall_time=0.0)
    writer.close()
    assert _index(run)["step"].tolist() == [0]


SKEWED = """
import sys, time
real, real_ns = time.time, time.time_ns
time.time = lambda: real() - 3600.0                 # this host's clock is an hour behind
time.time_ns = lambda: real_ns() - 3600 * 10**9
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.store import RunWriter
from synthetic import make_batch
w = RunWriter(sys.argv[1], config=MetricConfig(kernel="torch"))
for step in range(3):
    w.append_step(step, compute_stats(make_batch(step, sequences=9, max_len=12), MetricConfig(kernel="torch")))
w.close()
"""


def test_a_restart_on_a_host_whose_clock_is_behind_still_wins(tmp_path):
    run = tmp_path / "run"
    writer = RunWriter(run, config=CONFIG)
    for step in range(3):
        writer.append_step(step, _stats(step))            # 6 sequences a step
    writer.close()
    subprocess.run([sys.executable, "-c", SKEWED, str(run)], env=ENV, check=True, timeout=300)
    index = _index(run)
    assert index["step"].tolist() == [0, 1, 2]
    assert index["n_sequences"].tolist() == [9, 9, 9]     # the re-logged values, not the old ones


# --------------------------------------------------------------------------- corrupt and foreign files


def _run_of_flushes(run: Path, steps: int) -> None:
    writer = RunWriter(run, config=CONFIG, flush_every_steps=1, flush_every_seconds=1e9, background=False)
    for step in range(steps):
        writer.append_step(step, _stats(step), wall_time=float(step))
    writer.close()


def test_readers_set_a_truncated_and_a_foreign_file_aside_and_serve_the_rest(tmp_path, caplog, capsys):
    from mismatch_monitor.cli import main

    run = tmp_path / "run"
    _run_of_flushes(run, 4)
    tokens = sorted((run / "tokens").glob("*.parquet"))
    bad = tokens[1]                                           # step 1's tokens
    bad.write_bytes(bad.read_bytes()[:100])                   # truncated
    foreign = run / "tokens" / "part-00000000000000000007.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)          # another program's file
    caplog.set_level(logging.WARNING, logger="mismatch_monitor")
    con = query.connect()
    series = query.metric_series(con, run, metrics=["mismatch/n_tokens"])
    assert series["step"].tolist() == [0, 2, 3]               # step 1's cells are set aside
    assert _index(run)["step"].tolist() == [0, 1, 2, 3]
    aside = dict(set_aside(run))
    assert sorted(aside) == [str(bad), str(foreign)]
    assert aside[str(bad)].startswith("not a readable Parquet file")
    assert aside[str(foreign)] == "not written by mismatch-monitor (no schema stamp in its footer)"
    query.metric_series(con, run, metrics=["mismatch/n_tokens"])     # read again: logged once
    logged = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert sorted(logged) == sorted(f"mismatch-monitor: set aside {p}: {why} (`mismatch-monitor compact` "
                                    f"quarantines it)" for p, why in aside.items())
    assert main(["summary", str(run)]) == 0                   # no DuckDB traceback
    assert "latest step 3" in capsys.readouterr().out


def test_compaction_quarantines_bad_files_and_removes_what_kills_left(tmp_path, capsys):
    from mismatch_monitor.cli import main

    run = tmp_path / "run"
    _run_of_flushes(run, 4)
    bad = sorted((run / "tokens").glob("*.parquet"))[1]
    bad.write_bytes(b"PAR1 not a footer")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    (run / "tokens" / f".part-00000000000000000099.parquet.{dead_pid}.tmp").write_bytes(b"PAR1")
    (run / f".run.json.{dead_pid}.tmp").write_text("{")
    live_tmp = run / "steps" / f".part-00000000000000000098.parquet.{os.getpid()}.tmp"
    live_tmp.write_bytes(b"")                                 # a live process's: kept
    for table in ("sequences", "abs_hist"):                   # a flush killed before its index
        src = sorted((run / table).glob("*.parquet"))[0]
        (run / table / "part-00000000000000000097.parquet").write_bytes(src.read_bytes())
    assert main(["compact", str(run)]) == 0
    out = capsys.readouterr().out
    assert "1 quarantined, 2 tmp removed, 2 orphans removed" in out
    assert (run / "quarantine" / "tokens" / bad.name).read_bytes() == b"PAR1 not a footer"
    assert [p.name for p in run.rglob("*.tmp")] == [live_tmp.name]
    assert not list(run.rglob("part-00000000000000000097.parquet"))
    assert set_aside(run) == []
    assert _index(run)["step"].tolist() == [0, 1, 2, 3]
    assert query.metric_series(query.connect(), run, metrics=["mismatch/n_tokens"])["step"].tolist() == [0, 2, 3]


# --------------------------------------------------------------------------- labels, runs root, ranges


@pytest.mark.parametrize("label", ["file_id", "write_id", "block", "grouping", "wall_time", "n_tokens"])
def test_a_label_named_like_a_stored_column_is_refused_and_counted(tmp_path, label):
    from mismatch_monitor.collectors import MismatchCollector

    base = make_batch(0, sequences=6, max_len=12)
    batch = dataclasses.replace(base, labels={**base.labels, label: ("x",) * 6})
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"label name\(s\) \['{label}'\] clash with columns the run store"):
        RunWriter(tmp_path / "direct", config=CONFIG).append_step(0, compute_stats(batch, CONFIG))
    with MismatchCollector(run, config=CONFIG, alert_evaluator=None) as mc:
        mc.log_step(0, batch)                                  # never raises into training
        mc.log_step(1, make_batch(1, sequences=6, max_len=12))
    assert mc.error_count == 1 and f"['{label}'] clash" in mc.last_error
    index = _index(run)
    assert index["step"].tolist() == [0, 1] and index["n_tokens"].tolist()[0] == 0   # step 0 recorded empty
    assert query.aggregate(query.connect(), run, "tokens")["step"].unique().tolist() == [1]   # no cells of step 0


def test_a_symlink_out_of_the_runs_root_is_neither_listed_nor_opened(tmp_path):
    from mismatch_monitor.app.runs import RunOutsideRoot, list_runs, resolve_run

    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    RunWriter(root / "inside").close()
    RunWriter(outside / "exp").close()
    (root / "exp").symlink_to(outside / "exp")                 # same name as its target
    assert list_runs(root) == {"inside": (root / "inside").resolve()}
    with pytest.raises(RunOutsideRoot, match="outside the runs root"):
        resolve_run(root, "exp")


ABSURD_RANGE = """
from mismatch_monitor import query
from mismatch_monitor.app.loaders import span_of
import pandas as pd
for first, last in [(-1, 2**62), (0, 2**62)]:
    origin, w = query.aligned_bins(first, last, query.step_width(first, last, 600), 600)
    assert origin <= first and (last - origin) // w + 1 <= 600 and w % 16 == 0, (origin, w)
span = span_of(pd.DataFrame({"step": [0, 2**62]}), None, 600)
assert span.origin == 0 and (span.last - span.origin) // span.width + 1 <= 600
print("bins", (span.last - span.origin) // span.width + 1)
"""


def test_an_absurd_step_range_bins_at_once(tmp_path):
    out = subprocess.run([sys.executable, "-c", ABSURD_RANGE], env=ENV, capture_output=True, text=True,
                         timeout=60)                      # used to loop 2^62 / (600 * 16) times
    assert out.returncode == 0, out.stderr
    bins = int(out.stdout.split()[1])
    assert 590 <= bins <= 600                             # as many bins as asked for, not one
