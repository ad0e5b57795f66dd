"""Flushes that fall due while steps arrive run on a background thread; none may lose a step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.exemplars import Exemplars, select_exemplars, tail_exemplars
from mismatch_monitor.store import RunWriter
from mismatch_monitor.store import flush_files
from mismatch_monitor.store.writer import FlushError

from synthetic import make_batch


def _recording_writes(monkeypatch, fail_background: int = 0) -> list[tuple[str, str]]:
    """Record (thread name, file name) of every Parquet write; the first ``fail_background``
    writes made off the main thread raise instead (a full disk, say)."""
    real = flush_files.write_parquet_atomic
    calls: list[tuple[str, str]] = []
    failures = [fail_background]

    def write(table, path):
        name = threading.current_thread().name
        calls.append((name, path.parent.name))
        if name != "MainThread" and failures[0] > 0:
            failures[0] -= 1
            raise OSError("No space left on device")
        real(table, path)

    monkeypatch.setattr(flush_files, "write_parquet_atomic", write)
    return calls


def test_due_flushes_run_off_the_training_thread_and_close_writes_the_rest(tmp_path, monkeypatch):
    calls = _recording_writes(monkeypatch)
    stats = compute_stats(make_batch(0))
    writer = RunWriter(tmp_path / "run", flush_every_steps=3, flush_every_seconds=1e9)
    for step in range(7):
        writer.append_step(step, stats, wall_time=float(step))
    assert writer.pending_steps >= 1                  # step 6 at least waits for close()
    writer.close()
    assert writer.pending_steps == 0
    background = [c for c in calls if c[0] != "MainThread"]
    foreground = [c for c in calls if c[0] == "MainThread"]
    # two due flushes (steps 0-2, 3-5) in the background, each ending with its index file
    assert [table for _, table in background].count("steps") == 2
    assert background[-1][1] == "steps"
    assert foreground[-1][1] == "steps"               # close() wrote step 6 itself
    con = query.connect()
    index = query.steps_index(con, tmp_path / "run")
    assert index["step"].tolist() == list(range(7))
    assert (index["n_tokens"] == int(stats["tokens"]["n_tokens"].sum())).all()


def test_a_failed_background_flush_keeps_its_steps_and_is_reported_once(tmp_path, monkeypatch, caplog):
    _recording_writes(monkeypatch, fail_background=1)
    run = tmp_path / "run"
    with MismatchCollector(run, flush_every_steps=2, flush_every_seconds=1e9) as mc:
        reports = [mc.log_step(step, make_batch(step)) for step in range(7)]   # never raises
        assert mc.error_count == 1
        assert "No space left on device" in mc.last_error
        # the failed flush names its steps: 0-1, or 0-2 when step 2 was buffered before the
        # background flush took the batch (seen on a loaded machine)
        assert re.search(r"writing steps 0-[12] failed", mc.last_error) and "written again" in mc.last_error
    assert sum("No space left on device" in r.getMessage() for r in caplog.records) == 1
    assert reports[-1]["mismatch/collector_errors"] == 1.0
    con = query.connect()
    index = query.steps_index(con, run)
    assert index["step"].tolist() == list(range(7))   # the failed flush's steps were written again
    for step in range(7):
        want = int(compute_stats(make_batch(step))["tokens"]["n_tokens"].sum())
        assert int(index.loc[index["step"] == step, "n_tokens"].iloc[0]) == want
    series = query.metric_series(con, run, metrics=["mismatch/n_tokens"])   # from the tokens files
    assert series["step"].tolist() == list(range(7))
    assert series["mismatch/n_tokens"].tolist() == index["n_tokens"].astype(float).tolist()
    assert sorted(query.rows(con, run, "exemplar_tokens")["step"].unique().tolist()) == list(range(7))


def test_strict_mode_raises_the_background_error(tmp_path, monkeypatch):
    _recording_writes(monkeypatch, fail_background=1)
    mc = MismatchCollector(tmp_path / "run", flush_every_steps=1, flush_every_seconds=1e9, strict=True)
    mc.log_step(0, make_batch(0))                     # its flush fails in the background
    with pytest.raises(FlushError, match="No space left"):
        mc.log_step(1, make_batch(1))                 # the next flush collects the failure
    mc.close()                                        # the kept steps are written now
    assert query.steps_index(query.connect(), tmp_path / "run")["step"].tolist() == [0, 1]


EXIT_WITHOUT_CLOSE = """
import sys, torch
from mismatch_monitor.collectors import MismatchCollector
from synthetic import make_batch
torch.set_num_threads(1)
mc = MismatchCollector(sys.argv[1], flush_every_steps=int(sys.argv[3]))
for step in range(int(sys.argv[2])):
    mc.log_step(step, make_batch(step, sequences=6, max_len=12))
