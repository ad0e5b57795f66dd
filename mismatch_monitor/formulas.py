"""The vocabulary a metric is declared in, and its one interpreter.

A formula names the summed columns (``engine/fields.py``) it reads and how the metric follows
from them; :func:`evaluate` computes it on merged statistics (one value per group), so every
consumer (report, query layer, exporter, rules, dashboard) reads the same definition, and the
columns a metric needs are known without running it (:meth:`Formula.fields`).

An empty group (zero denominator) gives NaN, reported as null, never 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np

Columns = Mapping[str, object]


def f64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def divide(num: object, den: object) -> np.ndarray:
    """num / den where den > 0, else NaN (divides only there: no warning to silence)."""
    num, den = f64(num), f64(den)
    out = np.full(np.broadcast_shapes(num.shape, den.shape), np.nan)
    return np.divide(num, den, out=out, where=den > 0)


@dataclass(frozen=True)
class Value:
    """A merged column as it is: a count, or an extremum (merged by max/min)."""
    field: str

    def fields(self) -> tuple[str, ...]:
        return (self.field,)


@dataclass(frozen=True)
class Ratio:
    """``scale * num / den + offset``: a share of two counts, or a mean (a sum over its count)."""
    num: str
    den: str
    scale: float = 1.0
    offset: float = 0.0

    def fields(self) -> tuple[str, ...]:
        return (self.num, self.den)


@dataclass(frozen=True)
class Variance:
    """Unbiased sample variance from n, sum x and sum x^2 (NaN below two observations)."""
    sum: str
    sum_sq: str
    n: str
    of_mean: bool = False    # True: the squared standard error of the mean, variance / n

    def fields(self) -> tuple[str, ...]:
        return (self.sum, self.sum_sq, self.n)


@dataclass(frozen=True)
class StdError:
    """Standard error of the mean of x, from n, sum x and sum x^2."""
    sum: str
    sum_sq: str
    n: str

    def fields(self) -> tuple[str, ...]:
        return (self.sum, self.sum_sq, self.n)


@dataclass(frozen=True)
class ESS:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) of weights w."""
    sum_w: str
    sum_w2: str
    n: str

    def fields(self) -> tuple[str, ...]:
        return (self.sum_w, self.sum_w2, self.n)


@dataclass(frozen=True)
class LogESS:
    """ESS (sum w)^2 / (n sum w^2) of weights held as L1 = log sum w and L2 = log sum w^2 (fields
    merged by logsumexp): exp(2 L1 - L2) / n, never overflowing; ``chi2=True``: n sum w^2 /
    (sum w)^2 - 1 = 1 / ESS - 1."""
    log_sum_w: str
    log_sum_w2: str
    n: str
    chi2: bool = False

    def fields(self) -> tuple[str, ...]:
        return (self.log_sum_w, self.log_sum_w2, self.n)


@dataclass(frozen=True)
class Correlation:
    """Pearson correlation of x and y from n and the sums of x, y, x^2, y^2, xy.

    From sums the centred moments C_xx = sum x^2 - (sum x)^2 / n (and C_yy, C_xy) cancel: with
    every sum rounded in float64 (u = 2^-53, any order of adding and merging), each is off by at
    most about (3n + 4) u sqrt(sum x^2 sum y^2) (:func:`correlation_error_bound`), so the value is
    within (3n + 4) u (sqrt(sum x^2 sum y^2 / (C_xx C_yy)) + (sum x^2 / C_xx + sum y^2 / C_yy) / 2)
    of the exact one. NaN (null) below two observations, and where C_xx or C_yy is not above
    twice its rounding bound: the sums do not resolve any variance there (all values equal, to
    rounding), and a correlation would be noise."""
    sum_x: str
    sum_y: str
    sum_xx: str
    sum_yy: str
    sum_xy: str
    n: str

    def fields(self) -> tuple[str, ...]:
        return (self.sum_x, self.sum_y, self.sum_xx, self.sum_yy, self.sum_xy, self.n)


@dataclass(frozen=True)
class Quantile:
    """The ``q`` quantile of the histogram table the metric reads (nearest rank, clamped to the
    exact maximum ``clamp``); evaluated from histogram rows, not from summed columns."""
    q: float
    clamp: str = "max_abs_lr"

    def fields(self) -> tuple[str, ...]:
        return ("count",)


@dataclass(frozen=True)
class OpposedShift:
    """Whether the importance weight rho = pi / mu is above 1 on average in one group of tokens
    and below 1 in another, in standard errors. Per group, from n, d = sum (rho - 1) and
    q = sum rho^2: t = (d / n) / sqrt(C / (n (n - 1))), C = q - (n + d)^2 / n the centred sum of
    squares. The value is the smaller |t| of the two, with the sign of t_a, where t_a and t_b
    have opposite signs; 0 where they share one (or either is 0). NaN (null) below two tokens in
    either group, and where C is not above twice its rounding bound (3n + 4) 2^-53 q (as for
    :class:`Correlation`): the sums do not resolve the weights' spread there (rho equal to 1
    within ~1e-7, as in an exact or an fp32-close pool), and a t would be noise."""
    sum_dev_a: str
    sum_rho2_a: str
    n_a: str
    sum_dev_b: str
    sum_rho2_b: str
    n_b: str

    def fields(self) -> tuple[str, ...]:
        return (self.sum_dev_a, self.sum_rho2_a, self.n_a, self.sum_dev_b, self.sum_rho2_b, self.n_b)


Formula = Union[Value, Ratio, Variance, StdError, ESS, LogESS, Correlation, Quantile, OpposedShift]

