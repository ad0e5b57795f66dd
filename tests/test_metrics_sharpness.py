"""The sharpness metrics: mean rho - 1 of the sampler's likely and unlikely tokens and the contrast
t between them, on tokens sampled from real softmax distributions over a 64-symbol vocabulary.

What is checked: a sampler at temperature 1 scored by a trainer at 0.7 (the temperature ignored,
or vLLM's raw log-probs) gives a large positive contrast, the trainer at 1 against a sampler at
0.7 a large negative one, and noise in the sampler's logits, of any size, never a positive one
above the alert's threshold (it makes the sampler look sharper); every value equals the float64
reference (t from np.std of the weights), also after a merge; and the contrast is null where a
side has fewer than two tokens or rho's spread is below what the sums resolve."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_monitor.alerts.definitions import SHARPNESS_SHIFT
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.metrics import report
from reference import Case, reference_metrics

pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig(chunk_tokens=1024)
C = "mismatch/sharpness/contrast_t"
KEYS = (C, "mismatch/sharpness/top_rho_shift", "mismatch/sharpness/low_rho_shift")
THRESHOLD = SHARPNESS_SHIFT.condition.threshold


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def sampled(seed: int, n: int, *, sampler_t: float = 1.0, trainer_t: float = 1.0, noise: float = 0.0,
            vocab: int = 64) -> Case:
    """n positions with logits N(0, 3^2); the sampler draws from softmax(z / sampler_t + noise) and
    reports that log-prob, the trainer scores the token under softmax(z / trainer_t)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 3.0, (n, vocab))
    sampler = log_softmax(z / sampler_t + rng.normal(0.0, noise, z.shape))
    trainer = log_softmax(z / trainer_t)
    token = (np.cumsum(np.exp(sampler), 1) < rng.random((n, 1))).sum(1).clip(max=vocab - 1)
    rows = np.arange(n)
    seq = rows // 50
    B = int(seq[-1]) + 1
    return Case(trainer=trainer[rows, token], sampler=sampler[rows, token], seq=seq, num_sequences=B,
                labels={"pool": ["a" if b % 3 else "b" for b in range(B)]})


def got(case: Case, by: list[str] | None = None):
    return report(compute_stats(case.batch(), CONFIG), by or [], CONFIG)


def assert_matches_reference(case: Case, by: list[str]) -> None:
    want, have = reference_metrics(case, CONFIG, by), got(case, by)
    if by:
        want, have = want.sort_values(by), have.sort_values(by)
    for key in KEYS:
        np.testing.assert_allclose(have[key].to_numpy(np.float64), want[key].to_numpy(np.float64),
                                   rtol=1e-9, atol=1e-12, err_msg=key)


def test_a_sampler_that_ignores_the_temperature_gives_a_large_positive_contrast():
    case = sampled(0, 3000, trainer_t=0.7)
    row = got(case).iloc[0]
    assert row[C] > 10 * THRESHOLD, row[C]
    assert row["mismatch/sharpness/top_rho_shift"] > 0 > row["mismatch/sharpness/low_rho_shift"]
    assert_matches_reference(case, [])
    assert_matches_reference(case, ["pool"])


def test_a_trainer_that_ignores_the_temperature_gives_a_large_negative_contrast():
    case = sampled(1, 3000, sampler_t=0.7)
    assert got(case).iloc[0][C] < -THRESHOLD
    assert_matches_reference(case, ["pool"])


@pytest.mark.parametrize("noise", [0.02, 0.1, 0.3, 1.0])
def test_noise_in_the_sampler_never_looks_like_a_sharper_trainer(noise):
    values = [got(sampled(seed, 20_000, noise=noise)).iloc[0][C] for seed in range(3)]
    assert max(values) < THRESHOLD, values
    if noise >= 0.3:   # large noise: the sampler is measurably sharper, the contrast clearly negative
        assert max(values) < -THRESHOLD, values


def test_the_contrast_of_merged_parts_is_the_contrast_of_the_whole():
    case = sampled(2, 6000, trainer_t=0.8, noise=0.05)
    owner = np.random.default_rng(2).integers(0, 4, case.num_sequences)
    parts = [compute_stats(case.select_sequences(np.flatnonzero(owner == r)).batch(), CONFIG) for r in range(4)]
    merged = report(merge(parts), ["pool"], CONFIG).set_index("pool")
    whole = got(case, ["pool"]).set_index("pool")
    for key in KEYS:
        np.testing.assert_allclose(merged[key], whole[key], rtol=1e-9, err_msg=key)


def test_the_contrast_is_null_where_a_side_cannot_decide():
    n = 400
    rng = np.random.default_rng(4)
    # bitwise agreement: rho = 1 exactly, no spread to resolve
    s = np.log(rng.uniform(1e-3, 1.0, n))
    same = Case(trainer=s.copy(), sampler=s, seq=np.arange(n) // 40, num_sequences=n // 40,
                labels={"pool": ["a"] * (n // 40)})
    assert np.isnan(got(same)[C]).all()
    # only likely tokens (p_S >= 0.5): no unlikely side
    top = np.log(rng.uniform(0.6, 1.0, n))
    likely = Case(trainer=top + rng.normal(0, 0.01, n).clip(max=-top), sampler=top, seq=np.arange(n) // 40,
                  num_sequences=n // 40, labels={"pool": ["a"] * (n // 40)})
    row = got(likely).iloc[0]
    assert np.isnan(row[C]) and np.isnan(row["mismatch/sharpness/low_rho_shift"])
    assert np.isfinite(row["mismatch/sharpness/top_rho_shift"])
    # one edge only: no bucket below the second-highest edge exists
    case = sampled(5, 2000, trainer_t=0.7)
    one_edge = MetricConfig(chunk_tokens=1024, lowprob_edges=(0.5,))
    assert np.isnan(report(compute_stats(case.batch(), one_edge), [], one_edge)[C]).all()