# no close(): the process ends with steps buffered and, maybe, a flush in flight
"""


@pytest.mark.parametrize("steps,every", [(5, 100), (23, 4)])
def test_a_process_that_exits_without_close_writes_every_step(tmp_path, steps, every):
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path / "run"), str(steps), str(every)],
                   check=True, env=env, timeout=300)
    index = query.steps_index(query.connect(), tmp_path / "run")
    assert index["step"].tolist() == list(range(steps))
    assert (index["n_tokens"] > 0).all()


class _Exemplars(Exemplars):
    """Real exemplars, except that a set marked broken cannot be built."""

    broken = False

    @staticmethod
    def frames_of(items, key="step"):
        bad = [k for k, e in items if e.broken]
        if bad:
            raise ValueError(f"bad exemplar column in set {bad}")
        return Exemplars.frames_of(items, key=key)


def _exemplars(step: int, broken: bool = False) -> _Exemplars:
    e = _Exemplars(select_exemplars(make_batch(step), 4).columns)
    object.__setattr__(e, "broken", broken)
    return e


def test_exemplars_that_cannot_be_built_lose_only_themselves(tmp_path):
    """A set of deferred tables that cannot be built must not stop this flush or any later one,
    nor take the other steps' exemplars with it."""
    stats = compute_stats(make_batch(0))
    writer = RunWriter(tmp_path / "run", flush_every_steps=2, flush_every_seconds=1e9)
    writer.append_step(0, stats, _exemplars(0, broken=True), wall_time=0.0)
    writer.append_step(1, stats, _exemplars(1), wall_time=1.0)      # due: flushed in the background
    writer.append_step(2, stats, _exemplars(2), wall_time=2.0)
    writer.flush()
    errors = writer.take_errors()
    assert len(errors) == 1 and isinstance(errors[0], FlushError)
    assert "step 0" in str(errors[0]) and "bad exemplar column" in str(errors[0])
    assert writer.take_errors() == []                               # reported once
    writer.append_step(3, stats, _exemplars(3), wall_time=3.0)
    writer.close()
    con = query.connect()
    assert query.steps_index(con, tmp_path / "run")["step"].tolist() == [0, 1, 2, 3]
    got = query.rows(con, tmp_path / "run", "exemplar_tokens")
    assert sorted(got["step"].unique().tolist()) == [1, 2, 3]
    for step in (1, 2, 3):   # each step's rows are its own exemplars, built together with others'
        want = tail_exemplars(make_batch(step), 4)["exemplar_tokens"]["abs_log_ratio"]
        assert sorted(got.loc[got["step"] == step, "abs_log_ratio"]) == sorted(want)


def test_exemplars_of_a_step_logged_again_are_the_later_ones(tmp_path):
    stats = compute_stats(make_batch(0))
    writer = RunWriter(tmp_path / "run", flush_every_steps=100, flush_every_seconds=1e9)
    writer.append_step(0, stats, _exemplars(10), wall_time=0.0)
    writer.append_step(0, stats, _exemplars(11), wall_time=1.0)     # a retried step
    writer.close()
    got = query.rows(query.connect(), tmp_path / "run", "exemplar_tokens")
    want = tail_exemplars(make_batch(11), 4)["exemplar_tokens"]["abs_log_ratio"]
    assert got["step"].tolist() == [0] * 4 and sorted(got["abs_log_ratio"]) == sorted(want)


def test_errors_collected_by_close_are_reported(tmp_path, monkeypatch, caplog):
    _recording_writes(monkeypatch, fail_background=1)
    mc = MismatchCollector(tmp_path / "run", flush_every_steps=2, flush_every_seconds=1e9)
    for step in range(3):
        mc.log_step(step, make_batch(step))   # steps 0-1 fail in the background, unseen so far
    mc.close()                                # collects the failure, writes steps 0-2 itself
    assert mc.error_count == 1 and "steps 0-1" in mc.last_error
    assert any("No space left on device" in r.getMessage() for r in caplog.records)
    assert query.steps_index(query.connect(), tmp_path / "run")["step"].tolist() == [0, 1, 2]


def test_a_step_logged_twice_before_a_flush_is_written_once_as_logged_last(tmp_path):
    first, second = compute_stats(make_batch(0)), compute_stats(make_batch(0, seed=5, sequences=9))
    writer = RunWriter(tmp_path / "run", flush_every_steps=100, flush_every_seconds=1e9)
    writer.append_step(0, first, wall_time=0.0)
    writer.append_step(1, first, wall_time=1.0)
    writer.append_step(0, second, wall_time=2.0)      # a retried step: this one counts
    writer.close()
    con = query.connect()
    index = query.steps_index(con, tmp_path / "run")
    assert index["step"].tolist() == [0, 1]
    assert index["n_tokens"].tolist() == [int(second["tokens"]["n_tokens"].sum()),
                                          int(first["tokens"]["n_tokens"].sum())]
    series = query.metric_series(con, tmp_path / "run", metrics=["mismatch/n_tokens"])
    assert series["mismatch/n_tokens"].tolist() == index["n_tokens"].astype(float).tolist()


def test_close_called_on_the_flush_thread_does_not_wait_for_itself(tmp_path):
    """A finalizer the garbage collector runs on the flush thread may call close() there."""
    stats = compute_stats(make_batch(0))
    writer = RunWriter(tmp_path / "run", flush_every_steps=1, flush_every_seconds=1e9)

    class Closing:
        @staticmethod
        def frames_of(items, key="step"):
            writer.close()                           # on the flush thread, mid-flush
            return {}

    writer.append_step(0, stats, Closing(), wall_time=0.0)   # due: flushed in the background
    for _ in range(300):
        if writer.closed:
            break
        threading.Event().wait(0.1)
    assert writer.closed
    assert query.steps_index(query.connect(), tmp_path / "run")["step"].tolist() == [0]
