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
statistic. Weights are float64 (``bincount`` with float32 weights accumulates in float32).

On CPU tensors the compiled loop of ``native.py`` does the same pass in one read of the inputs
(``MetricConfig.kernel``), without chunks, the sequences of one cell one after the other, and
with ``workers`` the cells split between threads (``_native_pass``); the torch ops of
``torch_pass.py``, chunk by chunk, are the implementation for every other device (there
without a wait for the device inside the loop).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from . import native, torch_pass
from .accumulators import JOINT_SUMS, TokenAccumulators, token_validity  # noqa: F401 (the pass's types)
from .histogram import LogBins
from .ranges import sequence_ranges, split_by_cell
from .regions import JointCoder
from .slicing import Cells, bucket_table


@dataclass(frozen=True)
class Plan:
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
    sync_free: bool                         # the torch ops never wait for the device (torch_pass.py)

    @property
    def J(self) -> int:
        return (self.C + 1) * self.NL * self.R


def _plan(batch: TokenBatch, cells: Cells, config: MetricConfig) -> Plan:
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
    return Plan(
        C=cells.num_token_cells, B=batch.num_sequences, NL=len(config.lowprob_edges) + 1, R=coder.R,
        bins=bins, coder=coder, turn_table=turn_table, tol=config.positive_logprob_tol, kernel=kernel,
        sync_free=torch_pass.sync_free(batch.device),
    )


def _native_pass(batch: TokenBatch, cells: Cells, p: Plan, chunk: int, workers: int) -> TokenAccumulators:
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

    # with offsets every range names its sequence: the per-token ids are neither read nor built
    seq = None if offsets is not None else batch.seq_index

    def run(job: tuple[TokenAccumulators, np.ndarray]) -> None:
        acc, part = job
        p.kernel.run(part, batch.trainer_logprobs, batch.sampler_logprobs, seq, batch.turn_index,
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
            torch_pass.add_support(total, batch, p, start, stop, cell, valid_cell)
    return total


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
            torch_pass.pass_chunk(acc, batch, cells, plan, st, min(st + chunk, N), ones)
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
