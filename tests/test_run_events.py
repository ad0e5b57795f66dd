"""The run's ``events`` and ``outcomes`` tables: written through the collector and RunWriter,
read back from real Parquet by DuckDB (``query/events.py``).

* columns and types exactly as documented, sorted by step; an older run gives empty frames;
* an event without a step takes the step after the last one logged (also in a continued run);
* a restarted run appends, records its resume at its first step, and an outcome logged again
  for a step replaces the earlier one (in one flush and across flushes);
* rows of a flush without an index are not read; a failed flush writes them later, once;
* compaction keeps every row exactly once, also over an earlier compaction's leftovers;
* a mistake in the call raises; a non-finite value or a bad step is a counted, stored error;
* an alert that asks for a resync leaves a ``resync_request`` in the run.
"""

from __future__ import annotations

import io
import itertools
import math
import shutil
from contextlib import redirect_stdout

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.cli import main
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.query.events import resync_effects, run_events, run_outcomes
from mismatch_monitor.store import RunWriter, compact_run
from mismatch_monitor.store import flush_files as writer_module

from synthetic import make_batch

EVENT_DTYPES = {"step": "int64", "wall_time": "float64", "kind": "string", "pool": "string",
                "version": "Int64", "message": "string"}
OUTCOME_DTYPES = {"step": "int64", "wall_time": "float64", "pool": "string", "name": "string",
                  "value": "float64"}


def _clock():
    """A clock that ticks one second per reading, so rows logged one after the other are ordered."""
    ticks = itertools.count(1000.0)
    return lambda: next(ticks)


def collapsing_batch(step: int) -> TokenBatch:
    """Pool fp8's ratios collapse (ESS ~ 0.37) at steps 3-6 and 9-11: two incidents."""
    gen = torch.Generator().manual_seed(step)
    mu = -(8.0 + 3.0 * torch.rand(8, 64, generator=gen, dtype=torch.float64))
    fp8 = 1.0 if step in {3, 4, 5, 6, 9, 10, 11} else 0.05
    noise = torch.tensor([0.03] * 4 + [fp8] * 4, dtype=torch.float64)[:, None]
    return TokenBatch.from_padded(mu + noise * torch.randn(8, 64, generator=gen, dtype=torch.float64), mu,
                                  torch.ones(8, 64), labels={"pool": ["bf16"] * 4 + ["fp8"] * 4})


def _events(run) -> pd.DataFrame:
    return run_events(query.connect(), run)


def _outcomes(run) -> pd.DataFrame:
    return run_outcomes(query.connect(), run)


def _as_tuples(df: pd.DataFrame, cols: list[str]) -> list[tuple]:
    return [tuple(None if pd.isna(v) else v for v in row) for row in df[cols].itertuples(index=False)]


def test_round_trip_columns_types_order_and_default_step(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None, clock=_clock()) as mc:
        mc.log_event("weight_sync", version=0, message="initial weights")      # nothing logged yet: step 0
        for step in range(3):
            mc.log_step(step, make_batch(step))
            mc.log_outcomes(step, {"reward": 0.5 + step, "loss": torch.tensor(2.0 - step)})
            mc.log_outcomes(step, {"reward": np.float32(0.25 * step)}, pool="fp8")
        mc.log_event("weight_sync", pool="fp8", version=np.int64(3))            # after step 2: step 3
        mc.log_event("resync", step=1, pool="fp8", version=2, message="reloaded")
    events, outcomes = _events(run), _outcomes(run)
    assert list(events.columns) == list(EVENT_DTYPES) and events.dtypes.astype(str).to_dict() == EVENT_DTYPES
    assert list(outcomes.columns) == list(OUTCOME_DTYPES)
    assert outcomes.dtypes.astype(str).to_dict() == OUTCOME_DTYPES
    assert _as_tuples(events, ["step", "kind", "pool", "version", "message"]) == [
        (0, "weight_sync", None, 0, "initial weights"), (1, "resync", "fp8", 2, "reloaded"),
        (3, "weight_sync", "fp8", 3, "")]
    assert events["wall_time"].is_monotonic_increasing is False          # sorted by step, not by time
    assert _as_tuples(outcomes, ["step", "pool", "name", "value"]) == [
        (0, None, "loss", 2.0), (0, None, "reward", 0.5), (0, "fp8", "reward", 0.0),
        (1, None, "loss", 1.0), (1, None, "reward", 1.5), (1, "fp8", "reward", 0.25),
        (2, None, "loss", 0.0), (2, None, "reward", 2.5), (2, "fp8", "reward", 0.5)]
    # what DuckDB reads straight from the files: one row per logged value, nothing else
    raw = query.connect().execute("SELECT count(*), sum(value) FROM read_parquet($f)",
                                  {"f": str(run / "outcomes" / "*.parquet")}).fetchone()
    assert raw == (9, pytest.approx(8.25))


