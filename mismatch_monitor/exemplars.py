"""Tail exemplars: the K worst tokens and sequences of a step, with what identifies them.

Aggregates say *that* the tail moved; exemplars say *which* tokens moved it. Tokens are ranked
by |lr| (valid tokens only), sequences by max_t |lr| over their valid tokens. Merging exemplars
of several ranks or batches keeps the global top K (:func:`merge_exemplars`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from .batch import STANDARD_DIMENSIONS, TokenBatch
from .config import MetricConfig
from .engine import SequenceValues
from .engine.token_pass import token_validity

TOKEN_RANK = "abs_log_ratio"
SEQUENCE_RANK = "seq_max_abs_log_ratio"
EXEMPLAR_TABLES = {"exemplar_tokens": TOKEN_RANK, "exemplar_sequences": SEQUENCE_RANK}


# dtype objects, not names: parsing "string" costs more than building a K-entry column
_STRING = pd.StringDtype()
_INT64 = pd.Int64Dtype()


def _labels(batch: TokenBatch, seq: np.ndarray) -> dict[str, list[str | None]]:
    """Every label dimension's value for the K sequences ``seq`` (plain lists: cheap to take)."""
    dims = list(STANDARD_DIMENSIONS) + sorted(set(batch.labels) - set(STANDARD_DIMENSIONS))
    rows = seq.tolist()
    out: dict[str, list[str | None]] = {}
    for d in dims:
        values = batch.labels.get(d)
        out[d] = [values[i] for i in rows] if values is not None else [None] * len(rows)
    return out


@dataclass(frozen=True)
class Exemplars:
    """The exemplars of one batch as plain columns (small arrays and label lists; no reference
    to the batch). :meth:`frames` builds its tables; :meth:`frames_of` builds the tables of many
    sets at once, which the run writer does when it flushes (a frame costs far more to build
    than its few rows)."""

    columns: dict[str, dict[str, object]]     # table -> column -> values

    def frames(self) -> dict[str, pd.DataFrame]:
        return {table: _frame(table, cols) for table, cols in self.columns.items()}

    @staticmethod
    def frames_of(items: Sequence[tuple[int, "Exemplars"]], key: str = "step") -> dict[str, pd.DataFrame]:
        """One table each for many exemplar sets; every row carries its set's ``key`` (a column)."""
        out = {}
        for table in EXEMPLAR_TABLES:
            parts = [(k, e.columns[table]) for k, e in items if e.columns.get(table)]
            if not parts:
                continue
            names = list(dict.fromkeys(name for _, cols in parts for name in cols))
            sizes = [len(next(iter(cols.values()))) for _, cols in parts]
            merged: dict[str, object] = {}
            for name in names:
                values = [cols.get(name) for _, cols in parts]
                if all(isinstance(v, list) or v is None for v in values):     # labels (absent: null)
                    merged[name] = [x for v, n in zip(values, sizes) for x in (v if v is not None else [None] * n)]
                else:
                    merged[name] = np.concatenate([np.asarray(v) for v in values])
            frame = _frame(table, merged)
            frame[key] = np.repeat(np.array([k for k, _ in parts], dtype=np.int64), sizes)
            out[table] = frame
        return out


def _frame(table: str, cols: Mapping[str, object]) -> pd.DataFrame:
    if not cols:
        return empty_exemplars(table)
    data: dict[str, object] = {}
    for name, values in cols.items():
        if isinstance(values, list):
            data[name] = pd.array(values, dtype=_STRING)
        elif name in _NULLABLE_INT:
            data[name] = pd.array(values, dtype=_INT64)
        else:
            data[name] = values
    return pd.DataFrame(data)


_NULLABLE_INT = ("turn_index", "token_id")


def sequence_values(batch: TokenBatch, config: MetricConfig) -> SequenceValues:
    """Per-sequence max |lr|, sum lr and valid-token count, in one pass (when the engine's
    values are not at hand)."""
    f64 = torch.float64
    B = batch.num_sequences
    seq_sum = torch.zeros(B + 1, dtype=f64, device=batch.device)
    seq_n = torch.zeros(B + 1, dtype=torch.int64, device=batch.device)
    seq_max = torch.zeros(B + 1, dtype=f64, device=batch.device)
    for start in range(0, batch.num_tokens, config.chunk_tokens):
        stop = min(start + config.chunk_tokens, batch.num_tokens)
        lr, valid = _log_ratio(batch, config, slice(start, stop))
        seq = torch.where(valid, batch.seq_index[start:stop], B)
        seq_sum += torch.bincount(seq, weights=torch.where(valid, lr, 0.0), minlength=B + 1)
        seq_n += torch.bincount(seq, minlength=B + 1)
        seq_max.scatter_reduce_(0, seq, torch.where(valid, lr.abs(), 0.0), "amax")
    return SequenceValues(max_abs_lr=seq_max[:B], sum_lr=seq_sum[:B], n_valid=seq_n[:B])


