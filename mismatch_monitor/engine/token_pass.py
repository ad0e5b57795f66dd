"""One chunked pass over the tokens: per-cell and per-sequence sufficient statistics.

Most statistics are read off one *joint* index per token, ``J = (cell, lowprob bucket, region)``,
where the regions split lr at every band, cap and at 0. Per joint bin the pass keeps a count and
five float64 sums (lr, lr^2, rho - 1 - lr, exp|lr|, rho^2); everything else is exact algebra on
those at the end: token counts and lowprob buckets are marginals, |lr| is +-lr inside a region
of one sign, sum rho = n + sum(rho - 1 - lr) + sum lr, and capped sums take rho below the cap's
region and the cap above it. The joint index also breaks up runs of one cell (sorted sequences),
which slow ``bincount`` several-fold.

Invalid tokens (non-finite, or a log-prob above the tolerance) are routed to one extra "dump"
cell and one extra "dump" sequence that are dropped at the end, so a single NaN never touches a
statistic; a chunk without invalid tokens (checked with three reductions) skips the masks.
Weights are float64 (``bincount`` with float32 weights accumulates in float32).

On CPU tensors the compiled loop of ``native.py`` does the same pass in one read of the inputs
(``MetricConfig.kernel``), without chunks, the sequences of one cell one after the other, and
with ``workers`` the cells split between threads (``_native_pass``); the torch ops below are
the implementation for every other device.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from . import native
from .histogram import LogBins
from .ranges import sequence_ranges, split_by_cell
from .regions import JointCoder
from .slicing import Cells, bucket_table

# float64 sums per joint bin, in this order
JOINT_SUMS = ("lr", "lr2", "k3", "exp_abs", "rho2")


@dataclass
class TokenAccumulators:
    """Dense accumulators for C token cells (+1 dump) and B sequences (+1 dump)."""

    joint_n: torch.Tensor       # [(C + 1) * NL * R] int64, J = (cell * NL + lowprob) * R + slot
    joint_sums: torch.Tensor    # [len(JOINT_SUMS), (C + 1) * NL * R] float64
    abs_hist: torch.Tensor      # [(C + 1) * NB] int64 (int32 from the compiled pass, fewer than 2^31 tokens)
    min_lr: torch.Tensor        # [C + 1] float64
    max_lr: torch.Tensor        # [C + 1] float64
    n_nonfinite: torch.Tensor   # [C + 1] int64
    n_positive: torch.Tensor    # [C + 1] int64
    n_support_known: torch.Tensor
    n_support_mismatch: torch.Tensor
    n_kept: torch.Tensor
    sum_kept: torch.Tensor
    seq_invalid: torch.Tensor   # [B + 1] int64 invalid tokens per sequence
    seq_sum_lr: torch.Tensor    # [B + 1] float64
    seq_sum_exp_abs: torch.Tensor
    seq_max_abs: torch.Tensor

    @classmethod
    def zeros(cls, C: int, B: int, J: int, NB: int, device: torch.device,
              hist_dtype: torch.dtype = torch.int64) -> "TokenAccumulators":
        f64, i64 = torch.float64, torch.int64
        z = lambda n, dt=i64: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        return cls(
            joint_n=z(J), joint_sums=torch.zeros(len(JOINT_SUMS), J, dtype=f64, device=device),
            abs_hist=z((C + 1) * NB, hist_dtype),
            min_lr=torch.full((C + 1,), math.inf, dtype=f64, device=device),
            max_lr=torch.full((C + 1,), -math.inf, dtype=f64, device=device),
            n_nonfinite=z(C + 1), n_positive=z(C + 1), n_support_known=z(C + 1),
            n_support_mismatch=z(C + 1), n_kept=z(C + 1), sum_kept=z(C + 1, f64),
            seq_invalid=z(B + 1), seq_sum_lr=z(B + 1, f64), seq_sum_exp_abs=z(B + 1, f64),
            seq_max_abs=z(B + 1, f64),
        )

    def sum_rows(self) -> dict[str, torch.Tensor]:
        """The rows of ``joint_sums`` by name (``JOINT_SUMS``)."""
        return dict(zip(JOINT_SUMS, self.joint_sums))

    def merge_(self, other: "TokenAccumulators") -> None:
        for name, value in vars(self).items():
            o = getattr(other, name)
            if name == "min_lr":
                torch.minimum(value, o, out=value)
            elif name in ("max_lr", "seq_max_abs"):
                torch.maximum(value, o, out=value)
            else:
                value += o


@dataclass(frozen=True)
class _Plan:
    """Everything a chunk needs that does not depend on the chunk."""

    C: int
    B: int
    NL: int
    R: int
    bins: LogBins
    coder: JointCoder
    turn_table: torch.Tensor | None
    tol: float
    kernel: native.TokenKernel | None       # the compiled pass, when it runs

    @property
    def J(self) -> int:
        return (self.C + 1) * self.NL * self.R


def _plan(batch: TokenBatch, cells: Cells, config: MetricConfig) -> _Plan:
    coder = JointCoder.build(config, batch.device)
    bins = LogBins.from_config(config)
    turn_table = None if batch.turn_index is None else bucket_table(config.turn_edges, batch.device)
    kernel = None
    # the compiled pass counts histogram bins in 32 bits: batches of 2^31 tokens and more
    # (51 GB of inputs) take the torch ops
    if native.use_native(config, batch.device, batch.num_tokens):
        kernel = native.TokenKernel.build(config, coder, bins, cells.num_turn_buckets,
                                          0 if turn_table is None else turn_table.numel() - 1,
                                          batch.num_sequences, cells.num_seq_cells)
    return _Plan(
        C=cells.num_token_cells, B=batch.num_sequences, NL=len(config.lowprob_edges) + 1, R=coder.R,
        bins=bins, coder=coder, turn_table=turn_table, tol=config.positive_logprob_tol, kernel=kernel,
    )


def token_validity(t: torch.Tensor, s: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The bad-input policy per token: (finite on both sides, a finite log-prob above ``tol``).
    A token is valid when finite and not positive; every other one is set aside and counted."""
    finite = torch.isfinite(t) & torch.isfinite(s)
    return finite, finite & ((t > tol) | (s > tol))


