"""Step-block rollups: a binned read that takes whole blocks from the rollups equals the same
read computed from the cells alone, whatever the bins, range, grouping and filter; re-logged
steps, compaction, a missing rollup file and a rollup that cannot be built all keep it exact.

The reference is independent of the rollups: ``query.aggregate`` reads each step's cells (its
own SQL, no rollups), and pandas merges the steps of each bin by the fields' rules. Runtime:
about 20 s (one run of 80 steps built with the real collector, re-logs and a compaction).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.engine.fields import TABLES, merge_rules
from mismatch_monitor.store import rollup
from mismatch_monitor.query.binned import _rollup_plan
from mismatch_monitor.store.runlock import RunLock
from mismatch_monitor.store import compact_run
from test_app_runs import POOLS, fleet_case

STEPS = 80
RELOGGED = (5, 33, 34, 70)
NO_POOL = range(50, 56)           # in block 48, which is read from rollups
TABLE_BY = [("tokens", ["pool"], None), ("tokens", [], {"pool": "fp8"}), ("abs_hist", [], None),
            ("abs_hist", ["pool"], None), ("abs_hist", ["turn_bucket"], None), ("sequences", ["length_bucket"], None),
            ("lowprob", [], {"pool": "int4"}), ("routing_layers", ["pool", "turn_bucket"], None),
            ("tokens", ["pool", "length_bucket"], {"pool": "bf16"}), ("tokens", ["hardware"], None)]


def write_run(path: Path) -> None:
    torch.set_num_threads(1)
    # 7 steps a flush: blocks of 16 steps span several flushes
    with MismatchCollector(path, pools=POOLS, flush_every_steps=7, strict=True, alert_evaluator=None) as mc:
        for step in range(STEPS):
            case = fleet_case(step, 3, 1.0)
            if step in NO_POOL:                     # some sequences without a pool label
                case = dataclasses.replace(case, labels=dict(case.labels, pool=[
                    None if i % 4 == 0 else p for i, p in enumerate(case.labels["pool"])]))
            mc.log_step(step, case.batch())
    with MismatchCollector(path, pools=POOLS, flush_every_steps=2, strict=True, alert_evaluator=None) as mc:
        for step in RELOGGED:                       # a restart re-logs a few steps, with other tokens
            mc.log_step(step, fleet_case(step, 4, 1.0).batch())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rollups") / "run"
    write_run(path)
    return path


@pytest.fixture()
def con():
    c = query.connect()
    yield c
    c.close()


def _pandas_rule(rule: str):
    """A merge rule as pandas' aggregation (logsumexp, which pandas has no name for, by numpy)."""
    return (lambda v: np.logaddexp.reduce(v.dropna().to_numpy(np.float64))) if rule == "logsumexp" else rule


def from_cells(con, path: Path, table: str, by: list[str], where, first: int, width: int,
               steps: tuple[int, int]) -> pd.DataFrame:
    """Per-step cells (``query.aggregate``), merged per bin in pandas by each field's rule."""
    per_step = query.aggregate(con, path, table, by, steps=steps, where=where)
    per_step = per_step[per_step["step"] >= first]
    keys = by + list(TABLES[table][0])
    per_step = per_step.assign(_bin=first + (per_step["step"] - first) // width * width)
    rules = {c: r for c, r in merge_rules(table).items()}
    out = per_step.groupby(["_bin"] + keys, dropna=False, sort=True).agg(
        step_last=("step", "max"), **{c: (c, _pandas_rule(r)) for c, r in rules.items()}).reset_index()
    return out.rename(columns={"_bin": "step"})


def assert_same(got: pd.DataFrame, want: pd.DataFrame, table: str, by: list[str]) -> None:
    keys = ["step"] + by + list(TABLES[table][0])
    got = got.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert len(got) == len(want)
    for k in keys:
        assert list(got[k].astype(object).where(got[k].notna(), None)) == \
               list(want[k].astype(object).where(want[k].notna(), None)), k
    assert (got["step_last"].to_numpy() == want["step_last"].to_numpy()).all()
    for col, rule in merge_rules(table).items():
        a, b = got[col].to_numpy(np.float64), want[col].to_numpy(np.float64)
        if (rule == "sum" and col.startswith("sum_")) or rule == "logsumexp":
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=0, equal_nan=True, err_msg=col)
        else:                                       # counts, maxima, minima: exact
            np.testing.assert_array_equal(a, b, err_msg=col)