def _log_ratio(batch: TokenBatch, config: MetricConfig, index: slice | torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """lr in float64 and the validity mask (the engine's policy) of the selected tokens."""
    t = batch.trainer_logprobs[index].to(torch.float64)
    s = batch.sampler_logprobs[index].to(torch.float64)
    finite, positive = token_validity(t, s, config.positive_logprob_tol)
    return t - s, finite & ~positive


def _tokens_of(batch: TokenBatch, seqs: torch.Tensor) -> torch.Tensor:
    """Token indices of the sequences ``seqs``: ranges when sequences are contiguous."""
    if batch.seq_offsets is None:
        mark = torch.zeros(batch.num_sequences, dtype=torch.bool, device=batch.device)
        mark[seqs] = True
        return mark[batch.seq_index].nonzero().squeeze(1)
    starts = batch.seq_offsets[seqs]
    lengths = batch.seq_offsets[seqs + 1] - starts
    first = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)
    return first + torch.arange(int(lengths.sum()), device=batch.device)


def _lengths(batch: TokenBatch) -> torch.Tensor:
    if batch.seq_offsets is not None:
        return batch.seq_offsets.diff()
    return torch.bincount(batch.seq_index, minlength=batch.num_sequences)[: batch.num_sequences]


def tail_exemplars(batch: TokenBatch, k: int, config: MetricConfig | None = None,
                   sequences: SequenceValues | None = None) -> dict[str, pd.DataFrame]:
    """The ``k`` largest-|lr| tokens and the ``k`` sequences with the largest max |lr|, as
    tables (see :func:`select_exemplars`)."""
    return select_exemplars(batch, k, config, sequences).frames()


def select_exemplars(batch: TokenBatch, k: int, config: MetricConfig | None = None,
                     sequences: SequenceValues | None = None) -> Exemplars:
    """The ``k`` largest-|lr| tokens and the ``k`` sequences with the largest max |lr|.

    ``sequences``: the engine's per-sequence values (``compute_stats_with_sequences``); without
    them one extra pass computes them. The ``k`` worst tokens always lie in the ``k`` sequences
    with the largest max |lr| (a sequence holding one of them has fewer than ``k`` sequences
    whose maximum exceeds its own), so only those sequences' tokens are read again.
    """
    config = config or MetricConfig()
    none = Exemplars({name: {} for name in EXEMPLAR_TABLES})
    if k <= 0 or batch.num_tokens == 0:
        return none
    seqs = sequences if sequences is not None else sequence_values(batch, config)
    has = seqs.n_valid > 0
    score = torch.where(has, seqs.max_abs_lr.to(torch.float64), -1.0)
    ks = min(k, int(has.sum()))
    if ks == 0:
        return none
    top_seq = torch.topk(score, ks).indices                            # [ks]

    cand = _tokens_of(batch, top_seq)                                   # tokens of those sequences
    lr, valid = _log_ratio(batch, config, cand)
    top = torch.topk(torch.where(valid, lr.abs(), -1.0), min(k, cand.numel()))
    tok = cand[top.indices[top.values >= 0]]
    seq_of_tok = batch.sequences_of(tok).cpu().numpy()
    t = batch.trainer_logprobs[tok].to(torch.float64).cpu().numpy()
    s = batch.sampler_logprobs[tok].to(torch.float64).cpu().numpy()
    tokens = {
        **_labels(batch, seq_of_tok),
        "seq_index": seq_of_tok.astype(np.int64),
        "position": batch.positions_of(tok).cpu().numpy().astype(np.int64),
        "turn_index": (batch.turn_index[tok].cpu().numpy() if batch.turn_index is not None
                       else np.array([pd.NA] * len(tok), dtype=object)),
        "token_id": (batch.token_ids[tok].cpu().numpy() if batch.token_ids is not None
                     else np.array([pd.NA] * len(tok), dtype=object)),
        "trainer_logprob": t,
        "sampler_logprob": s,
        "log_ratio": t - s,
        TOKEN_RANK: np.abs(t - s),
    }

    sid = top_seq.cpu().numpy().astype(np.int64)
    n = seqs.n_valid[top_seq].cpu().numpy()
    total = seqs.sum_lr[top_seq].to(torch.float64).cpu().numpy()
    lengths = _lengths(batch)[top_seq].cpu().numpy()
    sequences_cols = {
        **_labels(batch, sid),
        "seq_index": sid,
        "length": lengths.astype(np.int64),
        "n_valid_tokens": n.astype(np.int64),
        "seq_log_ratio": total,
        "seq_mean_log_ratio": total / np.maximum(n, 1),
        SEQUENCE_RANK: seqs.max_abs_lr[top_seq].to(torch.float64).cpu().numpy(),
        "advantage": batch.advantages[top_seq].to(torch.float64).cpu().numpy() if batch.advantages is not None
        else np.full(len(sid), np.nan),
    }
    return Exemplars({"exemplar_tokens": tokens, "exemplar_sequences": sequences_cols})


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
