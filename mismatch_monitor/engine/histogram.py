"""Log-spaced histograms with a relative-accuracy guarantee (DDSketch-style bins).

With gamma = (1 + alpha) / (1 - alpha), bin i >= 1 holds |x| in (gamma^(k-1), gamma^k] for
k = i + k_min - 1 and is read back as 2 gamma^k / (gamma + 1), which is within alpha (relative)
of every value in the bin; k_min = ceil(log_gamma hist_min) and k_max = ceil(log_gamma hist_max),
so the regular bins cover [hist_min, hist_max] (their outer edges lie at most one bin beyond).
Bin 0 holds |x| <= gamma^(k_min - 1) < hist_min (read as 0); the last bin holds
|x| > gamma^k_max >= hist_max (read as the exact maximum when it is known). Signed histograms
store negative values in negative bins (bin -i mirrors bin i), so one integer column serves both.

Bins are plain integer counts: histograms merge exactly by adding counts per bin.

A quantile q is the nearest-rank order statistic: the k-th smallest value, k = max(1, ceil(q n)).
Read from the histogram it is within alpha of that order statistic (values inside
[hist_min, hist_max]), and never outside [exact min, exact max] when those are passed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from ..config import MetricConfig

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))


@dataclass(frozen=True)
class LogBins:
    alpha: float
    min_value: float
    max_value: float

    @classmethod
    def from_config(cls, config: MetricConfig) -> "LogBins":
        return cls(config.hist_relative_accuracy, config.hist_min, config.hist_max)

    @property
    def gamma(self) -> float:
        return (1 + self.alpha) / (1 - self.alpha)

    @property
    def log_gamma(self) -> float:
        return math.log(self.gamma)

    @property
    def k_min(self) -> int:
        return math.ceil(math.log(self.min_value) / self.log_gamma)

    @property
    def k_max(self) -> int:
        return math.ceil(math.log(self.max_value) / self.log_gamma)

    @property
    def num_bins(self) -> int:
        """Unsigned bins: zero bin, k_min..k_max, overflow bin."""
        return self.k_max - self.k_min + 3

    @property
    def overflow_bin(self) -> int:
        return self.num_bins - 1

    def index(self, abs_x: torch.Tensor) -> torch.Tensor:
        """Unsigned bin of each |x| (float64 tensor, >= 0, no NaN) as int64."""
        # ceil(log_gamma x) - (k_min - 1), clamped: log(0) = -inf lands in the zero bin and
        # anything above gamma^k_max in the overflow bin; in place, one temporary
        k = torch.log(abs_x).mul_(1.0 / self.log_gamma).sub_(self.k_min - 1).ceil_()
        return k.clamp_(0, self.overflow_bin).to(torch.int64)

    def upper_edges(self) -> np.ndarray:
        """[num_bins] float64 upper edge of every unsigned bin: gamma^(k_min - 1) for the zero
        bin, gamma^k for the regular bins, +inf for the overflow bin. The compiled token pass
        compares |x| with these; ``index`` computes ceil(log_gamma x) instead, so a value within
        a few ulp of an edge may fall on the other side of it there (both meet the alpha bound)."""
        k = np.arange(self.k_min - 1, self.k_max + 1, dtype=np.float64)
        return np.concatenate((np.power(self.gamma, k), [np.inf]))

    def signed_index(self, x: torch.Tensor) -> torch.Tensor:
        i = self.index(x.abs())
        return torch.where(x < 0, -i, i)

    def representative(self, bins: np.ndarray, exact_max_abs: np.ndarray | float | None = None) -> np.ndarray:
        """Value each (signed) bin reads as."""
        b = np.asarray(bins, dtype=np.int64)
        mag = np.abs(b)
        k = mag + (self.k_min - 1)
        rep = 2.0 * np.power(self.gamma, k.astype(np.float64)) / (self.gamma + 1.0)
        rep = np.where(mag == 0, 0.0, rep)
        over = np.full(b.shape, float(self.max_value)) if exact_max_abs is None else np.broadcast_to(
            np.asarray(exact_max_abs, dtype=np.float64), b.shape)
        rep = np.where(mag == self.overflow_bin, over, rep)
        return np.where(b < 0, -rep, rep)

    def lower_edge(self, bins: np.ndarray) -> np.ndarray:
        """Lower edge of each unsigned bin (for plots)."""
        b = np.asarray(bins, dtype=np.int64)
        k = b + (self.k_min - 1)
        edge = np.power(self.gamma, (k - 1).astype(np.float64))
        edge = np.where(b == 0, 0.0, edge)
        return np.where(b == self.overflow_bin, self.max_value, edge)


@functools.lru_cache(maxsize=64)
def _as_fraction(q: float) -> tuple[int, int]:
    frac = Fraction(repr(q)).limit_denominator(1_000_000)
    return frac.numerator, frac.denominator


def nearest_rank(q: float, total: np.ndarray) -> np.ndarray:
    """1-based rank max(1, ceil(q n)) in exact integer arithmetic, q read as the fraction it
    is written as (0.999 = 999/1000): a float product q * n may land just above an integer."""
    num, den = _as_fraction(float(q))
    n = np.asarray(total, dtype=np.int64)
    whole, rest = np.divmod(n, den)                 # q n = num whole + num rest / den
    return np.maximum(1, num * whole + -((-num * rest) // den))


_DENSE_MAX = 1 << 16      # groups x bins up to which quantiles read dense histograms


def quantiles_from_counts(
    bins: LogBins,
    group: np.ndarray,
    bin_index: np.ndarray,
    counts: np.ndarray,
    qs: tuple[float, ...],
    exact_min: np.ndarray | None = None,
    exact_max: np.ndarray | None = None,
) -> np.ndarray:
    """Quantiles per group from sparse histogram rows.

    group: [R] int codes 0..G-1; bin_index, counts: [R]. exact_min / exact_max: [G] (optional)
    clamp the estimates. Returns [G, len(qs)] float64, NaN for groups with no count.
    """
    group = np.asarray(group, dtype=np.int64)
    bin_index = np.asarray(bin_index, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    G = int(exact_max.shape[0]) if exact_max is not None else (int(group.max()) + 1 if group.size else 0)
    out = np.full((G, len(qs)), np.nan)
    if group.size == 0:
        return out
    lo, hi = int(bin_index.min()), int(bin_index.max())
    width = hi - lo + 1
    if G * width <= _DENSE_MAX:
        # few groups: the groups' dense histograms one after another, by one bincount instead of
        # a sort (empty bins never hold a quantile: the search below lands on a bin with counts)
        dense = np.bincount(group * width + (bin_index - lo), weights=counts, minlength=G * width)
        dense = dense.astype(np.int64)
        cum = np.cumsum(dense)
        b = np.tile(np.arange(lo, hi + 1, dtype=np.int64), G)
        total = dense.reshape(G, width).sum(1)
    else:
        order = np.lexsort((bin_index, group))  # by group, then bin
        g, b, c = group[order], bin_index[order], counts[order]
        cum = np.cumsum(c)
        total = np.bincount(g, weights=c, minlength=G).astype(np.int64)
    start = np.concatenate(([0], np.cumsum(total)[:-1]))  # cumulative count before each group
    last = None if exact_max is None else np.asarray(exact_max, dtype=np.float64)
    gi = np.nonzero(total > 0)[0]
    # every quantile of every group in one search: ranks [groups, quantiles]
    rank = np.stack([nearest_rank(q, total[gi]) for q in qs], axis=1)
    pos = np.searchsorted(cum, (start[gi, None] + rank).ravel(), side="left")
    over = None if last is None else np.repeat(np.abs(last[gi]), len(qs))
    out[gi] = bins.representative(b[pos], over).reshape(len(gi), len(qs))
    if exact_max is not None:
        out = np.minimum(out, np.asarray(exact_max, dtype=np.float64)[:, None])
    if exact_min is not None:
        out = np.maximum(out, np.asarray(exact_min, dtype=np.float64)[:, None])
    return out
