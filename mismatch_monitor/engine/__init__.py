"""The metric engine: a validated batch in, per-cell sufficient statistics out. Pure, no I/O.

    stats = compute_stats(batch, MetricConfig())
    stats["tokens"]      # one row per non-empty (labels, length_bucket, turn_bucket) cell

Computation runs on the batch's device; the returned tables live on the CPU.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from . import native
from .fields import TABLES
from .histogram import LogBins
from .routing import routing_counts
from .slicing import Cells, assign_cells, bucket_table, dimension_names
from .stats import MismatchStats, empty_table, merge
from .tables import JointBins, lowprob_table, np_, sequence_tables, sparse, sparse_columns, token_table
from .regions import Regions
from .accumulators import TokenAccumulators, packed_copy
from .token_pass import token_pass

__all__ = ["compute_stats", "compute_stats_with_sequences", "SequenceValues", "MismatchStats", "merge",
           "LogBins"]


@dataclass(frozen=True)
class SequenceValues:
    """Per-sequence values the token pass computes anyway ([B] tensors on the batch's device);
    the exemplars read them instead of making a pass of their own."""

    max_abs_lr: torch.Tensor    # max_t |lr| over valid tokens (0 without any)
    sum_lr: torch.Tensor        # sum_t lr over valid tokens
    n_valid: torch.Tensor       # valid tokens


def compute_stats(batch: TokenBatch, config: MetricConfig | None = None, *, workers: int = 1) -> MismatchStats:
    """Every per-cell statistic of one batch (see ``fields.py`` for the columns).

    ``workers`` > 1 splits the token chunks across that many Python threads; with few cores
    and large batches this beats torch's own intra-op threads (see benchmarks/README.md).
    """
    return compute_stats_with_sequences(batch, config, workers=workers)[0]


def compute_stats_with_sequences(batch: TokenBatch, config: MetricConfig | None = None, *, workers: int = 1
                                 ) -> tuple[MismatchStats, SequenceValues]:
    """:func:`compute_stats` and the per-sequence values of the batch."""
    config = config or MetricConfig()
    dims = dimension_names(dict(batch.labels))
    if batch.num_tokens == 0:
        zeros = torch.zeros(batch.num_sequences, device=batch.device)
        return (MismatchStats.empty(dims, config.stats_parameters()),
                SequenceValues(zeros.double(), zeros.double(), zeros.long()))
    device_cells = cells = assign_cells(batch, config)
    on_device = token_pass(batch, cells, config, workers=workers)
    # off the CPU the routing counts come to the host with the accumulators, in one copy; on
    # it they are counted below, beside the histogram rows' assembly
    on_cpu = batch.device.type == "cpu"
    routing_counted = [] if on_cpu else _routing_counts(batch, cells, config)
    # what the tables read, on the CPU
    acc, cells, batch, routing_counted = _on_host(on_device, cells, batch, routing_counted)
    C = cells.num_token_cells
    NL = len(config.lowprob_edges) + 1
    joint = JointBins(acc, C, NL, Regions.from_config(config))
    keys = cells.token_key_columns()
    NB = LogBins.from_config(config).num_bins
    hist = np_(acc.abs_hist[: C * NB])
    # the histogram's rows (the largest table: label columns taken row by row, outside the GIL)
    # are assembled beside the other tables when there is a second worker
    pool = ThreadPoolExecutor(max_workers=1) if workers > 1 else None
    try:
        hist_rows = (pool.submit if pool else _now)(
            sparse_columns, "abs_hist", dims, keys, NB, "bin", {"count": hist}, hist)
        routing, per_layer = _routing(_routing_counts(batch, cells, config) if on_cpu else routing_counted)
        flips = None if per_layer is None else per_layer.ravel()
        arrays = {"tokens": token_table(acc, joint, keys, config, dims, routing)}
        tables = {
            "tokens": pd.DataFrame(arrays["tokens"], copy=False),
            "lowprob": lowprob_table(joint, keys, dims),
            "routing_layers": empty_table("routing_layers", dims) if per_layer is None else
            sparse("routing_layers", dims, keys, per_layer.shape[1], "layer", {"n_flips": flips}, flips),
        }
        arrays["sequences"], seq_hist, staleness = sequence_tables(acc, batch, cells, config, dims)
        tables.update(sequences=pd.DataFrame(arrays["sequences"], copy=False), seq_hist=seq_hist,
                      staleness=staleness)
        arrays["abs_hist"] = hist_rows.result()
    finally:
        if pool:
            pool.shutdown()
    tables["abs_hist"] = pd.DataFrame(arrays["abs_hist"], copy=False)
    tables = {name: tables[name] for name in TABLES}
    B = batch.num_sequences
    values = SequenceValues(max_abs_lr=on_device.seq_max_abs[:B], sum_lr=on_device.seq_sum_lr[:B],
                            n_valid=device_cells.seq_length - on_device.seq_invalid[:B])
    return MismatchStats(tables, tuple(dims), config.stats_parameters()), values


def _on_host(acc: TokenAccumulators, cells: Cells, batch: TokenBatch, routing: list[torch.Tensor]
             ) -> tuple[TokenAccumulators, Cells, TokenBatch, list[torch.Tensor]]:
    """What the tables read, on the CPU, in one device-to-host copy (a GPU's step waits only
    here): the accumulators, the routing counts, the cells' per-sequence arrays and the batch's
    per-sequence inputs (its per-token tensors stay where they are)."""
    if batch.device.type == "cpu":
        return acc, cells, batch, routing
    names = [f.name for f in dataclasses.fields(acc)]
    extra = {k: getattr(batch, k) for k in ("advantages", "policy_version") if getattr(batch, k) is not None}
    copied = packed_copy([getattr(acc, n) for n in names] + routing + [cells.seq_cell, cells.seq_length]
                         + list(extra.values()))
    host_acc = TokenAccumulators(**dict(zip(names, copied)))
    at = len(names) + len(routing)
    host_cells = dataclasses.replace(cells, seq_cell=copied[at], seq_length=copied[at + 1])
    host_batch = dataclasses.replace(batch, **dict(zip(extra, copied[at + 2:])))
    return host_acc, host_cells, host_batch, copied[len(names):at]


def _now(fn, *args) -> Future:
    """``fn(*args)`` run here, as a done future."""
    done: Future = Future()
    done.set_result(fn(*args))
    return done


def _routing_counts(batch: TokenBatch, cells: Cells, config: MetricConfig) -> list[torch.Tensor]:
    """[routed [C], tokens with a flip [C], flips [C, L]] on the batch's device ([] without ids)."""
    if batch.trainer_experts is None:
        return []
    turn_table = None if batch.turn_index is None else bucket_table(config.turn_edges, batch.device)
    cell = cells.token_cells(batch.seq_index, batch.turn_index, turn_table)
    routed, any_flip, per_layer, _ = routing_counts(
        batch.trainer_experts, batch.sampler_experts, cell, cells.num_token_cells, config.chunk_tokens,
        compiled=native.use_native(config, batch.device))
    return [routed, any_flip, per_layer]


def _routing(counts: list[torch.Tensor]) -> tuple[dict[str, np.ndarray] | None, np.ndarray | None]:
    """Routing columns of the token table per token cell, and flips per (cell, layer), from the
    counts on the host."""
    if not counts:
        return None, None
    routed, any_flip, per_layer = (np_(t) for t in counts)
    columns = {"n_routed_tokens": routed, "n_routing_decisions": routed * per_layer.shape[1],
               "n_routing_flips": per_layer.sum(1), "n_tokens_any_flip": any_flip}
    return columns, per_layer

