"""The output tables, assembled from the accumulators of one pass (CPU, numpy + pandas).

Token sums are exact algebra on the joint (cell, lowprob bucket, region) bins of
``token_pass``; only non-empty cells and bins become rows.
"""

from __future__ import annotations

import functools
from typing import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ..batch import TokenBatch
from ..config import MetricConfig
from .fields import SEQ_HIST_KINDS
from . import native
from .histogram import LogBins
from .slicing import Cells
from .groupby import logsumexp_by
from .stats import empty_table, table_schema
from .regions import Regions, ppo_band
from .accumulators import PSUM_ROWS
from .token_pass import JOINT_SUMS, TokenAccumulators

Columns = Mapping[str, object]


def np_(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def typed_columns(table: str, dims: list[str], columns: Columns) -> dict[str, object]:
    """Exactly the columns of ``table_schema``, in order, each as an array of its dtype."""
    data: dict[str, object] = {}
    for name, dtype in table_schema(table, dims).items():
        value = columns[name]
        if isinstance(value, pd.api.extensions.ExtensionArray):
            data[name] = value
        elif dtype in ("string", "Int64"):
            data[name] = pd.array(value, dtype=dtype)
        else:
            data[name] = np.asarray(value).astype(dtype, copy=False)
    return data


def frame(table: str, dims: list[str], columns: Columns) -> pd.DataFrame:
    """A table with exactly the columns and dtypes of ``table_schema``."""
    return pd.DataFrame(typed_columns(table, dims, columns), copy=False)


def take_rows(values: object, rows: np.ndarray) -> object:
    """Rows of a key or value column (extension array or numpy). A string column without any
    value (a label the batch does not carry) is made as nulls, not copied row by row."""
    if isinstance(values, pd.arrays.ArrowStringArray) and len(rows) > 4096 and values.isna().all():
        return pd.arrays.ArrowStringArray(pa.nulls(len(rows), pa.array(values).type))
    if isinstance(values, pd.api.extensions.ExtensionArray):
        return values.take(rows)
    return np.asarray(values)[rows]


def sparse_columns(table: str, dims: list[str], keys: Columns, width: int, key: str,
                   values: Mapping[str, np.ndarray], nonzero: np.ndarray) -> dict[str, object]:
    """Rows (cell, index) where the integer array ``nonzero`` [C * width] is non-zero; values
    are [C * width]. A value that is ``nonzero`` itself (the table's count) comes with the rows;
    the others are gathered at them."""
    cell, at, counts = native.nonzero_rows(nonzero, width)
    columns: dict[str, object] = {c: take_rows(v, cell) for c, v in keys.items()}
    columns[key] = at
    idx = None
    for name, v in values.items():
        if v is nonzero:
            columns[name] = counts
        else:
            idx = cell * width + at if idx is None else idx
            columns[name] = v[idx]
    return typed_columns(table, dims, columns)


def sparse(table: str, dims: list[str], keys: Columns, width: int, key: str,
           values: Mapping[str, np.ndarray], nonzero: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(sparse_columns(table, dims, keys, width, key, values, nonzero), copy=False)


class JointBins:
    """The joint accumulators of C cells as numpy arrays in region order: n [C, NL, R] and the
    sums of ``JOINT_SUMS`` [C, NL, R] each."""

    def __init__(self, acc: TokenAccumulators, C: int, NL: int, regions: Regions):
        R = regions.num_regions
        slots = regions.slots()
        self.n = np_(acc.joint_n[: C * NL * R]).reshape(C, NL, R)[:, :, slots]
        sums = np_(acc.joint_sums[:, : C * NL * R]).reshape(len(JOINT_SUMS), C, NL, R)[..., slots]
        self.sums = dict(zip(JOINT_SUMS, sums))
        self.sign = np.where(regions.negative(), -1.0, 1.0)   # [R]: |lr| = sign * lr in a region

    def abs_lr(self) -> np.ndarray:
        return (self.sums["lr"] * self.sign).sum(2)          # [C, NL]


def token_table(acc: TokenAccumulators, joint: JointBins, keys: Columns, config: MetricConfig,
                dims: list[str], routing: Mapping[str, np.ndarray] | None) -> dict[str, object]:
    regions = Regions.from_config(config)
    C = joint.n.shape[0]
    reg = joint.n.sum(1)                                      # [C, R]
    r = np.arange(regions.num_regions)

    def count(mask: np.ndarray) -> np.ndarray:
        return reg[:, mask].sum(1)

    cap = config.tis_cap
    below = r <= regions.at_most(cap)                         # regions with rho <= cap
    by_region = {name: v.sum(1) for name, v in joint.sums.items()}   # [C, R] each
    rho = reg + by_region["k3"] + by_region["lr"]             # sum rho = n + sum(rho - 1 - lr) + sum lr
    rho2 = by_region["rho2"]
    n_above = count(~below)
    lo_i, hi_i = config.icepop_band
    ex_lo, ex_hi = config.extreme_band
    ppo_lo, ppo_hi = ppo_band(config)
    n_tokens = reg.sum(1)
    empty = n_tokens == 0
    min_lr = np.where(empty, np.nan, np_(acc.min_lr[:C]))
    max_lr = np.where(empty, np.nan, np_(acc.max_lr[:C]))
    total = {name: v.sum(1) for name, v in by_region.items()}
    data: dict[str, object] = dict(keys)
    data.update({
        "n_tokens": n_tokens,
        "n_nonfinite": np_(acc.n_nonfinite[:C]),
        "n_positive_logprob": np_(acc.n_positive[:C]),
        "n_lr_zero": np_(acc.n_lr_zero[:C]),
        **probability_sums(acc, C, empty),
        "sum_lr": total["lr"], "sum_lr2": total["lr2"], "sum_abs_lr": (by_region["lr"] * joint.sign).sum(1),
        **sharpness_sums(joint),
        "sum_k3": total["k3"], "sum_exp_abs_lr": total["exp_abs"], "sum_rho": rho.sum(1),
        "sum_rho2": total["rho2"],
        "sum_rho_capped": rho[:, below].sum(1) + cap * n_above,
        "sum_rho_capped2": rho2[:, below].sum(1) + cap * cap * n_above,
        "n_clip_high": n_above,
        "n_clip_low": count(r <= regions.at_most(1.0 / cap)),
        "n_outside_icepop": count((r <= regions.at_most(lo_i)) | (r > regions.at_most(hi_i))),
        "n_extreme": count((r <= regions.at_most(ex_lo)) | (r > regions.at_most(ex_hi))),
        "n_outside_ppo_clip": count((r <= regions.at_most(ppo_lo)) | (r > regions.at_most(ppo_hi))),
        "min_lr": min_lr, "max_lr": max_lr, "max_abs_lr": np.maximum(-min_lr, max_lr),
        "n_support_known": np_(acc.n_support_known[:C]),
        "n_support_mismatch": np_(acc.n_support_mismatch[:C]),
        "n_kept_logmass": np_(acc.n_kept[:C]),
        "sum_kept_logmass": np_(acc.sum_kept[:C]),
    })
    zeros = np.zeros(C, dtype=np.int64)
    for name in ("n_routed_tokens", "n_routing_decisions", "n_routing_flips", "n_tokens_any_flip"):
        data[name] = zeros if routing is None else routing[name]
    keep = (n_tokens + data["n_nonfinite"] + data["n_positive_logprob"] + data["n_routed_tokens"]
            + data["n_support_known"]) > 0
    idx = np.flatnonzero(keep)
    rows = {k: take_rows(v, idx) for k, v in data.items()}
    return typed_columns("tokens", dims, rows)


def sharpness_sums(joint: JointBins) -> dict[str, np.ndarray]:
    """Count, sum of rho - 1 and sum of rho^2 of the top sampler-probability bucket and of the
    buckets below the second-highest edge, from the joint bins: the two ends of the
    distribution, whose mean rho - 1 take opposite signs when one side's distribution is
    sharper than the other's."""
    NL = joint.n.shape[1]
    out = {}
    for side, buckets in (("top_p", slice(NL - 1, NL)), ("low_p", slice(0, max(NL - 2, 0)))):
        out[f"n_{side}"] = joint.n[:, buckets].sum((1, 2))
        out[f"sum_dev_{side}"] = (joint.sums["k3"][:, buckets] + joint.sums["lr"][:, buckets]).sum((1, 2))
        out[f"sum_rho2_{side}"] = joint.sums["rho2"][:, buckets].sum((1, 2))
    return out


def probability_sums(acc: TokenAccumulators, C: int, empty: np.ndarray) -> dict[str, np.ndarray]:
    """The stored probability-space fields of C cells from the pass's sums of p_S and
    dp = p_T - p_S (PSUM_ROWS): p_T = p_S + dp, so the sums of p_T, p_T^2 and p_T p_S are exact
    algebra on them (no difference of two rounded exps)."""
    ps, dp, ps2, psdp, dp2, abs_dp = (np_(row[:C]) for row in acc.p_sums)
    assert len(PSUM_ROWS) == 6
    return {"sum_p_trainer": ps + dp, "sum_p_sampler": ps, "sum_p_trainer2": ps2 + 2.0 * psdp + dp2,
            "sum_p_sampler2": ps2, "sum_p_cross": ps2 + psdp, "sum_abs_dp": abs_dp,
            "max_abs_dp": np.where(empty, np.nan, np_(acc.max_abs_dp[:C]))}


def lowprob_table(joint: JointBins, keys: Columns, dims: list[str]) -> pd.DataFrame:
    n = joint.n.sum(2)                                        # [C, NL]
    NL = n.shape[1]
    counts = n.ravel()
    return sparse("lowprob", dims, keys, NL, "bucket",
                  {"n_tokens": counts, "sum_abs_lr": joint.abs_lr().ravel(),
                   "sum_k3": joint.sums["k3"].sum(2).ravel()}, counts)


@functools.lru_cache(maxsize=1)
def _kinds() -> pd.api.extensions.ExtensionArray:
    return pd.array(list(SEQ_HIST_KINDS), dtype="string")


def sequence_tables(acc: TokenAccumulators, batch: TokenBatch, cells: Cells, config: MetricConfig,
                    dims: list[str]) -> tuple[dict[str, object], pd.DataFrame, pd.DataFrame]:
    """(sequences as typed columns, seq_hist, staleness): per sequence-cell statistics of
    per-sequence values."""
    B, S = batch.num_sequences, cells.num_seq_cells
    n = np_(cells.seq_length) - np_(acc.seq_invalid[:B])      # valid tokens per sequence
    ok = n > 0
    cell = np.where(ok, np_(cells.seq_cell), S)               # dump cell S for the others
    nf = np.maximum(n, 1).astype(np.float64)
    seq_lr = np_(acc.seq_sum_lr[:B])
    mean_lr = seq_lr / nf
    mult_err = np_(acc.seq_sum_exp_abs[:B]) / nf
    max_abs = np_(acc.seq_max_abs[:B])

    def cnt(mask: np.ndarray) -> np.ndarray:
        return np.bincount(cell[mask], minlength=S + 1)[:S]

    def ssum(w: np.ndarray) -> np.ndarray:
        return np.bincount(cell, weights=w, minlength=S + 1)[:S]

    def outside(x: np.ndarray, band: tuple[float, float]) -> np.ndarray:
        return (x <= np.log(band[0])) | (x > np.log(band[1]))

    def extreme(x: np.ndarray, how: np.ufunc, init: float) -> np.ndarray:
        out = np.full(S + 1, init)
        how.at(out, cell, x)
        v = out[:S]
        return np.where(np.isfinite(v), v, np.nan)

    keys = cells.seq_key_columns()
    data: dict[str, object] = dict(keys)
    data.update({
        "n_sequences": cnt(ok), "sum_seq_len": np.bincount(cell, weights=n, minlength=S + 1)[:S].round(),
        "sum_seq_lr": ssum(seq_lr), "sum_seq_lr2": ssum(seq_lr * seq_lr),
        "sum_seq_mean_lr": ssum(mean_lr), "sum_seq_max_abs_lr": ssum(max_abs),
        "lse_seq_w": logsumexp_by(seq_lr, cell, S + 1)[:S], "lse_seq_w2": logsumexp_by(2.0 * seq_lr, cell, S + 1)[:S],
        "min_seq_lr": extreme(seq_lr, np.minimum, np.inf), "max_seq_lr": extreme(seq_lr, np.maximum, -np.inf),
        "max_seq_max_abs_lr": extreme(max_abs, np.maximum, -np.inf),
        "n_drop_product": cnt(outside(seq_lr, config.seq_product_band)),
        "n_drop_geometric": cnt(outside(mean_lr, config.seq_geometric_band)),
        "n_drop_mult_error": cnt(mult_err > config.seq_mult_error_threshold),
    })
    zeros = np.zeros(S, dtype=np.int64)
    if batch.advantages is not None:
        adv = np_(batch.advantages.to(torch.float64))
        data["n_adv_known"] = cnt(np.ones(B, dtype=bool))
        data["n_drop_neg_adv"] = cnt((adv < 0) & (-mean_lr > config.neg_adv_delta))
    else:
        data["n_adv_known"] = data["n_drop_neg_adv"] = zeros
    stale_rows = empty_table("staleness", dims)
    if batch.policy_version is not None:
        staleness = batch.trainer_version - np_(batch.policy_version)   # [B]
        data["n_stale_known"] = cnt(np.ones(B, dtype=bool))
        data["sum_staleness"] = np.bincount(cell, weights=staleness, minlength=S + 1)[:S].round()
        data["max_staleness"] = extreme(staleness.astype(np.float64), np.maximum, -np.inf)
        W = config.staleness_max + 1
        st_counts = np.bincount(cell * W + np.minimum(staleness, config.staleness_max), minlength=(S + 1) * W)
        st_counts = st_counts[: S * W]                     # the dump cell S dropped
        stale_rows = sparse("staleness", dims, keys, W, "staleness", {"count": st_counts}, st_counts)
    else:
        data["n_stale_known"] = data["sum_staleness"] = zeros
        data["max_staleness"] = np.full(S, np.nan)
    seq_idx = np.flatnonzero(data["n_sequences"] > 0)
    seq_cols = typed_columns("sequences", dims, {k: take_rows(v, seq_idx) for k, v in data.items()})

    # the three kinds in one table, from the distinct (kind, cell, bin) keys of the sequences
    # (a few per sequence: sorting them beats a dense count over every cell and bin)
    bins = LogBins.from_config(config)
    width = 2 * bins.num_bins - 1                       # signed bins -(NB-1)..NB-1
    K = len(SEQ_HIST_KINDS)
    kept = np.flatnonzero(ok)
    signed = np.concatenate([np_(bins.signed_index(torch.from_numpy(v[kept]))) for v in (seq_lr, mean_lr, max_abs)])
    kind_cell = np.repeat(np.arange(K) * S, len(kept)) + np.tile(cell[kept], K)
    key, counts = np.unique(kind_cell * width + signed + (bins.num_bins - 1), return_counts=True)
    kind_cell, b = np.divmod(key, width)
    kind, c = np.divmod(kind_cell, S)
    columns: dict[str, object] = {k: take_rows(v, c) for k, v in keys.items()}
    columns["kind"] = _kinds().take(kind)
    columns["bin"] = b - (bins.num_bins - 1)
    columns["count"] = counts
    seq_hist = frame("seq_hist", dims, columns)
    return seq_cols, seq_hist, stale_rows