def served_blocks(con, path: Path, table: str, dims: list[str], first: int, width: int,
                  steps: tuple[int, int]) -> list[int]:
    step_files = query.table_files(path, "steps")
    use = _rollup_plan(con, path, table, dims, first, width, steps, step_files)
    return [] if use is None else sorted(set(use[0].blocks))


def test_every_flush_writes_rollups_beside_its_files(run: Path) -> None:
    for table in rollup.ROLLUP_TABLES:
        data = {p.name for p in (run / table).glob("*.parquet")}
        rolled = {p.name for p in (run / rollup.rollup_name(table)).glob("*.parquet")}
        assert data and rolled == data, table


@pytest.mark.parametrize("table,by,where", TABLE_BY)
@pytest.mark.parametrize("first,width,steps", [(0, 16, (0, 79)), (0, 32, (0, 79)), (16, 48, (20, 79)),
                                               (0, 80, (0, 79)), (3, 5, (3, 60)), (0, 17, (0, 79)),
                                               (0, 1, (10, 40))])
def test_rollups_read_equals_the_cells(con, run: Path, table, by, where, first, width, steps) -> None:
    got = query.aggregate_binned(con, run, table, by, first=first, width=width, steps=steps, where=where,
                                 times=False)
    got_times = query.aggregate_binned(con, run, table, by, first=first, width=width, steps=steps, where=where)
    assert_same(got.assign(step_last=got_times["step_last"].to_numpy()), from_cells(
        con, run, table, by, where, first, width, steps), table, by)


def test_a_null_label_is_a_group_of_its_own(con, run: Path) -> None:
    got = query.aggregate_binned(con, run, "tokens", ["pool"], first=48, width=16, steps=(48, 63))
    assert served_blocks(con, run, "tokens", ["pool"], 48, 16, (48, 63)) == [48]
    assert got["pool"].isna().sum() == 1 and got["n_tokens"].sum() == from_cells(
        con, run, "tokens", [], None, 48, 16, (48, 63))["n_tokens"].sum()


def test_blocks_come_from_rollups_unless_relogged_or_cut(con, run: Path) -> None:
    # blocks 0, 32 and 64 hold re-logged steps (5; 33, 34; 70): their first flushes' rollups
    # no longer match, so those blocks come from cells; block 16 and 48 from rollups
    assert served_blocks(con, run, "tokens", ["pool"], 0, 16, (0, 79)) == [16, 48]
    # a range that cuts block 48 and a bin (width 40) that splits block 32 leave only block 16 whole
    assert served_blocks(con, run, "tokens", [], 0, 40, (0, 60)) == [16]
    # a dimension no rollup keeps (hardware) is read from cells
    assert served_blocks(con, run, "tokens", ["hardware"], 0, 16, (0, 79)) == []
    # the histogram has no pool x turn rollup
    assert served_blocks(con, run, "abs_hist", ["pool", "turn_bucket"], 0, 16, (0, 79)) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(TABLE_BY), st.integers(0, 40), st.integers(1, 90), st.integers(0, 79), st.integers(0, 79))
def test_any_bins_and_range_read_exactly(con, run: Path, spec, first, width, a, b) -> None:
    table, by, where = spec
    steps = (min(a, b), max(a, b))
    got = query.aggregate_binned(con, run, table, by, first=first, width=width, steps=steps, where=where)
    assert_same(got, from_cells(con, run, table, by, where, first, width, steps), table, by)


