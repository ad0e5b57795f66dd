"""Per-table breakdowns the dashboard reads: pools' shares of the fleet, metrics per
sampler-probability bucket and per MoE layer, each from the metrics declared on its table
(``metric_defs.VIEW_METRICS``) over the step bins of :func:`views.aggregate_binned`."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import duckdb
import numpy as np
import pandas as pd

from ..engine.fields import merge_rules
from ..engine.stats import aggregate
from ..formulas import divide, evaluate
from ..metrics import VIEW_METRICS
from .core import RunDir, StepRange
from .binned import aggregate_binned
from .views import _whole


def _with_views(df: pd.DataFrame, table: str) -> pd.DataFrame:
    """``df`` (merged columns of ``table``) with a column per metric declared on that table."""
    for m in VIEW_METRICS:
        if m.table == table:
            df[m.key] = evaluate(m.formula, df)
    return df


def pool_shares(con: duckdb.DuckDBPyConnection, run_dir: RunDir, *, steps: StepRange = None,
                tokens: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per pool over ``steps``: its share of sequences, of tokens and of extreme-ratio tokens.

    ``tail_to_sample`` = extreme_share / sample_share: above 1, a pool holds more of the tail
    than of the samples. Shares of an empty total are null. ``tokens``: the tokens table by pool
    over exactly these steps, in step bins of any width, when the caller has read it already.
    """
    span = _whole(con, run_dir, steps)
    first, width = (span[0], span[1] - span[0] + 1) if span is not None else (0, 1)
    kw: dict[str, Any] = dict(first=first, width=width, steps=span if span is not None else (0, -1))
    if tokens is None:
        tokens = aggregate_binned(con, run_dir, "tokens", ["pool"], **kw)
    # the step bins merged per pool by the fields' own merge rules (the engine's group-by)
    tok = aggregate(tokens, ["pool"], {c: merge_rules("tokens")[c] for c in ("n_tokens", "n_extreme")})
    seq = aggregate_binned(con, run_dir, "sequences", ["pool"], times=False, **kw)
    tok, seq = tok.assign(pool=tok["pool"].astype(object)), seq.assign(pool=seq["pool"].astype(object))
    out = tok.merge(seq[["pool", "n_sequences"]], on="pool", how="outer")
    for col in ("n_tokens", "n_extreme", "n_sequences"):
        out[col] = out[col].astype("float64").fillna(0.0)
    out["sample_share"] = divide(out["n_sequences"], pd.Series(out["n_sequences"].sum(), index=out.index))
    out["token_share"] = divide(out["n_tokens"], pd.Series(out["n_tokens"].sum(), index=out.index))
    out["extreme_share"] = divide(out["n_extreme"], pd.Series(out["n_extreme"].sum(), index=out.index))
    out["tail_to_sample"] = divide(out["extreme_share"].fillna(-1.0), out["sample_share"])
    out.loc[out["extreme_share"].isna(), "tail_to_sample"] = np.nan
    return out.sort_values("pool", na_position="last").reset_index(drop=True)


def lowprob_series(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                   first: int, width: int, steps: StepRange = None,
                   where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Per step bin and sampler-probability bucket: n_tokens, mean_abs_lr and k3 (null if empty)."""
    df = aggregate_binned(con, run_dir, "lowprob", by, first=first, width=width, steps=steps, where=where)
    return _with_views(df, "lowprob")


def routing_layer_series(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                         first: int, width: int, steps: StepRange = None,
                         where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Per step bin and MoE layer: flip_rate = tokens whose expert set differs at the layer /
    tokens with expert ids (null where no token carried expert ids)."""
    kw: dict[str, Any] = dict(first=first, width=width, steps=steps, where=where)
    layers = aggregate_binned(con, run_dir, "routing_layers", by, **kw)
    routed = aggregate_binned(con, run_dir, "tokens", by, **kw)[["step"] + list(by) + ["n_routed_tokens"]]
    df = layers.merge(routed, on=["step"] + list(by), how="left")
    return _with_views(df, "routing_layers")


def crossing_length(mean_abs_lr: np.ndarray | pd.Series, cap: float) -> np.ndarray:
    """T* = ln C / mean|lr|: the response length at which a product of per-token ratios of typical
    size exp(mean|lr|) reaches the cap C. Null without observation, inf when mean|lr| = 0."""
    m = np.asarray(mean_abs_lr, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(np.isnan(m), np.nan, np.where(m > 0, math.log(cap) / np.where(m > 0, m, 1.0), np.inf))
