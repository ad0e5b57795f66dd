"""The token pass as torch ops, one chunk at a time: the implementation for every device (GPUs,
and CPUs without the compiled loops).

On a GPU nothing here waits for the device: no ``bool()``, ``.item()``, boolean-mask select,
``nonzero``, ``unique`` or ``bincount`` (whose output size depends on the data, so each would
copy to the host and wait); counts go through ``scatter_add_`` into arrays of a size known in
advance, and invalid tokens through ``torch.where`` whether a chunk has any or not. A step then
waits once, for the copy of the finished accumulators (``TokenAccumulators.to_host``).
On the CPU, where a wait costs nothing, three reductions decide whether a chunk needs the
masks at all and runs of one sequence are summed first (``sync_free=False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..batch import TokenBatch
from .accumulators import TokenAccumulators, token_validity
from .slicing import Cells

if TYPE_CHECKING:
    from .token_pass import Plan


def sync_free(device: torch.device) -> bool:
    """Whether the torch ops run without any wait for the device (everywhere but the CPU)."""
    return device.type != "cpu"


def _count(into: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, free: bool) -> None:
    """``into[index] += weight`` (1 when None), without a wait when ``free``."""
    if free:
        into.scatter_add_(0, index, torch.ones_like(index, dtype=into.dtype) if weight is None else
                          weight.to(into.dtype))
    elif weight is None:
        into += torch.bincount(index, minlength=into.numel())
    elif weight.dtype == torch.bool:
        into += torch.bincount(index[weight], minlength=into.numel())
    else:
        into += torch.bincount(index, weights=weight, minlength=into.numel())


def pass_chunk(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, p: "Plan", start: int, stop: int,
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

    # valid = finite on both sides and no log-prob above the tolerance; on the CPU three
    # reductions decide whether any token of the chunk needs setting aside (NaN fails every
    # comparison); on other devices every chunk takes the masks
    clean = not p.sync_free and (bool(torch.isfinite(lr.sum())) and bool(t_in.max() <= p.tol)
                                 and bool(s_in.max() <= p.tol))
    token_cell = cell                                                # every token, valid or not
    if not clean:
        t = t_in.to(f64)
        finite, positive = token_validity(t, s, p.tol)
        valid = finite & ~positive
        _count(acc.n_nonfinite, cell, ~finite, p.sync_free)
        _count(acc.n_positive, cell, positive, p.sync_free)
        _count(acc.seq_invalid, seq, ~valid, p.sync_free)
        cell = torch.where(valid, cell, p.C)        # dump cell
        seq = torch.where(valid, seq, p.B)          # dump sequence
        lr = torch.where(valid, lr, 0.0)
        s = torch.where(valid, s, 0.0)

    add_support(acc, batch, p, start, stop, token_cell, cell)
    _count(acc.n_lr_zero, cell, lr == 0.0, p.sync_free)      # invalid tokens: lr 0 in the dump cell

    abs_lr = lr.abs()
    joint = cell * (p.NL * p.R)
    joint += p.coder.code(lr, abs_lr, s, sync_free=p.sync_free)
    acc.joint_n.scatter_add_(0, joint, ones)

    em1 = torch.expm1(lr)                     # rho - 1, accurate for tiny lr
    exp_abs = torch.exp(abs_lr)
    _add_probability_sums(acc, cell, joint, p.NL * p.R, s, em1, p.sync_free)
    weights = (lr, lr * lr, em1 - lr, exp_abs, em1.add_(1.0).square_())
    for j, w in enumerate(weights):
        acc.joint_sums[j].scatter_add_(0, joint, w)

    acc.min_lr.scatter_reduce_(0, cell, lr, "amin")
    acc.max_lr.scatter_reduce_(0, cell, lr, "amax")
    hist = p.bins.index(abs_lr).add_(cell * p.bins.num_bins)
    acc.abs_hist.scatter_add_(0, hist, ones)

    _add_per_sequence(acc, seq, lr, exp_abs, p.sync_free)
    acc.seq_max_abs.scatter_reduce_(0, seq, abs_lr, "amax")


def _add_probability_sums(acc: TokenAccumulators, cell: torch.Tensor, joint: torch.Tensor, width: int,
                          s: torch.Tensor, em1: torch.Tensor, free: bool) -> None:
    """The probability-space sums (accumulators.PSUM_ROWS) per cell: p_S = exp(s) and
    p_T - p_S = p_S (rho - 1), which keeps the digits a difference of two exps would cancel.
    On the CPU they are counted by joint bin (``width`` per cell) and folded per cell: runs of
    one cell (sorted sequences) make ``bincount`` several-fold slower."""
    ps = torch.exp(s)
    dp = ps * em1
    abs_dp = dp.abs()
    for row, w in zip(acc.p_sums, (ps, dp, ps * ps, ps * dp, dp * dp, abs_dp)):
        if free:
            row.scatter_add_(0, cell, w)
        else:
            row += torch.bincount(joint, weights=w, minlength=row.numel() * width).view(-1, width).sum(1)
    acc.max_abs_dp.scatter_reduce_(0, cell, abs_dp, "amax")


def add_support(acc: TokenAccumulators, batch: TokenBatch, p: "Plan", start: int, stop: int,
                token_cell: torch.Tensor, valid_cell: torch.Tensor) -> None:
    """The optional support inputs of one chunk. ``token_cell``: the cell of every token;
    ``valid_cell``: the same with invalid tokens in the dump cell (the kept log-mass counts
    valid tokens only)."""
    if batch.in_trainer_support is not None:
        sup = batch.in_trainer_support[start:stop]
        _count(acc.n_support_known, token_cell, None, p.sync_free)
        _count(acc.n_support_mismatch, token_cell, ~sup, p.sync_free)
    if batch.sampler_kept_logmass is not None:
        kept = batch.sampler_kept_logmass[start:stop].to(torch.float64)
        has = torch.isfinite(kept)
        kc = torch.where(has, valid_cell, p.C)
        _count(acc.n_kept, kc, None, p.sync_free)
        _count(acc.sum_kept, kc, torch.where(has, kept, 0.0), p.sync_free)


def _add_per_sequence(acc: TokenAccumulators, seq: torch.Tensor, lr: torch.Tensor, exp_abs: torch.Tensor,
                      free: bool) -> None:
    """Per-sequence sums. On the CPU tokens usually come in runs of one sequence, where
    ``scatter_add_`` is slow (every add hits the same address); there each run is summed first,
    in order (finding the runs waits for their count, which a GPU should not)."""
    if not free:
        ids, lengths = torch.unique_consecutive(seq, return_counts=True)
        if ids.numel() * 4 <= seq.numel():
            acc.seq_sum_lr.index_add_(0, ids, torch.segment_reduce(lr, "sum", lengths=lengths))
            acc.seq_sum_exp_abs.index_add_(0, ids, torch.segment_reduce(exp_abs, "sum", lengths=lengths))
            return
    acc.seq_sum_lr.scatter_add_(0, seq, lr)
    acc.seq_sum_exp_abs.scatter_add_(0, seq, exp_abs)