def _pass_chunk(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, p: _Plan, start: int, stop: int,
                ones: torch.Tensor) -> None:
    f64 = torch.float64
    t_in = batch.trainer_logprobs[start:stop]
    s_in = batch.sampler_logprobs[start:stop]
    seq = batch.seq_index[start:stop]
    turn = None if batch.turn_index is None else batch.turn_index[start:stop]
    cell = cells.token_cells(seq, turn, p.turn_table)               # [n] int64
    ones = ones[: stop - start]
    s = s_in.to(f64)
    lr = t_in.to(f64) - s

    # valid = finite on both sides and no log-prob above the tolerance; three reductions decide
    # whether any token of the chunk needs setting aside (NaN fails every comparison)
    clean = bool(torch.isfinite(lr.sum())) and bool(t_in.max() <= p.tol) and bool(s_in.max() <= p.tol)
    token_cell = cell                                                # every token, valid or not
    if not clean:
        t = t_in.to(f64)
        finite, positive = token_validity(t, s, p.tol)
        valid = finite & ~positive
        acc.n_nonfinite += torch.bincount(cell[~finite], minlength=p.C + 1)
        acc.n_positive += torch.bincount(cell[positive], minlength=p.C + 1)
        acc.seq_invalid += torch.bincount(seq[~valid], minlength=p.B + 1)
        cell = torch.where(valid, cell, p.C)        # dump cell
        seq = torch.where(valid, seq, p.B)          # dump sequence
        lr = torch.where(valid, lr, 0.0)
        s = torch.where(valid, s, 0.0)

    _add_support(acc, batch, p, start, stop, token_cell, cell)

    abs_lr = lr.abs()
    joint = cell * (p.NL * p.R)
    joint += p.coder.code(lr, abs_lr, s)
    acc.joint_n.scatter_add_(0, joint, ones)

    em1 = torch.expm1(lr)                     # rho - 1, accurate for tiny lr
    exp_abs = torch.exp(abs_lr)
    weights = (lr, lr * lr, em1 - lr, exp_abs, em1.add_(1.0).square_())
    for j, w in enumerate(weights):
        acc.joint_sums[j].scatter_add_(0, joint, w)

    acc.min_lr.scatter_reduce_(0, cell, lr, "amin")
    acc.max_lr.scatter_reduce_(0, cell, lr, "amax")
    hist = p.bins.index(abs_lr).add_(cell * p.bins.num_bins)
    acc.abs_hist.scatter_add_(0, hist, ones)

    _add_per_sequence(acc, seq, lr, exp_abs)
    acc.seq_max_abs.scatter_reduce_(0, seq, abs_lr, "amax")


