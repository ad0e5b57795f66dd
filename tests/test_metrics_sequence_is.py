"""Sequence-level IS: ESS and chi^2 of w_i = exp(sum_t lr), stored as log sum w and log sum w^2
(merged by logsumexp), so sequence sums of +-800 nats, whose exp overflows, still merge: across
ranks, steps and slices in numpy, and in the SQL DuckDB runs over a stored run (cells and rollups).
References scale the weights by their largest, w / max w, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.metrics import report
from reference import Case, reference_sequence_is

CONFIG = MetricConfig(chunk_tokens=1024)
KEYS = ("mismatch/seq/is_ess", "mismatch/seq/is_chi2")
POOLS = ("a", "b")


def extreme_case(seed: int, B: int = 24, T: int = 100) -> tuple[Case, np.ndarray]:
    """B sequences of T tokens whose sums of lr reach +-800 (|lr| up to 8 a token)."""
    rng = np.random.default_rng(seed)
    per_token = rng.uniform(-8.0, 8.0, B)
    per_token[:2] = (8.0, -8.0)                          # S = +800 and -800
    sampler = -rng.uniform(8.0, 9.0, (B, T)) + np.minimum(per_token, 0.0)[:, None]
    trainer = sampler + per_token[:, None]
    seq = np.repeat(np.arange(B), T)
    case = Case(trainer=trainer.ravel(), sampler=sampler.ravel(), seq=seq, num_sequences=B,
                labels={"pool": [POOLS[b % 2] for b in range(B)]})
    t, s = case.logprobs()
    return case, np.bincount(seq, weights=t - s, minlength=B)


def test_sums_of_800_nats_overflow_exp_but_not_the_metric():
    case, seq_lr = extreme_case(0)
    assert seq_lr.max() == pytest.approx(800.0) and seq_lr.min() == pytest.approx(-800.0)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(seq_lr).sum())            # the naive sum of weights overflows
    got = report(compute_stats(case.batch(), CONFIG), [], CONFIG)
    want = reference_sequence_is(seq_lr)
    for key in KEYS:
        assert np.isfinite(got[key].iloc[0])
        assert got[key].iloc[0] == pytest.approx(want[key], rel=1e-12)
    assert got["mismatch/seq/is_ess"].iloc[0] == pytest.approx(1.0 / case.num_sequences, rel=1e-9)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_merges_of_ranks_steps_and_slices_equal_the_one_shot_value(seed):
    case, seq_lr = extreme_case(seed)
    owner = np.random.default_rng(seed).integers(0, 3, case.num_sequences)
    ranks = [compute_stats(case.select_sequences(np.flatnonzero(owner == r)).batch(), CONFIG) for r in range(3)]
    whole = compute_stats(case.batch(), CONFIG)
    merged = merge(ranks)
    for by in ([], ["pool"], ["length_bucket"]):
        a, b = report(merged, by, CONFIG), report(whole, by, CONFIG)
        for key in KEYS:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-12)
    # the pool marginal against the reference of each pool's sequences
    by_pool = report(merge(ranks[::-1]), ["pool"], CONFIG).set_index("pool")
    pools = np.array(case.labels["pool"])
    for pool in POOLS:
        want = reference_sequence_is(seq_lr[pools == pool])
        for key in KEYS:
            assert by_pool.loc[pool, key] == pytest.approx(want[key], rel=1e-12)


def test_duckdb_merges_a_stored_run_like_the_engine(tmp_path):
    torch.set_num_threads(1)
    steps = [extreme_case(10 + step, B=12, T=60)[0] for step in range(40)]    # rollup blocks of 16 steps
    with MismatchCollector(tmp_path / "run", flush_every_steps=5, strict=True, alert_evaluator=None) as mc:
        for step, case in enumerate(steps):
            mc.log_step(step, case.batch())
    whole = merge([compute_stats(c.batch(), MetricConfig()) for c in steps])
    want = report(whole, ["pool"]).set_index("pool")
    con = query.connect()
    try:
        sql_total = query.metric_series(con, tmp_path / "run", ["pool"], metrics=list(KEYS), per_step=False)
        binned = query.metric_totals(con, tmp_path / "run", ["pool"], metrics=list(KEYS))
    finally:
        con.close()
    for got in (sql_total.set_index("pool"), binned.set_index("pool")):
        for key in KEYS:
            np.testing.assert_allclose(got.loc[list(POOLS), key], want.loc[list(POOLS), key], rtol=1e-12)
    assert (want["mismatch/seq/is_ess"] < 0.5).all()