UNIT_ROUNDOFF = 2.0 ** -53


def _variance(s: np.ndarray, s2: np.ndarray, n: np.ndarray) -> np.ndarray:
    mean = divide(s, n)
    return np.maximum(divide(s2 - n * mean * mean, n - 1), 0.0)


def _ess(sum_w: np.ndarray, sum_w2: np.ndarray, n: np.ndarray) -> np.ndarray:
    """A weight above ~e^354 overflows sum w^2 (and above ~e^709 sum w): then one weight
    dominates every other and the ratio's limit is 1/n, not the NaN of inf/inf, which would hide
    a collapse from the low-ESS alert."""
    with np.errstate(over="ignore", invalid="ignore"):
        ess = divide(np.square(sum_w), n * sum_w2)
    return np.where(np.isinf(sum_w2) & (n > 0), 1.0 / np.where(n > 0, n, 1.0), ess)


def _shift_t(d: np.ndarray, q: np.ndarray, n: np.ndarray) -> np.ndarray:
    """t of mean(rho - 1) from d = sum (rho - 1), q = sum rho^2 and n (see :class:`OpposedShift`)."""
    centred = q - n - 2.0 * d - d * divide(d, n)          # q - (n + d)^2 / n, NaN where n = 0
    resolved = (n >= 2) & (centred > 2.0 * (3.0 * n + 4.0) * UNIT_ROUNDOFF * q)
    se = np.sqrt(divide(np.where(resolved, centred, np.nan), n * (n - 1.0)))
    with np.errstate(invalid="ignore"):
        return np.where(resolved, divide(d, n) / se, np.nan)


def _opposed(t_a: np.ndarray, t_b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        smaller = np.sign(t_a) * np.minimum(np.abs(t_a), np.abs(t_b))
        return np.where(np.isnan(t_a) | np.isnan(t_b), np.nan, np.where(t_a * t_b < 0, smaller, 0.0))


def _centred(sx: np.ndarray, sy: np.ndarray, sxy: np.ndarray, n: np.ndarray) -> np.ndarray:
    """sum xy - sum x sum y / n (NaN where n = 0)."""
    return sxy - sx * divide(sy, n)


def correlation_error_bound(sx: object, sy: object, sxx: object, syy: object, sxy: object, n: object
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bound on the error of C_xx, of C_yy, of the correlation) from float64 sums of n terms
    (first order in u; see :class:`Correlation`)."""
    sx, sy, sxx, syy, sxy, n = map(f64, (sx, sy, sxx, syy, sxy, n))
    grow = (3.0 * n + 4.0) * UNIT_ROUNDOFF
    cxx, cyy = _centred(sx, sx, sxx, n), _centred(sy, sy, syy, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        r_bound = grow * (np.sqrt(sxx * syy / (cxx * cyy)) + 0.5 * (sxx / cxx + syy / cyy))
    return grow * sxx, grow * syy, r_bound


def _correlation(sx: np.ndarray, sy: np.ndarray, sxx: np.ndarray, syy: np.ndarray, sxy: np.ndarray,
                 n: np.ndarray) -> np.ndarray:
    cxx, cyy, cxy = _centred(sx, sx, sxx, n), _centred(sy, sy, syy, n), _centred(sx, sy, sxy, n)
    exx, eyy, _ = correlation_error_bound(sx, sy, sxx, syy, sxy, n)
    resolved = (n >= 2) & (cxx > 2.0 * exx) & (cyy > 2.0 * eyy)     # NaN compares False
    out = np.full(np.broadcast_shapes(cxy.shape, n.shape), np.nan)
    with np.errstate(invalid="ignore"):
        np.divide(cxy, np.sqrt(np.where(resolved, cxx * cyy, 1.0)), out=out, where=resolved)
    return np.clip(out, -1.0, 1.0)            # rounding can step past |r| = 1; NaN stays NaN


def evaluate(formula: Formula, cols: Columns) -> np.ndarray:
    """The formula's value per group of the merged columns ``cols`` ({field: [G]})."""
    args = [f64(cols[f]) for f in formula.fields()]
    if isinstance(formula, Value):
        return args[0]
    if isinstance(formula, Ratio):
        return formula.scale * divide(*args) + formula.offset
    if isinstance(formula, Variance):
        var = _variance(*args)
        return divide(var, args[2]) if formula.of_mean else var
    if isinstance(formula, StdError):
        return np.sqrt(divide(_variance(*args), args[2]))
    if isinstance(formula, ESS):
        return _ess(*args)
    if isinstance(formula, Correlation):
        return _correlation(*args)
    if isinstance(formula, OpposedShift):
        return _opposed(_shift_t(*args[:3]), _shift_t(*args[3:]))
    if isinstance(formula, LogESS):
        log_sum_w, log_sum_w2, n = args
        ok = n > 0
        log_ess = np.where(ok, 2.0 * log_sum_w - log_sum_w2 - np.log(np.where(ok, n, 1.0)), np.nan)
        return np.expm1(-log_ess) if formula.chi2 else np.exp(log_ess)
    raise TypeError(f"{type(formula).__name__} is evaluated from histogram rows, not summed columns")


def promql(formula: Formula, series: Mapping[str, str]) -> str:
    """The formula as PromQL over ``series`` (field -> a PromQL expression of its merged value:
    rates of counters, summed over the labels kept), for the formulas Prometheus can merge."""
    if isinstance(formula, Ratio) and formula.scale == 1.0 and formula.offset == 0.0:
        return f"{series[formula.num]} / {series[formula.den]}"
    raise ValueError(f"{formula} has no PromQL form over counters")
