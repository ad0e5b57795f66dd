"""Every threshold the metric engine uses, in one typed, validated config.

Each option is documented here and nowhere else; everything downstream (Parquet columns,
dashboard labels, alert descriptions) reads the values from an instance of this class.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

KERNELS = ("auto", "native", "torch")
# options that change how the engine computes, not what its statistics mean: every other option
# is a parameter of the statistics (a bin edge, a band, a bucket edge, a threshold)
EXECUTION_OPTIONS = ("chunk_tokens", "kernel")
# (option, value) of every option a table's meaning depends on, in declaration order
StatsParameters = tuple[tuple[str, Any], ...]


def _increasing(name: str, values: tuple[float, ...], *, positive: bool = True) -> None:
    if len(values) == 0:
        raise ValueError(f"expected at least one edge in {name}, got an empty tuple")
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"expected finite edges in {name}, got {values}")
    if positive and values[0] <= 0:
        raise ValueError(f"expected positive edges in {name}, got {values}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"expected strictly increasing edges in {name}, got {values}")


def _band(name: str, band: tuple[float, float]) -> None:
    if len(band) != 2 or not (0 < band[0] < 1 < band[1]) or not math.isfinite(band[1]):
        raise ValueError(f"expected {name} = (lo, hi) with 0 < lo < 1 < hi, got {band}")


@dataclass(frozen=True)
class MetricConfig:
    """Thresholds and bucket edges of the metric engine.

    Attributes:
        tis_cap: truncated-IS cap C. Tokens with rho > C count as clipped high, rho < 1/C as
            clipped low; the capped ESS uses min(rho, C).
        icepop_band: IcePop band [lo, hi]; tokens with rho outside it count as masked.
        extreme_band: the "extreme ratio" band; tokens outside it count as extreme.
        ppo_clip_eps: epsilon of a PPO ratio clip [1 - eps, 1 + eps], 0 < eps < 1; tokens with rho
            outside it are what the clip would cut from the mismatch alone (before any update).
        lowprob_edges: sampler-probability bucket edges. Bucket i holds tokens with
            edges[i-1] <= p < edges[i]; the first bucket is p < edges[0], the last p >= edges[-1].
        length_edges: response-length bucket edges (tokens). Bucket i holds lengths in
            [edges[i-1], edges[i]); the first bucket is < edges[0], the last >= edges[-1].
        turn_edges: turn-index bucket edges, same convention as length_edges. With the default
            (1, 2, 4, 8, 16) the buckets are turn 0, 1, 2-3, 4-7, 8-15, 16+.
        seq_product_band: sequence-level product ratio exp(sum lr) band; sequences outside it
            are what a product (sequence-IS) mask drops.
        seq_geometric_band: band on the geometric-mean ratio exp(mean lr) of a sequence.
        seq_mult_error_threshold: a sequence whose mean exp(|lr|) exceeds this is dropped by the
            NeMo-RL style sequence threshold (2.0 in one published recipe).
        neg_adv_delta: a sequence with negative advantage and mean(-lr) > delta is dropped by the
            DeepSeek-style off-policy sequence mask.
        positive_logprob_tol: a log-prob above this is invalid (probability > 1) and set aside.
        hist_relative_accuracy: alpha of the log-spaced |lr| histogram; every quantile read from
            it is within alpha (relative) of the exact order statistic, for values inside
            [hist_min, hist_max].
        hist_min: values with |x| below this fall in the zero bin (reported as 0); precisely,
            the zero bin ends at the last bin edge gamma^k below hist_min.
        hist_max: values above this fall in the overflow bin (reported as the exact maximum);
            precisely, the overflow bin starts at the first bin edge gamma^k at or above hist_max.
        staleness_max: staleness (trainer version - sampler version) is histogrammed as
            0..staleness_max, larger values in the last bin.
        chunk_tokens: tokens processed per pass; bounds the engine's extra memory.
        kernel: which implementation of the per-token loops runs: "auto" takes the compiled
            loops (built by ``pip install`` with a C compiler) for CPU tensors and torch ops
            otherwise (on CPU tensors it warns once when it cannot take them, naming why and
            the cost: the torch ops take ~4x as long); "native" requires the compiled loops;
            "torch" always runs torch ops. All compute the same statistics (engine/native.py).
            kernel and chunk_tokens change how the statistics are computed, not what they
            mean: they are the only options stats of another config may differ in and still
            merge or be read (``stats_parameters``).
    """

    tis_cap: float = 2.0
    icepop_band: tuple[float, float] = (0.5, 5.0)
    extreme_band: tuple[float, float] = (0.2, 5.0)
    ppo_clip_eps: float = 0.2
    lowprob_edges: tuple[float, ...] = (1e-3, 1e-2, 0.1, 0.5)
    length_edges: tuple[int, ...] = tuple(2**k for k in range(4, 16))
    turn_edges: tuple[int, ...] = (1, 2, 4, 8, 16)
    seq_product_band: tuple[float, float] = (0.5, 2.0)
    seq_geometric_band: tuple[float, float] = (0.99, 1.01)
    seq_mult_error_threshold: float = 2.0
    neg_adv_delta: float = 0.01
    positive_logprob_tol: float = 1e-3
    hist_relative_accuracy: float = 0.01
    hist_min: float = 1e-9
    hist_max: float = 1e3
    staleness_max: int = 64
    chunk_tokens: int = 1 << 18
    kernel: str = "auto"

    def __post_init__(self) -> None:
        # tuples from JSON arrive as lists; freeze them so the config stays hashable
        for name in ("icepop_band", "extreme_band", "lowprob_edges", "length_edges",
                     "turn_edges", "seq_product_band", "seq_geometric_band",):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not (math.isfinite(self.tis_cap) and self.tis_cap > 1.0):
            raise ValueError(f"expected tis_cap > 1.0, got {self.tis_cap}")
        for name in ("icepop_band", "extreme_band", "seq_product_band", "seq_geometric_band"):
            _band(name, getattr(self, name))
        if not (isinstance(self.ppo_clip_eps, (int, float)) and 0.0 < self.ppo_clip_eps < 1.0):
            raise ValueError(f"expected 0 < ppo_clip_eps < 1 (the band [1 - eps, 1 + eps] around rho = 1), "
                             f"got {self.ppo_clip_eps!r}")
        _increasing("lowprob_edges", self.lowprob_edges)
        if self.lowprob_edges[-1] > 1.0:
            raise ValueError(f"expected lowprob_edges <= 1.0, got {self.lowprob_edges}")
        _increasing("length_edges", self.length_edges)
        _increasing("turn_edges", self.turn_edges)
        for name in ("length_edges", "turn_edges"):
            if any(int(v) != v for v in getattr(self, name)):
                raise ValueError(f"expected integer {name}, got {getattr(self, name)}")
        if not self.seq_mult_error_threshold > 1.0:
            raise ValueError(
                f"expected seq_mult_error_threshold > 1.0, got {self.seq_mult_error_threshold}")
        if not (math.isfinite(self.neg_adv_delta) and self.neg_adv_delta >= 0):
            raise ValueError(f"expected neg_adv_delta >= 0, got {self.neg_adv_delta}")
        if not self.positive_logprob_tol >= 0:
            raise ValueError(f"expected positive_logprob_tol >= 0, got {self.positive_logprob_tol}")
        if not 0 < self.hist_relative_accuracy < 0.5:
            raise ValueError(
                f"expected 0 < hist_relative_accuracy < 0.5, got {self.hist_relative_accuracy}")
        if not 0 < self.hist_min < self.hist_max < math.inf:
            raise ValueError(
                f"expected 0 < hist_min < hist_max, got hist_min={self.hist_min}, "
                f"hist_max={self.hist_max}")
        if not (isinstance(self.staleness_max, int) and self.staleness_max >= 1):
            raise ValueError(f"expected integer staleness_max >= 1, got {self.staleness_max!r}")
        if not (isinstance(self.chunk_tokens, int) and self.chunk_tokens >= 1024):
            raise ValueError(f"expected integer chunk_tokens >= 1024, got {self.chunk_tokens!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"expected kernel in {KERNELS}, got {self.kernel!r}")

    def stats_parameters(self) -> StatsParameters:
        """The options the engine's tables mean something under (all but EXECUTION_OPTIONS):
        histogram bins read with another accuracy, or counts of another band, are other numbers."""
        return tuple((k, v) for k, v in asdict(self).items() if k not in EXECUTION_OPTIONS)

    @classmethod
    def from_stats_parameters(cls, params: StatsParameters) -> "MetricConfig":
        """The config statistics with these parameters were computed under (execution options
        at their defaults)."""
        return cls(**dict(params))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MetricConfig":
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown MetricConfig options {sorted(unknown)}; expected {sorted(known)}")
        return cls(**data)


def parameter_differences(a: StatsParameters, b: StatsParameters) -> list[str]:
    """``name: value in a vs value in b`` for every parameter on which ``a`` and ``b`` differ."""
    left, right = dict(a), dict(b)
    return [f"{k}: {left.get(k)!r} vs {right.get(k)!r}" for k in list(left) + [k for k in right if k not in left]
            if left.get(k) != right.get(k)]
