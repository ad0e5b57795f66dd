"""Probability-space metrics (verl's parity currency): mean and max |p_T - p_S| and the Pearson
correlation of p_T and p_S, from summed fields. The correlation is checked against np.corrcoef on
the raw probabilities within the rounding bound its declaration states, also after merges, and is
null where it is undefined or the sums resolve no variance."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.formulas import correlation_error_bound
from mismatch_monitor.metrics import report
from reference import Case

pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig(chunk_tokens=1024)
R = "mismatch/prob_pearson_corr"


def flat_case(trainer: np.ndarray, sampler: np.ndarray, seq_len: int = 50) -> Case:
    N = len(trainer)
    seq = np.arange(N) // seq_len
    B = int(seq[-1]) + 1
    return Case(trainer=trainer, sampler=sampler, seq=seq, num_sequences=B,
                labels={"pool": ["a" if b % 3 else "b" for b in range(B)]})


def near_agreement(seed: int, n: int, noise: float) -> Case:
    """Probabilities spread over (0, 1], the trainer's a relative `noise` away: r just below 1."""
    rng = np.random.default_rng(seed)
    sampler = np.log(rng.uniform(1e-4, 1.0, n))
    trainer = np.minimum(sampler + rng.normal(0.0, noise, n), 0.0)
    return flat_case(trainer, sampler)


def stated_bound(stats) -> float:
    t = report(stats, [], CONFIG)
    sums = stats.marginal([])["tokens"]
    _, _, bound = correlation_error_bound(*(sums[c].to_numpy() for c in (
        "sum_p_trainer", "sum_p_sampler", "sum_p_trainer2", "sum_p_sampler2", "sum_p_cross", "n_tokens")))
    assert np.isfinite(t[R]).all()
    return float(bound[0])


@pytest.mark.parametrize("noise", [1e-2, 1e-4, 1e-6])
def test_correlation_is_within_its_stated_rounding_bound_of_corrcoef(noise):
    case = near_agreement(1, 20_000, noise)
    stats = compute_stats(case.batch(), CONFIG)
    got = float(report(stats, [], CONFIG)[R].iloc[0])
    t, s = case.logprobs()
    want = np.corrcoef(np.exp(t), np.exp(s))[0, 1]
    bound = stated_bound(stats)
    assert abs(got - want) <= bound + 4e-16, (got, want, bound)
    assert bound < 1e-9                      # the bound says something (1 - r is ~noise^2 here)


def test_correlation_of_merged_ranks_and_steps_is_within_the_bound_of_the_whole():
    case = near_agreement(2, 30_000, 1e-3)
    owner = np.random.default_rng(2).integers(0, 4, case.num_sequences)
    parts = [compute_stats(case.select_sequences(np.flatnonzero(owner == r)).batch(), CONFIG) for r in range(4)]
    merged = merge(parts)
    t, s = case.logprobs()
    want = np.corrcoef(np.exp(t), np.exp(s))[0, 1]
    got = float(report(merged, [], CONFIG)[R].iloc[0])
    assert abs(got - want) <= stated_bound(merged) + 4e-16
    by_pool = report(merged, ["pool"], CONFIG).set_index("pool")
    pools = np.array(case.labels["pool"])[case.seq]
    for pool in ("a", "b"):
        m = pools == pool
        want_pool = np.corrcoef(np.exp(t[m]), np.exp(s[m]))[0, 1]
        assert abs(by_pool.loc[pool, R] - want_pool) < 1e-10


def test_undefined_or_unresolved_correlation_is_null():
    one = flat_case(np.array([-1.0]), np.array([-1.5]))
    assert np.isnan(report(compute_stats(one.batch(), CONFIG), [], CONFIG)[R]).all()
    # every sampler probability equal: no variance, no correlation (not 0, not 1)
    n = 500
    rng = np.random.default_rng(3)
    same = flat_case(np.log(rng.uniform(0.1, 1.0, n)), np.full(n, -0.5))
    got = report(compute_stats(same.batch(), CONFIG), [], CONFIG)
    assert np.isnan(got[R]).all()
    assert got["mismatch/abs_prob_diff/mean"].notna().all()
    # probabilities 1 - O(1e-12): the spread sits below what float64 sums of p^2 resolve
    tiny = flat_case(-1e-12 * rng.uniform(0, 1, n), -1e-12 * rng.uniform(0, 1, n))
    assert np.isnan(report(compute_stats(tiny.batch(), CONFIG), [], CONFIG)[R]).all()


def test_probability_differences_of_tiny_log_ratios_keep_their_digits():
    # lr = 1e-9: exp(t) - exp(s) in float64 keeps ~7 digits; p_S expm1(lr) keeps them all
    n = 400
    s = np.log(np.random.default_rng(4).uniform(0.2, 1.0, n))
    lr = np.full(n, 1e-9)
    case = flat_case(s + lr, s)
    t, s = case.logprobs()
    exact = np.exp(s) * np.expm1(t - s)          # t - s is exact here (Sterbenz)
    got = report(compute_stats(case.batch(), CONFIG), [], CONFIG)
    assert got["mismatch/abs_prob_diff/mean"].iloc[0] == pytest.approx(np.mean(np.abs(exact)), rel=1e-13)
    assert got["mismatch/abs_prob_diff/max"].iloc[0] == pytest.approx(np.max(np.abs(exact)), rel=1e-13)
