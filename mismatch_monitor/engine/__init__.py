"""The metric engine: a validated batch in, per-cell sufficient statistics out. Pure, no I/O.

    stats = compute_stats(batch, MetricConfig())
    stats["tokens"]      # one row per non-empty (labels, length_bucket, turn_bucket) cell

Computation runs on the batch's device; the returned tables live on the CPU.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from .fields import SEQ_HIST_KINDS, TABLES, TOKEN_FIELDS
from .histogram import LogBins
from .routing import routing_counts
from .slicing import Cells, assign_cells, dimension_names
from .stats import MismatchStats, empty_table, key_columns, merge
from .token_pass import SUM_COLUMNS, Regions, TokenAccumulators, token_pass

__all__ = ["compute_stats", "MismatchStats", "merge", "LogBins"]


def compute_stats(batch: TokenBatch, config: MetricConfig | None = None, *, workers: int = 1) -> MismatchStats:
    """Every per-cell statistic of one batch (see ``fields.py`` for the columns)."""
    config = config or MetricConfig()
    dims = dimension_names(dict(batch.labels))
    if batch.num_tokens == 0:
        return MismatchStats.empty(dims)
    cells = assign_cells(batch, config)
    acc = token_pass(batch, cells, config, workers=workers)
    tables = {
        "tokens": _token_table(acc, batch, cells, config),
        "abs_hist": _sparse(acc.abs_hist, cells.num_token_cells, LogBins.from_config(config).num_bins,
                            cells.token_keys(), "bin", {"count": acc.abs_hist}, dims, "abs_hist"),
        "lowprob": _sparse(acc.lowprob_n, cells.num_token_cells, len(config.lowprob_edges) + 1,
                           cells.token_keys(), "bucket",
                           {"n_tokens": acc.lowprob_n, "sum_abs_lr": acc.lowprob_abs,
                            "sum_k3": acc.lowprob_k3}, dims, "lowprob"),
    }
    tables["routing_layers"] = _routing_layer_table(batch, cells, config, tables, dims)
    seq, seq_hist, staleness = _sequence_tables(acc, batch, cells, config, dims)
    tables.update(sequences=seq, seq_hist=seq_hist, staleness=staleness)
    return MismatchStats(tables, tuple(dims))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _token_table(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, config: MetricConfig) -> pd.DataFrame:
    C = cells.num_token_cells
    regions = Regions.from_config(config)
    R = regions.num_regions
    reg = _np(acc.regions[: C * R].view(C, R))
    r = np.arange(R)

    def count(mask: np.ndarray) -> np.ndarray:
        return reg[:, mask].sum(1)

    lo_i, hi_i = config.icepop_band
    ex_lo, ex_hi = config.extreme_band
    n_tokens = reg.sum(1)
    empty = n_tokens == 0
    min_lr = np.where(empty, np.nan, _np(acc.min_lr[:C]))
    max_lr = np.where(empty, np.nan, _np(acc.max_lr[:C]))
    data: dict[str, np.ndarray] = {
        "n_tokens": n_tokens,
        "n_nonfinite": _np(acc.n_nonfinite[:C]),
        "n_positive_logprob": _np(acc.n_positive[:C]),
        **{name: _np(acc.sums[:C, j]) for j, name in enumerate(SUM_COLUMNS)},
        "n_clip_high": count(r > regions.at_most(config.tis_cap)),
        "n_clip_low": count(r <= regions.at_most(1.0 / config.tis_cap)),
        "n_outside_icepop": count((r <= regions.at_most(lo_i)) | (r > regions.at_most(hi_i))),
        "n_extreme": count((r <= regions.at_most(ex_lo)) | (r > regions.at_most(ex_hi))),
        "min_lr": min_lr,
        "max_lr": max_lr,
        "max_abs_lr": np.maximum(-min_lr, max_lr),
        "n_support_known": _np(acc.n_support_known[:C]),
        "n_support_mismatch": _np(acc.n_support_mismatch[:C]),
        "n_kept_logmass": _np(acc.n_kept[:C]),
        "sum_kept_logmass": _np(acc.sum_kept[:C]),
    }
    for name in ("n_routed_tokens", "n_routing_decisions", "n_routing_flips", "n_tokens_any_flip"):
        data[name] = np.zeros(C, dtype=np.int64)
    if batch.trainer_experts is not None:
        cell = cells.token_cells(batch.seq_index, batch.turn_index, config.turn_edges)
        routed, any_flip, per_layer, L = routing_counts(
            batch.trainer_experts, batch.sampler_experts, cell, C, config.chunk_tokens)
        data["n_routed_tokens"] = _np(routed)
        data["n_routing_decisions"] = _np(routed) * L
        data["n_routing_flips"] = _np(per_layer.sum(1))
        data["n_tokens_any_flip"] = _np(any_flip)
        cells_per_layer = per_layer
    else:
        cells_per_layer = None
    keys = cells.token_keys()
    df = pd.concat([keys, pd.DataFrame(data)], axis=1)
    df = df.astype({f.name: f.dtype for f in TOKEN_FIELDS})
    df = df[keys.columns.tolist() + [f.name for f in TOKEN_FIELDS]]  # the order of fields.py
    df.attrs["routing_per_layer"] = cells_per_layer
    keep = (n_tokens + data["n_nonfinite"] + data["n_positive_logprob"] + data["n_routed_tokens"]
            + data["n_support_known"]) > 0
    return df[keep].reset_index(drop=True)


def _sparse(nonzero_of: torch.Tensor, C: int, width: int, keys: pd.DataFrame, key: str,
            values: dict[str, torch.Tensor], dims: list[str], table: str) -> pd.DataFrame:
    """Rows (cell, index) where ``nonzero_of`` is non-zero, from flat [(C+1) * width] tensors."""
    flat = nonzero_of[: C * width]
    idx = _np(flat.nonzero().squeeze(1))
    out = keys.iloc[idx // width].reset_index(drop=True)
    out[key] = (idx % width).astype(np.int64)
    for name, t in values.items():
        out[name] = _np(t[: C * width])[idx]
    out = out.astype({f.name: f.dtype for f in TABLES[table][1]})
    return out[[c for c in empty_table(table, dims).columns if c in out.columns]]


def _routing_layer_table(batch, cells, config, tables, dims) -> pd.DataFrame:
    per_layer = tables["tokens"].attrs.pop("routing_per_layer", None)
    if per_layer is None:
        return empty_table("routing_layers", dims)
    C, L = per_layer.shape
    return _sparse(per_layer.reshape(-1), C, L, cells.token_keys(), "layer",
                   {"n_flips": per_layer.reshape(-1)}, dims, "routing_layers")


def _sequence_tables(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, config: MetricConfig,
                     dims: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    B, S = batch.num_sequences, cells.num_seq_cells
    device = batch.device
    f64 = torch.float64
    n = acc.seq_n[:B]
    ok = n > 0                                       # sequences with a valid token
    cell = torch.where(ok, cells.seq_cell, S)        # dump cell S for the others
    nf = n.clamp(min=1).to(f64)
    seq_lr = acc.seq_sum_lr[:B]
    mean_lr = seq_lr / nf
    mult_err = acc.seq_sum_exp_abs[:B] / nf
    max_abs = acc.seq_max_abs[:B]

    def cnt(mask: torch.Tensor) -> np.ndarray:
        return _np(torch.bincount(cell[mask], minlength=S + 1)[:S])

    def ssum(w: torch.Tensor) -> np.ndarray:
        return _np(torch.bincount(cell, weights=w.to(f64), minlength=S + 1)[:S])

    def outside(x: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
        lo, hi = np.log(band[0]), np.log(band[1])
        return (x <= lo) | (x > hi)

    def extreme(x: torch.Tensor, how: str) -> np.ndarray:
        init = np.inf if how == "amin" else -np.inf
        out = torch.full((S + 1,), init, dtype=f64, device=device)
        out.scatter_reduce_(0, cell, x.to(f64), how)
        v = _np(out[:S])
        return np.where(np.isfinite(v), v, np.nan)

    data: dict[str, np.ndarray] = {
        "n_sequences": cnt(ok),
        "sum_seq_len": ssum(n.to(f64)).round().astype(np.int64),
        "sum_seq_lr": ssum(seq_lr),
        "sum_seq_mean_lr": ssum(mean_lr),
        "sum_seq_max_abs_lr": ssum(max_abs),
        "min_seq_lr": extreme(seq_lr, "amin"),
        "max_seq_lr": extreme(seq_lr, "amax"),
        "max_seq_max_abs_lr": extreme(max_abs, "amax"),
        "n_drop_product": cnt(outside(seq_lr, config.seq_product_band)),
        "n_drop_geometric": cnt(outside(mean_lr, config.seq_geometric_band)),
        "n_drop_mult_error": cnt(mult_err > config.seq_mult_error_threshold),
    }
    zeros = np.zeros(S, dtype=np.int64)
    if batch.advantages is not None:
        adv = batch.advantages.to(f64)
        data["n_adv_known"] = cnt(torch.ones_like(ok))
        data["n_drop_neg_adv"] = cnt((adv < 0) & (-mean_lr > config.neg_adv_delta))
    else:
        data["n_adv_known"] = data["n_drop_neg_adv"] = zeros
    stale_rows = empty_table("staleness", dims)
    if batch.policy_version is not None:
        staleness = batch.trainer_version - batch.policy_version          # [B]
        data["n_stale_known"] = cnt(torch.ones_like(ok))
        data["sum_staleness"] = _np(torch.bincount(cell, weights=staleness.to(f64), minlength=S + 1)[:S]).round().astype(np.int64)
        data["max_staleness"] = extreme(staleness, "amax")
        W = config.staleness_max + 1
        st_idx = cell * W + staleness.clamp(0, config.staleness_max)
        st_counts = torch.bincount(st_idx, minlength=(S + 1) * W)
        stale_rows = _sparse(st_counts, S, W, cells.seq_keys, "staleness", {"count": st_counts},
                             dims, "staleness")
    else:
        data["n_stale_known"] = data["sum_staleness"] = zeros
        data["max_staleness"] = np.full(S, np.nan)
    seq_df = pd.concat([cells.seq_keys, pd.DataFrame(data)], axis=1)
    seq_df = seq_df.astype({f.name: f.dtype for f in TABLES["sequences"][1]})
    seq_df = seq_df[data["n_sequences"] > 0].reset_index(drop=True)

    bins = LogBins.from_config(config)
    width = 2 * bins.num_bins - 1                       # signed bins -(NB-1)..NB-1
    frames = []
    for kind, values in zip(SEQ_HIST_KINDS, (seq_lr, mean_lr, max_abs)):
        idx = cell * width + bins.signed_index(values) + (bins.num_bins - 1)
        counts = torch.bincount(idx, minlength=(S + 1) * width)
        part = _sparse(counts, S, width, cells.seq_keys, "bin", {"count": counts}, dims, "seq_hist")
        part["bin"] -= bins.num_bins - 1
        part["kind"] = pd.array([kind] * len(part), dtype="string")
        frames.append(part)
    seq_hist = pd.concat(frames, ignore_index=True)[list(empty_table("seq_hist", dims).columns)]
    return seq_df, seq_hist, stale_rows
