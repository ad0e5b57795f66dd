"""Tail exemplars: the K worst tokens and sequences of a step, with what identifies them.

Aggregates say *that* the tail moved; exemplars say *which* tokens moved it. Tokens are ranked
by |lr| (valid tokens only), sequences by max_t |lr| over their valid tokens. Merging exemplars
of several ranks or batches keeps the global top K (:func:`merge_exemplars`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd
import torch

from .batch import STANDARD_DIMENSIONS, TokenBatch
from .config import MetricConfig

TOKEN_RANK = "abs_log_ratio"
SEQUENCE_RANK = "seq_max_abs_log_ratio"
EXEMPLAR_TABLES = {"exemplar_tokens": TOKEN_RANK, "exemplar_sequences": SEQUENCE_RANK}


def _labels(batch: TokenBatch, seq: np.ndarray) -> dict[str, object]:
    dims = list(STANDARD_DIMENSIONS) + sorted(set(batch.labels) - set(STANDARD_DIMENSIONS))
    out: dict[str, object] = {}
    for d in dims:
        values = batch.labels.get(d)
        col = [values[i] for i in seq] if values is not None else [None] * len(seq)  # K entries
        out[d] = pd.array(col, dtype="string")
    return out


def tail_exemplars(batch: TokenBatch, k: int, config: MetricConfig | None = None) -> dict[str, pd.DataFrame]:
    """The ``k`` largest-|lr| tokens and the ``k`` sequences with the largest max |lr|."""
    config = config or MetricConfig()
    if k <= 0 or batch.num_tokens == 0:
        return {name: empty_exemplars(name) for name in EXEMPLAR_TABLES}
    f64 = torch.float64
    B = batch.num_sequences
    best_val, best_idx = [], []
    seq_sum = torch.zeros(B + 1, dtype=f64, device=batch.device)
    seq_n = torch.zeros(B + 1, dtype=torch.int64, device=batch.device)
    seq_max = torch.full((B + 1,), -1.0, dtype=f64, device=batch.device)
    tol = config.positive_logprob_tol
    for start in range(0, batch.num_tokens, config.chunk_tokens):
        stop = min(start + config.chunk_tokens, batch.num_tokens)
        t = batch.trainer_logprobs[start:stop].to(f64)
        s = batch.sampler_logprobs[start:stop].to(f64)
        lr = t - s
        valid = torch.isfinite(lr) & (t <= tol) & (s <= tol)
        score = torch.where(valid, lr.abs(), -1.0)
        v, i = torch.topk(score, min(k, stop - start))
        best_val.append(v)
        best_idx.append(i + start)
        seq = torch.where(valid, batch.seq_index[start:stop], B)
        seq_sum += torch.bincount(seq, weights=torch.where(valid, lr, 0.0), minlength=B + 1)
        seq_n += torch.bincount(seq, minlength=B + 1)
        seq_max.scatter_reduce_(0, seq, score, "amax")
    vals, idx = torch.cat(best_val), torch.cat(best_idx)
    top = torch.topk(vals, min(k, vals.numel()))
    keep = top.values >= 0
    tok = idx[top.indices[keep]]
    seq_of_tok = batch.seq_index[tok].cpu().numpy()
    t = batch.trainer_logprobs[tok].to(f64).cpu().numpy()
    s = batch.sampler_logprobs[tok].to(f64).cpu().numpy()
    tokens = pd.DataFrame({
        **_labels(batch, seq_of_tok),
        "seq_index": seq_of_tok.astype(np.int64),
        "position": batch.position[tok].cpu().numpy().astype(np.int64),
        "turn_index": pd.array(batch.turn_index[tok].cpu().numpy() if batch.turn_index is not None
                               else [pd.NA] * len(tok), dtype="Int64"),
        "token_id": pd.array(batch.token_ids[tok].cpu().numpy() if batch.token_ids is not None
                             else [pd.NA] * len(tok), dtype="Int64"),
        "trainer_logprob": t,
        "sampler_logprob": s,
        "log_ratio": t - s,
        TOKEN_RANK: np.abs(t - s),
    })

    smax = seq_max[:B]
    ks = min(k, int((smax >= 0).sum()))
    stop_seq = torch.topk(smax, ks).indices if ks else torch.zeros(0, dtype=torch.int64)
    sid = stop_seq.cpu().numpy().astype(np.int64)
    n = seq_n[:B][stop_seq].cpu().numpy()
    total = seq_sum[:B][stop_seq].cpu().numpy()
    lengths = torch.bincount(batch.seq_index, minlength=B)[:B][stop_seq].cpu().numpy()
    seqs = pd.DataFrame({
        **_labels(batch, sid),
        "seq_index": sid,
        "length": lengths.astype(np.int64),
        "n_valid_tokens": n.astype(np.int64),
        "seq_log_ratio": total,
        "seq_mean_log_ratio": total / np.maximum(n, 1),
        SEQUENCE_RANK: smax[stop_seq].cpu().numpy(),
        "advantage": batch.advantages[stop_seq].to(f64).cpu().numpy() if batch.advantages is not None
        else np.full(len(sid), np.nan),
    })
    return {"exemplar_tokens": tokens, "exemplar_sequences": seqs}


def empty_exemplars(table: str) -> pd.DataFrame:
    labels = {d: pd.Series([], dtype="string") for d in STANDARD_DIMENSIONS}
    if table == "exemplar_tokens":
        cols = {"seq_index": "int64", "position": "int64", "turn_index": "Int64", "token_id": "Int64",
                "trainer_logprob": "float64", "sampler_logprob": "float64", "log_ratio": "float64",
                TOKEN_RANK: "float64"}
    else:
        cols = {"seq_index": "int64", "length": "int64", "n_valid_tokens": "int64",
                "seq_log_ratio": "float64", "seq_mean_log_ratio": "float64", SEQUENCE_RANK: "float64",
                "advantage": "float64"}
    return pd.DataFrame({**labels, **{c: pd.Series([], dtype=t) for c, t in cols.items()}})


def merge_exemplars(parts: Iterable[dict[str, pd.DataFrame]], k: int) -> dict[str, pd.DataFrame]:
    """The global top ``k`` of several exemplar sets (ranks, batches)."""
    parts = list(parts)
    out = {}
    for name, rank in EXEMPLAR_TABLES.items():
        frames = [p[name] for p in parts if name in p and len(p[name])]
        if not frames:
            out[name] = empty_exemplars(name)
            continue
        df = pd.concat(frames, ignore_index=True)
        out[name] = df.sort_values(rank, ascending=False, kind="stable").head(k).reset_index(drop=True)
    return out
