"""The tests behind the sample-size-aware rules, written twice with the same operations: numpy
for the in-process evaluator and PromQL for the rendered rules.

Both sides do the same float64 operations in the same order (``+ - * /``, ``sqrt``, ``ceil``,
``floor``, ``^``), so a verdict differs only where a statistic lands within an ulp of its
threshold. Counts are rounded to whole numbers before they are summed, so a sum over a window
is exact on both sides whatever the summation order.

The count test is the Wilson-Hilferty form of the Poisson upper tail: for ``k`` events where
``lam`` are expected, ``P(X >= k) = P(chi2_{2k} <= 2 lam)`` and

    z = 3 sqrt(k) (1 - 1/(9k) - (lam/k)^(1/3))

is close to standard normal (its tail probabilities are within a few per cent of the exact ones
from k = 1 on). The Poisson tail bounds the binomial tail from above for k >= n p + 1
(Anderson & Samuels 1967), so testing a binomial count this way errs on the quiet side.
"""

from __future__ import annotations

import math

import numpy as np

THIRD = 1.0 / 3.0


def poisson_z(k: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """Wilson-Hilferty z of ``k`` events against ``lam`` expected (NaN where k = 0: no rise)."""
    with np.errstate(all="ignore"):
        return np.sqrt(k) * 3.0 * (1.0 - 1.0 / (9.0 * k) - (lam / k) ** THIRD)


def poisson_z_promql(k: str, lam: str) -> str:
    """:func:`poisson_z` as PromQL over two instant-vector expressions (same operations)."""
    return f"sqrt({k}) * 3 * (1 - 1 / (9 * {k}) - ({lam} / {k}) ^ {THIRD!r})"


def poisson_lower_z(k: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Wilson-Hilferty z of *at most* ``k`` events where ``mu`` are expected:
    ``P(X <= k) = P(chi2_{2(k+1)} > 2 mu)``; large when ``k`` is significantly below ``mu``."""
    with np.errstate(all="ignore"):
        return np.sqrt(k + 1) * 3.0 * ((mu / (k + 1)) ** THIRD - 1.0 + 1.0 / (9.0 * (k + 1)))


def poisson_lower_z_promql(k: str, mu: str) -> str:
    """:func:`poisson_lower_z` as PromQL (same operations)."""
    return f"sqrt({k} + 1) * 3 * (({mu} / ({k} + 1)) ^ {THIRD!r} - 1 + 1 / (9 * ({k} + 1)))"


def rounded(x: np.ndarray) -> np.ndarray:
    """PromQL's ``round``: floor(x + 0.5)."""
    return np.floor(x + 0.5)


def sequential_sum(values: np.ndarray) -> float:
    """Sum in time order, as ``sum_over_time`` does (0.0 for no values; callers check counts)."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


def upper_normal_tail(z: float) -> float:
    """P(Z > z) of a standard normal (for the false-alarm rates the docs state)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))
