"""A step logged and read back through DuckDB equals the engine's statistics exactly, and
marginals computed in SQL equal marginals merged in memory."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.collectors.checks import with_pool_labels
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.engine.fields import TABLES, merge_rules
from mismatch_monitor.engine.stats import key_columns
from mismatch_monitor.metrics import report
from mismatch_monitor.store import SCHEMA_VERSION, read_run_info
from mismatch_monitor.store.schema import SCHEMA_KEY

from synthetic import make_batch

STEPS = 5


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "r1"
    batches = [make_batch(s) for s in range(STEPS)]
    pools = {"bf16": {"hardware": "H100", "precision": "bf16", "engine": "vllm 0.11"},
             "fp8": {"hardware": "H100", "precision": "fp8"}, "stale": {"hardware": "A100"}}
    with MismatchCollector(run, pools=pools, flush_every_steps=2) as mc:
        reports = [mc.log_step(s, b) for s, b in enumerate(batches)]
    # the collector fills hardware/precision/engine from the pool metadata
    stats = [compute_stats(with_pool_labels(b, pools)) for b in batches]
    return run, stats, reports


def _canon(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    df = df.copy()
    for k in keys:
        if k in df and df[k].dtype == object:
            df[k] = df[k].astype("string")
    return df.sort_values(keys, na_position="first").reset_index(drop=True)


@pytest.mark.parametrize("table", list(TABLES))
def test_cells_read_back_exactly(logged, table):
    run, stats, _ = logged
    con = query.connect()
    dims = list(stats[0].dims)
    keys = key_columns(table, dims)
    extra = list(TABLES[table][0])
    got = query.aggregate(con, run, table, [k for k in keys if k not in extra])
    for step, st in enumerate(stats):
        want = st[table]
        have = got[got["step"] == step].drop(columns=["step", "wall_time"])
        assert len(have) == len(want), f"{table} step {step}: {len(have)} rows read, {len(want)} written"
        have, want = _canon(have, keys), _canon(want, keys)
        for col in merge_rules(table):
            np.testing.assert_array_equal(have[col].to_numpy(np.float64), want[col].to_numpy(np.float64),
                                          err_msg=f"{table}.{col} step {step}")
        for k in keys:
            assert have[k].astype("string").fillna("<null>").tolist() == \
                want[k].astype("string").fillna("<null>").tolist(), k


@pytest.mark.parametrize("by", [(), ("pool",), ("pool", "length_bucket"), ("hardware",),
                                ("pool", "turn_bucket")])
def test_sql_marginals_equal_in_memory_merge(logged, by):
    run, stats, _ = logged
    con = query.connect()
    got = query.metric_series(con, run, list(by))
    for step, st in enumerate(stats):
        want = report(st, list(by))
        have = got[got["step"] == step].drop(columns=["step", "wall_time"]).reset_index(drop=True)
        assert len(have) == len(want)
        if by:
            have, want = _canon(have, list(by)), _canon(want, list(by))
        for col in want.columns:
            if col in by:
                continue
            np.testing.assert_allclose(have[col].to_numpy(np.float64), want[col].to_numpy(np.float64),
                                       rtol=1e-10, atol=1e-12, equal_nan=True, err_msg=f"{by} {col}")


def test_all_steps_marginal_equals_merge_of_steps(logged):
    run, stats, _ = logged
    con = query.connect()
    have = query.metric_series(con, run, ["pool"], per_step=False)
    want = report(merge(stats), ["pool"])
    have, want = _canon(have, ["pool"]), _canon(want, ["pool"])
    for col in want.columns[1:]:
        np.testing.assert_allclose(have[col].to_numpy(np.float64), want[col].to_numpy(np.float64),
                                   rtol=1e-10, atol=1e-12, equal_nan=True, err_msg=col)


def test_report_keys_match_engine(logged):
    _, stats, reports = logged
    last = report(stats[-1], ["pool"]).set_index("pool")
    r = reports[-1]
    assert r["mismatch/pool=fp8/k3_kl"] == pytest.approx(last.loc["fp8", "mismatch/k3_kl"], rel=1e-12)
    assert r["mismatch/k3_kl"] == pytest.approx(report(stats[-1])["mismatch/k3_kl"].iloc[0], rel=1e-12)
    assert r["mismatch/collector_errors"] == 0
    # null metrics are omitted, never reported as 0.0
    assert "mismatch/routing/flip_rate" not in r


def test_run_json_and_schema_stamp(logged):
    run, _, _ = logged
    info = read_run_info(run)
    assert info["pools"]["bf16"]["engine"] == "vllm 0.11"
    assert info["closed_at"] is not None and info["config"]["tis_cap"] == 2.0
    for table in ("tokens", "abs_hist", "steps", "exemplar_tokens"):
        files = sorted((run / table).glob("*.parquet"))
        assert files, table
        meta = pq.read_schema(files[0]).metadata
        assert meta[SCHEMA_KEY] == str(SCHEMA_VERSION).encode()


def test_exemplars_are_the_worst_tokens(logged):
    run, stats, _ = logged
    con = query.connect()
    ex = query.rows(con, run, "exemplar_tokens", steps=(STEPS - 1, STEPS - 1))
    assert len(ex) == 16
    tokens = stats[-1]["tokens"]
    assert ex["abs_log_ratio"].max() == pytest.approx(tokens["max_abs_lr"].max(), rel=0, abs=0)
    np.testing.assert_allclose(ex["log_ratio"], ex["trainer_logprob"] - ex["sampler_logprob"])
    assert set(ex["pool"]) <= {"bf16", "fp8", "stale"}


def test_empty_run_queries_are_empty(tmp_path):
    run = tmp_path / "empty"
    MismatchCollector(run).close()
    con = query.connect()
    assert query.steps_index(con, run).empty
    assert query.latest(con, run).empty
    assert query.metric_series(con, run, ["pool"]).empty
    assert query.rows(con, run, "alerts").empty


def test_missing_labels_are_null_not_a_string(tmp_path):
    t = -torch.rand(4, 6, dtype=torch.float64)
    s = t - 1e-3
    pools = {"a": {"hardware": "H100"}}
    with MismatchCollector(tmp_path / "r", pools=pools) as mc:
        mc.log_step(0, trainer_logprobs=t, sampler_logprobs=s, response_mask=torch.ones(4, 6),
                    labels={"pool": ["a", None, "a", None]})
    got = query.metric_series(query.connect(), tmp_path / "r", ["pool", "hardware"],
                              metrics=["mismatch/n_tokens"])
    rows = {(None if pd.isna(p) else p, None if pd.isna(h) else h): n
            for p, h, n in zip(got["pool"], got["hardware"], got["mismatch/n_tokens"])}
    assert rows == {("a", "H100"): 12, (None, None): 12}


def test_several_runs_at_once(logged, tmp_path):
    run, stats, _ = logged
    other = tmp_path / "other"
    with MismatchCollector(other, run_id="other-run", alert_evaluator=None) as mc:
        mc.log_step(0, make_batch(0, seed=3, scale=0.2))
    MismatchCollector(tmp_path / "empty").close()
    con = query.connect()
    both = query.metric_series_runs(con, [run, other, tmp_path / "empty"], ["pool"],
                                    metrics=["mismatch/k3_kl"])
    assert list(both.columns) == ["run", "step", "wall_time", "pool", "mismatch/k3_kl"]
    assert both.groupby("run").size().to_dict() == {"r1": 3 * STEPS, "other-run": 3}
    mine = both[both["run"] == "r1"].drop(columns="run").reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, query.metric_series(con, run, ["pool"], metrics=["mismatch/k3_kl"]))