def test_compaction_rolls_its_files_up_again(con, run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = query.aggregate_binned(con, copy, "abs_hist", ["pool"], first=0, width=16, steps=(0, 79))
    compact_run(copy)
    for table in rollup.ROLLUP_TABLES:
        data = {p.name for p in (copy / table).glob("*.parquet")}
        assert len(data) == 1 and {p.name for p in (copy / rollup.rollup_name(table)).glob("*.parquet")} == data
    # every step now lives in the compacted file: every whole block comes from its rollups
    assert served_blocks(con, copy, "abs_hist", ["pool"], 0, 16, (0, 79)) == [0, 16, 32, 48, 64]
    after = query.aggregate_binned(con, copy, "abs_hist", ["pool"], first=0, width=16, steps=(0, 79))
    assert_same(after, before, "abs_hist", ["pool"])


def test_a_missing_rollup_file_reads_its_blocks_from_cells(con, run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    files = sorted((copy / rollup.rollup_name("tokens")).glob("*.parquet"))
    files[3].unlink()                               # the flush of steps 21-27 (blocks 16 and 32)
    assert served_blocks(con, copy, "tokens", ["pool"], 0, 16, (0, 79)) == [48]
    got = query.aggregate_binned(con, copy, "tokens", ["pool"], first=0, width=16, steps=(0, 79))
    assert_same(got, from_cells(con, copy, "tokens", ["pool"], None, 0, 16, (0, 79)), "tokens", ["pool"])


def test_a_rollup_that_cannot_be_built_loses_no_step(tmp_path: Path, monkeypatch, caplog) -> None:
    def broken(table, df):
        raise MemoryError("no room for the rollup")
    monkeypatch.setattr(rollup, "build", broken)
    path = tmp_path / "run"
    with MismatchCollector(path, pools=POOLS, flush_every_steps=8, strict=True, alert_evaluator=None) as mc:
        for step in range(20):
            mc.log_step(step, fleet_case(step, 5, 1.0).batch())
    assert "could not write the tokens rollups" in caplog.text
    assert not list(path.glob("rollups/*/*.parquet"))
    con = query.connect()
    assert list(query.steps_index(con, path)["step"]) == list(range(20))
    want = from_cells(con, path, "tokens", ["pool"], None, 0, 16, (0, 19))
    assert served_blocks(con, path, "tokens", ["pool"], 0, 16, (0, 19)) == []
    assert_same(query.aggregate_binned(con, path, "tokens", ["pool"], first=0, width=16, steps=(0, 19)),
                want, "tokens", ["pool"])
    monkeypatch.undo()
    compact_run(path)                    # merges the files and rolls the merged ones up
    assert served_blocks(con, path, "tokens", ["pool"], 0, 16, (0, 19)) == [0, 16]   # 16: steps 16-19
    assert_same(query.aggregate_binned(con, path, "tokens", ["pool"], first=0, width=16, steps=(0, 19)),
                want, "tokens", ["pool"])


def test_compact_adds_the_rollups_a_compacted_run_lacks(con, run: Path, tmp_path: Path, capsys) -> None:
    from mismatch_monitor.cli import main as cli_main

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    compact_run(copy)
    shutil.rmtree(copy / "rollups")      # as a run compacted before rollups existed
    assert served_blocks(con, copy, "lowprob", [], 0, 16, (0, 79)) == []
    assert cli_main(["compact", str(copy)]) == 0
    assert "0 file(s) merged, 5 rollup file(s) added" in capsys.readouterr().out
    assert served_blocks(con, copy, "lowprob", [], 0, 16, (0, 79)) == [0, 16, 32, 48, 64]
    assert compact_run(copy)["rollups_added"] == 0          # nothing left to add


def test_a_rollup_row_merges_its_cells_by_their_rules(run: Path) -> None:
    """The rollup of one file against pandas' merge of the same rows."""
    con = query.connect()
    f = sorted((run / "tokens").glob("*.parquet"))[2]
    cells = con.execute("SELECT * FROM read_parquet($f)", {"f": str(f)}).df()
    built = rollup.build("tokens", pq.read_table(f)).to_pandas()
    assert set(built["grouping"]) == {rollup.grouping_name(g) for g in rollup.GROUPINGS}
    want = cells.assign(block=cells["step"] // rollup.BLOCK * rollup.BLOCK).groupby(
        ["block", "pool"]).agg(**{c: (c, r) for c, r in merge_rules("tokens").items()})
    got = built[built["grouping"] == "pool"].set_index(["block", "pool"]).sort_index()
    for col in want.columns:
        np.testing.assert_allclose(got[col].to_numpy(np.float64), want[col].to_numpy(np.float64), rtol=1e-12)


@given(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(1, 2000))
def test_aligned_bins_fit_the_points_on_block_boundaries(first, span, max_points) -> None:
    last = first + span
    width = query.step_width(first, last, max_points)
    origin, w = query.aligned_bins(first, last, width, max_points)
    assert origin <= first and w >= width
    assert (last - origin) // w + 1 <= max_points          # still at most max_points bins
    if width > 1 and span + 1 >= rollup.BLOCK * max_points // 4:
        assert w % rollup.BLOCK == 0 and origin % w == 0   # whole blocks fall in one bin
        assert (last - origin) // w + 1 >= max_points // 4 - 1    # and enough bins are left
    else:
        assert (origin, w) == (first, width)


def test_a_compaction_between_listings_loses_no_step(con, tmp_path: Path, monkeypatch) -> None:
    """A compaction that completes after a reader listed the index, but before it listed the
    rollups: the reader must not drop the steps of the files it removed (it retries)."""
    from mismatch_monitor.query import binned

    path = tmp_path / "run"
    with MismatchCollector(path, pools=POOLS, flush_every_steps=1000, strict=True, alert_evaluator=None) as mc:
        for step in range(32):
            mc.log_step(step, fleet_case(step, 6, 1.0).batch())
            if step in (5, 11):             # flushes of steps 0-5, 6-11, then 12-31
                mc.flush()
    want = from_cells(con, path, "tokens", ["pool"], None, 0, 16, (2, 31))
    last_index = sorted((path / "steps").glob("*.parquet"))[-1]
    listed = binned.table_files
    fired = []

    def compaction_meanwhile(run_dir, table):
        if table.startswith(rollup.ROLLUP_DIR) and not fired:
            fired.append(table)
            hidden = last_index.with_suffix(".hidden")    # the last flush commits after the
            last_index.rename(hidden)                     # compaction's snapshot
            writer = RunLock(path)                        # its writer is live: holds the run
            writer.acquire()
            compact_run(path)
            writer.release()
            hidden.rename(last_index)
        return listed(run_dir, table)

    monkeypatch.setattr(binned, "table_files", compaction_meanwhile)
    got = query.aggregate_binned(con, path, "tokens", ["pool"], first=0, width=16, steps=(2, 31))
    assert fired
    assert_same(got, want, "tokens", ["pool"])


def test_steps_without_rows_of_a_table_read_from_rollups(con, tmp_path: Path) -> None:
    """Flushes whose steps carry no expert ids write no routing file: their blocks have no cells
    to add to the rollups of the others."""
    path = tmp_path / "run"
    with MismatchCollector(path, pools=POOLS, flush_every_steps=8, strict=True, alert_evaluator=None) as mc:
        for step in range(40):
            case = fleet_case(step, 7, 1.0)
            if step < 20:
                case = dataclasses.replace(case, trainer_experts=None, sampler_experts=None)
            mc.log_step(step, case.batch())
    for steps in ((0, 39), (10, 39)):
        got = query.aggregate_binned(con, path, "routing_layers", ["pool"], first=0, width=16, steps=steps)
        assert_same(got, from_cells(con, path, "routing_layers", ["pool"], None, 0, 16, steps),
                    "routing_layers", ["pool"])


def test_a_run_without_pool_labels_reads_through_rollups(con, tmp_path: Path) -> None:
    path = tmp_path / "run"
    with MismatchCollector(path, flush_every_steps=8, strict=True, alert_evaluator=None) as mc:
        for step in range(32):
            case = fleet_case(step, 8, 1.0)
            mc.log_step(step, dataclasses.replace(case, labels={"hardware": case.labels["hardware"]}).batch())
    assert served_blocks(con, path, "abs_hist", ["pool"], 0, 16, (0, 31)) == [0, 16]
    got = query.metric_series_binned(con, path, ["pool"], first=0, width=16, steps=(0, 31),
                                     metrics=["mismatch/n_tokens", "mismatch/abs_log_ratio/p99"])
    cells = query.metric_series_binned(con, path, ["pool"], first=0, width=1, steps=(0, 31),
                                       metrics=["mismatch/n_tokens"])
    assert got["pool"].isna().all() and len(got) == 2
    assert got["mismatch/n_tokens"].sum() == cells["mismatch/n_tokens"].sum()
    assert got["mismatch/abs_log_ratio/p99"].notna().all()