def _native_pass(batch: TokenBatch, cells: Cells, p: _Plan, chunk: int, workers: int) -> TokenAccumulators:
    """The compiled pass. It needs no chunks (its memory does not grow with the tokens); up to
    ``workers`` threads, one per ``chunk`` tokens at least, take sequence cells of about equal
    tokens each into one set of accumulators: no cell and no sequence is two workers', so
    there is nothing to merge. When the cells do not split evenly (few cells, or sequences not
    contiguous), each thread takes an equal share of the tokens into accumulators of its own,
    merged at the end. The optional support inputs go through torch ops, chunk by chunk."""
    N = batch.num_tokens
    offsets = None if batch.seq_offsets is None else batch.seq_offsets.numpy()
    seq_cell = cells.seq_cell.numpy()
    n = max(1, min(workers, -(-N // chunk)))

    def fresh() -> TokenAccumulators:
        # histogram counts are 32-bit here (half the cache lines; no count can reach 2^31 in
        # a batch of fewer tokens, see _plan); the non-zero ones are widened in the tables
        return TokenAccumulators.zeros(p.C, p.B, p.J, p.bins.num_bins, batch.device, torch.int32)

    ranges = sequence_ranges(0, N, offsets, seq_cell)
    parts = split_by_cell(ranges, seq_cell, n)
    if parts is not None:                       # one set of accumulators, cells apart
        accs = [fresh()]
        jobs = [(accs[0], part) for part in parts]
    else:                                       # token shares, each into its own, merged
        bounds = [N * i // n for i in range(n + 1)]
        accs = [fresh() for _ in range(n)]
        jobs = [(acc, sequence_ranges(bounds[i], bounds[i + 1], offsets, seq_cell))
                for i, acc in enumerate(accs)]

    def run(job: tuple[TokenAccumulators, np.ndarray]) -> None:
        acc, part = job
        p.kernel.run(part, batch.trainer_logprobs, batch.sampler_logprobs, batch.seq_index, batch.turn_index,
                     cells.seq_cell, p.turn_table, acc)

    if len(jobs) == 1:
        run(jobs[0])
    else:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            list(pool.map(run, jobs))
    total = accs[0]
    for other in accs[1:]:
        total.merge_(other)
    if batch.in_trainer_support is not None or batch.sampler_kept_logmass is not None:
        for start in range(0, N, chunk):
            stop = min(start + chunk, N)
            seq = batch.seq_index[start:stop]
            turn = None if batch.turn_index is None else batch.turn_index[start:stop]
            cell = cells.token_cells(seq, turn, p.turn_table)
            valid_cell = cell
            if batch.sampler_kept_logmass is not None:
                t, s = batch.trainer_logprobs[start:stop], batch.sampler_logprobs[start:stop]
                finite, positive = token_validity(t.to(torch.float64), s.to(torch.float64), p.tol)
                valid_cell = torch.where(finite & ~positive, cell, p.C)
            _add_support(total, batch, p, start, stop, cell, valid_cell)
    return total


def _add_support(acc: TokenAccumulators, batch: TokenBatch, p: _Plan, start: int, stop: int,
                 token_cell: torch.Tensor, valid_cell: torch.Tensor) -> None:
    """The optional support inputs of one chunk. ``token_cell``: the cell of every token;
    ``valid_cell``: the same with invalid tokens in the dump cell (the kept log-mass counts
    valid tokens only)."""
    if batch.in_trainer_support is not None:
        sup = batch.in_trainer_support[start:stop]
        acc.n_support_known += torch.bincount(token_cell, minlength=p.C + 1)
        acc.n_support_mismatch += torch.bincount(token_cell[~sup], minlength=p.C + 1)
    if batch.sampler_kept_logmass is not None:
        kept = batch.sampler_kept_logmass[start:stop].to(torch.float64)
        has = torch.isfinite(kept)
        kc = torch.where(has, valid_cell, p.C)
        acc.n_kept += torch.bincount(kc, minlength=p.C + 1)
        acc.sum_kept += torch.bincount(kc, weights=torch.where(has, kept, 0.0), minlength=p.C + 1)


def _add_per_sequence(acc: TokenAccumulators, seq: torch.Tensor, lr: torch.Tensor, exp_abs: torch.Tensor) -> None:
    """Per-sequence sums. Tokens usually come in runs of one sequence, where ``scatter_add_``
    is slow (every add hits the same address); then sum each run first, in order."""
    ids, lengths = torch.unique_consecutive(seq, return_counts=True)
    if ids.numel() * 4 > seq.numel():           # short runs (shuffled tokens): scatter directly
        acc.seq_sum_lr.scatter_add_(0, seq, lr)
        acc.seq_sum_exp_abs.scatter_add_(0, seq, exp_abs)
        return
    acc.seq_sum_lr.index_add_(0, ids, torch.segment_reduce(lr, "sum", lengths=lengths))
    acc.seq_sum_exp_abs.index_add_(0, ids, torch.segment_reduce(exp_abs, "sum", lengths=lengths))


def token_pass(batch: TokenBatch, cells: Cells, config: MetricConfig, workers: int = 1) -> TokenAccumulators:
    """Accumulate every token statistic; ``workers`` > 1 splits chunks across Python threads
    (each runs torch ops on its own; with few cores, pair it with ``torch.set_num_threads(1)``)."""
    plan = _plan(batch, cells, config)
    N = batch.num_tokens
    chunk = config.chunk_tokens
    if plan.kernel is not None:
        return _native_pass(batch, cells, plan, chunk, workers)
    starts = list(range(0, N, chunk))

    def run(my_starts: list[int]) -> TokenAccumulators:
        acc = TokenAccumulators.zeros(plan.C, plan.B, plan.J, plan.bins.num_bins, batch.device)
        ones = torch.ones(min(chunk, N), dtype=torch.int64, device=batch.device)
        for st in my_starts:
            _pass_chunk(acc, batch, cells, plan, st, min(st + chunk, N), ones)
        return acc

    if workers <= 1 or len(starts) < 2:
        return run(starts)
    # contiguous shares keep each worker's sequences (and their accumulator lines) apart
    per = math.ceil(len(starts) / workers)
    shares = [starts[i:i + per] for i in range(0, len(starts), per)]
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        results = list(pool.map(run, shares))
    total = results[0]
    for other in results[1:]:
        total.merge_(other)
    return total