def test_older_run_gives_empty_frames_with_columns(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_step(0, make_batch(0))
    assert not (run / "events").exists()
    for df, dtypes in ((_events(run), EVENT_DTYPES), (_outcomes(run), OUTCOME_DTYPES)):
        assert len(df) == 0 and df.dtypes.astype(str).to_dict() == dtypes
    empty = tmp_path / "nothing"
    empty.mkdir()
    assert len(_events(empty)) == 0 and list(_outcomes(empty).columns) == list(OUTCOME_DTYPES)


def test_restart_appends_records_resume_and_later_outcome_wins(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        for step in range(5):
            mc.log_step(step, make_batch(step))
            mc.log_outcomes(step, {"reward": float(step)})
        mc.log_outcomes(4, {"loss": 4.0})
        mc.log_outcomes(4, {"loss": 40.0})                   # the same flush: the last value is written
        mc.log_event("weight_sync", version=5)
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_event("weight_sync", version=6)               # before any step: after the stored step 4
        for step in (3, 4, 5):                               # resumed from a checkpoint of step 3
            mc.log_step(step, make_batch(step))
            mc.log_outcomes(step, {"reward": 100.0 + step})
    events = _events(run)
    assert _as_tuples(events, ["step", "kind", "version"]) == [
        (3, "resume", None), (5, "weight_sync", 5), (5, "weight_sync", 6)]
    assert "reopened" in events["message"].iloc[0]
    outcomes = _outcomes(run)
    assert _as_tuples(outcomes, ["step", "name", "value"]) == [
        (0, "reward", 0.0), (1, "reward", 1.0), (2, "reward", 2.0), (3, "reward", 103.0),
        (4, "loss", 40.0), (4, "reward", 104.0), (5, "reward", 105.0)]


def test_an_explicit_resume_replaces_the_automatic_one(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_step(0, make_batch(0))
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_event("resume", step=1, version=1, message="from checkpoint-1")
        mc.log_step(1, make_batch(1))
    assert _as_tuples(_events(run), ["step", "kind", "version", "message"]) == [
        (1, "resume", 1, "from checkpoint-1")]


def test_rows_without_an_index_are_not_read_and_a_failed_flush_writes_them_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    w = RunWriter(run, background=False, handle_signals=False)
    w.append_events([{"step": 0, "wall_time": 1.0, "kind": "weight_sync", "pool": None, "version": 0,
                      "message": ""}])
    w.flush()
    index = next((run / "steps").glob("*.parquet"))
    index.unlink()                                           # as if the flush died before its index
    assert len(_events(run)) == 0 and (run / "events").exists()

    real = writer_module.write_parquet_atomic
    calls = {"n": 0}

    def full_disk_once(arrow, path):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(arrow, path)

    monkeypatch.setattr(writer_module, "write_parquet_atomic", full_disk_once)
    w.append_outcomes([{"step": 2, "wall_time": 2.0, "pool": "a", "name": "loss", "value": 0.5}])
    with pytest.raises(OSError):
        w.flush()
    w.append_outcomes([{"step": 3, "wall_time": 3.0, "pool": "a", "name": "loss", "value": 0.25}])
    w.close()
    assert _as_tuples(_outcomes(run), ["step", "pool", "name", "value"]) == [(2, "a", "loss", 0.5),
                                                                               (3, "a", "loss", 0.25)]


def test_compaction_keeps_every_row_once_also_over_leftovers(tmp_path):
    run = tmp_path / "run"
    for session in range(3):                                 # three writers: several files per table
        with MismatchCollector(run, alert_evaluator=None, flush_every_steps=1) as mc:
            for step in range(2 * session, 2 * session + 2):
                mc.log_step(step, make_batch(step))
                mc.log_event("weight_sync", pool="a", version=step)
                mc.log_outcomes(step, {"reward": float(step), "loss": -float(step)})
    before_events, before_outcomes = _events(run), _outcomes(run)
    assert len(before_events) == 6 + 2 and len(before_outcomes) == 12   # + two resumes
    kept = tmp_path / "originals"
    for table in ("events", "outcomes", "steps"):
        shutil.copytree(run / table, kept / table)
    compact_run(run)
    assert len(list((run / "events").glob("*.parquet"))) == 1
    pd.testing.assert_frame_equal(_events(run), before_events)
    pd.testing.assert_frame_equal(_outcomes(run), before_outcomes)
    # a compaction that died after writing its index, before removing the originals: both copies
    for table in ("events", "outcomes", "steps"):
        for f in (kept / table).glob("*.parquet"):
            shutil.copy(f, run / table / f.name)
    pd.testing.assert_frame_equal(_events(run), before_events)
    compact_run(run)                                         # and compacting that keeps each row once
    pd.testing.assert_frame_equal(_events(run), before_events)
    pd.testing.assert_frame_equal(_outcomes(run), before_outcomes)


def test_mistakes_in_the_call_raise(tmp_path):
    with MismatchCollector(tmp_path / "run", alert_evaluator=None) as mc:
        with pytest.raises(ValueError, match="expected kind to be one of 'weight_sync'"):
            mc.log_event("weights_synced")
        with pytest.raises(TypeError, match="expected step to be an int, got str"):
            mc.log_event("resync", step="3")
        with pytest.raises(TypeError, match="expected version to be an int, got float"):
            mc.log_event("weight_sync", version=1.5)
        with pytest.raises(TypeError, match="expected pool to be a str or None"):
            mc.log_event("resync", pool=3)
        with pytest.raises(TypeError, match="expected values to be a mapping"):
            mc.log_outcomes(0, [1.0])
        with pytest.raises(TypeError, match="expected outcome 'reward' to be a real number, got str"):
            mc.log_outcomes(0, {"reward": "high"})
        with pytest.raises(TypeError, match=r"to be one number, got an array of shape \(2,\)"):
            mc.log_outcomes(0, {"loss": torch.tensor([1.0, 2.0])})
        with pytest.raises(TypeError, match="got bool"):
            mc.log_outcomes(0, {"done": True})
        with pytest.raises(TypeError, match="non-empty strings"):
            mc.log_outcomes(0, {"": 1.0})
        assert mc.error_count == 0
    assert len(_events(tmp_path / "run")) == 0 and len(_outcomes(tmp_path / "run")) == 0


def test_bad_data_is_counted_and_kept_and_strict_raises(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None, clock=_clock()) as mc:
        mc.log_outcomes(7, {"reward": 1.0, "loss": math.nan, "grad_norm": torch.tensor(math.inf)})
        mc.log_outcomes(-1, {"reward": 1.0})
        mc.log_event("weight_sync", step=-2)
        mc.log_event("weight_sync", step=1, version=2**64)
        assert mc.error_count == 5
    assert _as_tuples(_outcomes(run), ["step", "name", "value"]) == [(7, "reward", 1.0)]
    assert len(_events(run)) == 0
    errors = query.collector_errors(query.connect(), run).sort_values("wall_time")
    messages = errors["message"].tolist()
    assert "outcome 'loss' at step 7 is nan" in messages[0] and "'grad_norm' at step 7 is inf" in messages[1]
    assert errors["step"].tolist()[:2] == [7, 7]
    assert "got -1" in messages[2] and "got -2" in messages[3] and "fit an int64" in messages[4]
    with MismatchCollector(tmp_path / "strict", alert_evaluator=None, strict=True) as mc:
        with pytest.raises(ValueError, match="'loss' at step 0 is nan"):
            mc.log_outcomes(0, {"loss": float("nan")})


def test_an_alert_asking_for_a_resync_is_recorded_before_the_callback_resyncs(tmp_path):
    run = tmp_path / "run"
    asked: list = []
    with MismatchCollector(run, alert_evaluator=AlertEvaluator(), flush_every_steps=3, clock=_clock()) as mc:
        @mc.on_resync
        def resync(event) -> None:
            asked.append(event)
            mc.log_event("resync", pool=event.pool, version=event.step, message="weights reloaded")

        for step in range(14):
            mc.log_step(step, collapsing_batch(step))
    assert asked, "pool fp8 collapses: the alerts ask for a resync"
    events = _events(run)
    # each request and the resync it led to take effect from the step after the alert's
    expected = []
    for e in asked:
        expected += [(e.step + 1, "resync_request", "fp8", None), (e.step + 1, "resync", "fp8", e.step)]
    assert _as_tuples(events, ["step", "kind", "pool", "version"]) == expected
    request = events["message"].iloc[0]
    assert f"{asked[0].alert} asked for a resync at step {asked[0].step}" in request
    assert "1 on_resync callback(s)" in request
    assert (events["wall_time"].diff().dropna() >= 0).all()

    # did it help: the pool's k3 just before and from the resync on, against the batches' own tokens
    def k3(step: int) -> float:
        b = collapsing_batch(int(step))
        lr = (b.trainer_logprobs - b.sampler_logprobs).numpy()[4 * 64:]     # [N]: rows 4-7 are pool fp8
        return float(np.mean(np.expm1(lr) - lr))

    effects = resync_effects(query.connect(), run)
    assert _as_tuples(effects, ["step", "pool", "version", "before_step", "after_step"]) == [
        (e.step + 1, "fp8", e.step, e.step, e.step + 1) for e in asked]
    for row in effects.itertuples(index=False):
        assert row.before == pytest.approx(k3(row.before_step), rel=1e-9)
        assert row.after == pytest.approx(k3(row.after_step), rel=1e-9)
    text = _summary(run)
    assert f"resyncs, the pool's k3 KL before -> from the resync on (the latest {len(asked)}):" in text
    assert f" @{asked[-1].step} " in text and text.count(f" @{asked[-1].step + 1}") == 1


def _summary(run, *args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["summary", str(run), *args]) == 0
    return out.getvalue()


def test_summary_lists_events_and_the_last_value_of_each_outcome(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None, clock=_clock()) as mc:
        for step in range(4):
            mc.log_event("weight_sync", version=step, message=f"sync {step}")
            mc.log_step(step, make_batch(step))
            mc.log_outcomes(step, {"reward": 0.125 * step, "loss": 3.0 - step})
            mc.log_outcomes(step, {"reward": 0.5 + step}, pool="fp8")
        mc.log_event("resync", pool="fp8", version=9, message="reloaded")
    text = _summary(run, "--events", "2")
    assert "weight events: 4 weight_sync, 1 resync (the latest 2):" in text
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("weight events")))
    assert lines[start + 1:start + 3] == ["  step 3: weight_sync (every pool, version 3): sync 3",
                                          "  step 4: resync (pool fp8, version 9): reloaded"]
    start = lines.index("training outcomes, the last value of each:")
    assert [line.split() for line in lines[start + 3:start + 6]] == [
        ["loss", "(whole", "batch)", "3", "0"], ["reward", "(whole", "batch)", "3", "0.375"],
        ["reward", "fp8", "3", "3.5"]]
    plain = _summary(tmp_path / "run")                       # default: the latest 10, here all 5
    assert "weight events: 4 weight_sync, 1 resync:" in plain and "sync 0" in plain


class EventAwareEvaluator:
    """An evaluator that also takes the run's events (``observe_event``) and fails on one."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def observe(self, step, wall_time, by_pool, *, fleet=None):
        return []

    def observe_event(self, row: dict) -> None:
        self.seen.append(row)
        if row["kind"] == "resync":
            raise RuntimeError("evaluator cannot take resyncs")


def test_an_evaluator_that_takes_events_sees_each_one_as_stored(tmp_path):
    evaluator = EventAwareEvaluator()
    with MismatchCollector(tmp_path / "run", alert_evaluator=evaluator, clock=_clock()) as mc:
        mc.log_event("weight_sync", pool="fp8", version=0)
        mc.log_step(0, make_batch(0))
        mc.log_event("resync", pool="fp8", version=1)
        mc.log_event("weight_sync", step=-1)                     # bad data: not stored, not shown
    stored = _events(tmp_path / "run")
    assert [(r["step"], r["kind"], r["version"]) for r in evaluator.seen] == [(0, "weight_sync", 0), (1, "resync", 1)]
    assert len(stored) == 2 and mc.errors_by_kind == {"RuntimeError": 1, "StepError": 1}
