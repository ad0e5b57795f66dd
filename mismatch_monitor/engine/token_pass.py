"""One chunked pass over the tokens: per-cell and per-sequence sufficient statistics.

Every quantity is accumulated with ``bincount``/``index_add_``/``scatter_reduce_`` into dense
per-cell accumulators in float64 (bincount with float32 weights would accumulate in float32).
Invalid tokens (non-finite, or a log-prob above the tolerance) are routed to one extra "dump"
cell and one extra "dump" sequence that are dropped at the end, so a single NaN never touches
a statistic and the hot path needs no boolean compaction.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from .histogram import LogBins
from .slicing import Cells

# float64 sums per token cell, in this column order
SUM_COLUMNS = ("sum_lr", "sum_lr2", "sum_abs_lr", "sum_k3", "sum_exp_abs_lr", "sum_rho",
               "sum_rho2", "sum_rho_capped", "sum_rho_capped2")


@dataclass(frozen=True)
class Regions:
    """lr thresholds of every band and cap; region i holds lr in (b[i-1], b[i]]."""

    boundaries: tuple[float, ...]

    @classmethod
    def from_config(cls, config: MetricConfig) -> "Regions":
        c = config.tis_cap
        points = {math.log(1.0 / c), math.log(c), *(math.log(v) for v in config.icepop_band),
                  *(math.log(v) for v in config.extreme_band)}
        return cls(tuple(sorted(points)))

    @property
    def num_regions(self) -> int:
        return len(self.boundaries) + 1

    def at_most(self, value: float) -> int:
        """Regions r <= this hold exactly the lr <= log(value)."""
        return self.boundaries.index(math.log(value))


@dataclass
class TokenAccumulators:
    """Dense accumulators for C token cells (+1 dump) and B sequences (+1 dump)."""

    sums: torch.Tensor          # [C + 1, len(SUM_COLUMNS)] float64
    regions: torch.Tensor       # [(C + 1) * R] int64
    abs_hist: torch.Tensor      # [(C + 1) * NB] int64
    lowprob_n: torch.Tensor     # [(C + 1) * NL] int64
    lowprob_abs: torch.Tensor   # [(C + 1) * NL] float64
    lowprob_k3: torch.Tensor    # [(C + 1) * NL] float64
    min_lr: torch.Tensor        # [C + 1] float64
    max_lr: torch.Tensor        # [C + 1] float64
    n_nonfinite: torch.Tensor   # [C + 1] int64
    n_positive: torch.Tensor    # [C + 1] int64
    n_support_known: torch.Tensor
    n_support_mismatch: torch.Tensor
    n_kept: torch.Tensor
    sum_kept: torch.Tensor
    seq_n: torch.Tensor         # [B + 1] int64 valid tokens per sequence
    seq_sum_lr: torch.Tensor    # [B + 1] float64
    seq_sum_exp_abs: torch.Tensor
    seq_max_abs: torch.Tensor

    @classmethod
    def zeros(cls, C: int, B: int, R: int, NB: int, NL: int, device: torch.device) -> "TokenAccumulators":
        f64, i64 = torch.float64, torch.int64
        z = lambda n, dt=i64: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        return cls(
            sums=torch.zeros(C + 1, len(SUM_COLUMNS), dtype=f64, device=device),
            regions=z((C + 1) * R), abs_hist=z((C + 1) * NB), lowprob_n=z((C + 1) * NL),
            lowprob_abs=z((C + 1) * NL, f64), lowprob_k3=z((C + 1) * NL, f64),
            min_lr=torch.full((C + 1,), math.inf, dtype=f64, device=device),
            max_lr=torch.full((C + 1,), -math.inf, dtype=f64, device=device),
            n_nonfinite=z(C + 1), n_positive=z(C + 1), n_support_known=z(C + 1),
            n_support_mismatch=z(C + 1), n_kept=z(C + 1), sum_kept=z(C + 1, f64),
            seq_n=z(B + 1), seq_sum_lr=z(B + 1, f64), seq_sum_exp_abs=z(B + 1, f64),
            seq_max_abs=torch.zeros(B + 1, dtype=f64, device=device),
        )

    def merge_(self, other: "TokenAccumulators") -> None:
        for name, value in vars(self).items():
            o = getattr(other, name)
            if name == "min_lr":
                torch.minimum(value, o, out=value)
            elif name in ("max_lr", "seq_max_abs"):
                torch.maximum(value, o, out=value)
            else:
                value += o


def _pass_chunk(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, config: MetricConfig,
                bins: LogBins, regions: Regions, lowprob_bounds: torch.Tensor,
                region_bounds: torch.Tensor, start: int, stop: int) -> None:
    C = cells.num_token_cells
    B = batch.num_sequences
    NB = bins.num_bins
    R = regions.num_regions
    NL = lowprob_bounds.numel() + 1
    f64 = torch.float64

    t = batch.trainer_logprobs[start:stop].to(f64)
    s = batch.sampler_logprobs[start:stop].to(f64)
    seq = batch.seq_index[start:stop]
    turn = None if batch.turn_index is None else batch.turn_index[start:stop]
    cell = cells.token_cells(seq, turn, config.turn_edges)
    lr = t - s

    tol = config.positive_logprob_tol
    finite = torch.isfinite(lr)  # inf - inf is NaN, so this covers either side
    positive = (t > tol) | (s > tol)
    valid = finite & ~positive
    token_cell = cell  # every token, valid or not
    if not bool(valid.all()):
        acc.n_nonfinite += torch.bincount(cell[~finite], minlength=C + 1)
        acc.n_positive += torch.bincount(cell[finite & positive], minlength=C + 1)
        cell = torch.where(valid, cell, C)          # dump cell
        seq = torch.where(valid, seq, B)            # dump sequence
        lr = torch.where(valid, lr, 0.0)
        s = torch.where(valid, s, 0.0)

    if batch.in_trainer_support is not None:
        sup = batch.in_trainer_support[start:stop]
        acc.n_support_known += torch.bincount(token_cell, minlength=C + 1)
        acc.n_support_mismatch += torch.bincount(token_cell[~sup], minlength=C + 1)
    if batch.sampler_kept_logmass is not None:
        kept = batch.sampler_kept_logmass[start:stop].to(f64)
        has = torch.isfinite(kept)
        kc = torch.where(has, cell, C)
        acc.n_kept += torch.bincount(kc, minlength=C + 1)
        acc.sum_kept += torch.bincount(kc, weights=torch.where(has, kept, 0.0), minlength=C + 1)

    em1 = torch.expm1(lr)                      # rho - 1, accurate for tiny lr
    rho = em1 + 1.0
    abs_lr = lr.abs()
    k3 = em1 - lr
    exp_abs = torch.where(lr >= 0, rho, torch.reciprocal(rho))
    cap = config.tis_cap
    rho_c = rho.clamp(max=cap)
    columns = (lr, lr * lr, abs_lr, k3, exp_abs, rho, rho * rho, rho_c, rho_c * rho_c)
    n_cells = C + 1
    for j, w in enumerate(columns):
        acc.sums[:, j] += torch.bincount(cell, weights=w, minlength=n_cells)

    region = torch.bucketize(lr, region_bounds, right=False)
    acc.regions += torch.bincount(cell * R + region, minlength=n_cells * R)
    hist_index = cell * NB + bins.index(abs_lr)
    acc.abs_hist.index_add_(0, hist_index, torch.ones_like(hist_index))

    lp = cell * NL + torch.bucketize(s, lowprob_bounds, right=True)
    acc.lowprob_n += torch.bincount(lp, minlength=n_cells * NL)
    acc.lowprob_abs += torch.bincount(lp, weights=abs_lr, minlength=n_cells * NL)
    acc.lowprob_k3 += torch.bincount(lp, weights=k3, minlength=n_cells * NL)

    acc.min_lr.scatter_reduce_(0, cell, lr, "amin")
    acc.max_lr.scatter_reduce_(0, cell, lr, "amax")

    acc.seq_n += torch.bincount(seq, minlength=B + 1)
    acc.seq_sum_lr += torch.bincount(seq, weights=lr, minlength=B + 1)
    acc.seq_sum_exp_abs += torch.bincount(seq, weights=exp_abs, minlength=B + 1)
    acc.seq_max_abs.scatter_reduce_(0, seq, abs_lr, "amax")


def token_pass(batch: TokenBatch, cells: Cells, config: MetricConfig, workers: int = 1) -> TokenAccumulators:
    """Accumulate every token statistic; ``workers`` > 1 splits chunks across Python threads."""
    bins = LogBins.from_config(config)
    regions = Regions.from_config(config)
    device = batch.device
    lowprob_bounds = torch.log(torch.tensor(config.lowprob_edges, dtype=torch.float64, device=device))
    region_bounds = torch.tensor(regions.boundaries, dtype=torch.float64, device=device)
    N = batch.num_tokens
    chunk = config.chunk_tokens
    starts = list(range(0, N, chunk))
    dims = (cells.num_token_cells, batch.num_sequences, regions.num_regions, bins.num_bins,
            len(config.lowprob_edges) + 1)

    def run(my_starts: list[int]) -> TokenAccumulators:
        acc = TokenAccumulators.zeros(*dims, device=device)
        for st in my_starts:
            _pass_chunk(acc, batch, cells, config, bins, regions, lowprob_bounds, region_bounds,
                        st, min(st + chunk, N))
        return acc

    if workers <= 1 or len(starts) < 2:
        return run(starts)
    shares = [starts[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, shares))
    total = results[0]
    for other in results[1:]:
        total.merge_(other)
    return total
