"""Slice cells: which cell each sequence and token belongs to.

A *sequence cell* is one combination of the sequence labels and the response-length bucket; a
*token cell* adds the turn bucket. Only combinations that occur get an id, so the dense
accumulators are at most B x (turn buckets) long, whatever the label cardinalities.

Buckets are stored as their lower edge: length bucket 0 holds lengths below length_edges[0],
bucket e holds lengths in [e, next edge). The same for turns; a batch without turn indices has
a null turn bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ..batch import STANDARD_DIMENSIONS, TokenBatch
from ..config import MetricConfig
from .fields import LENGTH_KEY, TURN_KEY


def bucket_lower_edges(edges: tuple[int, ...]) -> np.ndarray:
    """Lower edge of every bucket: [0, e0, e1, ...]."""
    return np.concatenate(([0], np.asarray(edges, dtype=np.int64)))


def bucketize(values: torch.Tensor, edges: tuple[int, ...]) -> torch.Tensor:
    """Bucket index i with edges[i-1] <= v < edges[i] (int64)."""
    boundaries = torch.as_tensor(edges, dtype=values.dtype, device=values.device)
    return torch.bucketize(values, boundaries, right=True)


def bucket_table(edges: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[edges[-1] + 1] bucket of every integer 0..edges[-1]; larger integers share the last
    bucket. Indexing this table is several times faster than a binary search per token."""
    return bucketize(torch.arange(int(edges[-1]) + 1, device=device), edges)


@dataclass(frozen=True)
class Cells:
    """Cell ids of one batch.

    seq_cell: [B] int64 sequence-cell id of every sequence (0..num_seq_cells-1).
    seq_length: [B] int64 response length (all response tokens, valid or not).
    num_seq_cells, num_turn_buckets: sizes; token cell = seq_cell * num_turn_buckets + turn.
    seq_keys: DataFrame [num_seq_cells] of label columns and length_bucket.
    has_turns: whether the batch carried turn indices.
    """

    seq_cell: torch.Tensor
    seq_length: torch.Tensor
    num_seq_cells: int
    num_turn_buckets: int
    seq_keys: pd.DataFrame
    has_turns: bool
    turn_lower_edges: np.ndarray

    @property
    def num_token_cells(self) -> int:
        return self.num_seq_cells * self.num_turn_buckets

    def token_cells(self, seq_index: torch.Tensor, turn_index: torch.Tensor | None,
                    turn_table: torch.Tensor | None = None) -> torch.Tensor:
        """[n] token cell of each token; ``turn_table`` from :func:`bucket_table`."""
        # index_select: several times faster than advanced indexing for a gather
        cell = torch.index_select(self.seq_cell, 0, seq_index)
        if turn_index is None:
            return cell
        if turn_table is None:
            raise ValueError("expected the turn bucket table for a batch with turn indices")
        turn = torch.index_select(turn_table, 0, turn_index.clamp(max=turn_table.numel() - 1))
        return cell.mul_(self.num_turn_buckets).add_(turn)

    def seq_key_columns(self) -> dict[str, pd.api.extensions.ExtensionArray]:
        """Key columns of every sequence cell, in sequence-cell id order."""
        return {c: self.seq_keys[c].array for c in self.seq_keys.columns}

    def token_key_columns(self) -> dict[str, pd.api.extensions.ExtensionArray]:
        """Key columns of every token cell, in token-cell id order."""
        reps = self.num_turn_buckets
        rows = np.repeat(np.arange(self.num_seq_cells), reps)
        keys = {c: self.seq_keys[c].array.take(rows) for c in self.seq_keys.columns}
        if self.has_turns:
            keys[TURN_KEY] = pd.array(np.tile(self.turn_lower_edges, self.num_seq_cells), dtype="Int64")
        else:
            keys[TURN_KEY] = pd.array([pd.NA] * len(rows), dtype="Int64")
        return keys


def label_column(uniques: np.ndarray, codes: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """The "string" column of ``uniques[codes]`` (a null unique stays null)."""
    values = pa.array([None if pd.isna(u) else str(u) for u in uniques], pa.large_string())
    return pd.arrays.ArrowStringArray(values.take(pa.array(codes)))


def dimension_names(labels: dict[str, tuple[str, ...]]) -> list[str]:
    """The standard dimensions, then any extra ones in sorted order."""
    return list(STANDARD_DIMENSIONS) + sorted(set(labels) - set(STANDARD_DIMENSIONS))


def assign_cells(batch: TokenBatch, config: MetricConfig) -> Cells:
    B = batch.num_sequences
    device = batch.device
    dims = dimension_names(dict(batch.labels))
    if batch.seq_offsets is not None:       # contiguous sequences: no pass over the tokens
        seq_length = batch.seq_offsets[1:] - batch.seq_offsets[:-1]
    elif batch.num_tokens:
        seq_length = torch.bincount(batch.seq_index, minlength=B)[:B]
    else:
        seq_length = torch.zeros(B, dtype=torch.int64, device=device)
    length_bucket = bucketize(seq_length, config.length_edges).cpu().numpy()

    # mixed-radix code over (label codes..., length bucket), per sequence, no Python loop over B
    code = np.zeros(B, dtype=np.int64)
    uniques: dict[str, np.ndarray] = {}
    for dim in dims:  # loop over dimensions, not sequences
        values = batch.labels.get(dim)
        if values is None:
            continue
        codes, uniq = pd.factorize(np.asarray(values, dtype=object), sort=True, use_na_sentinel=False)
        uniques[dim] = np.asarray(uniq, dtype=object)
        code = code * len(uniq) + codes
    n_len = len(config.length_edges) + 1
    code = code * n_len + length_bucket
    unique_codes, seq_cell = np.unique(code, return_inverse=True)

    # decode the unique codes back to key columns: each label's few distinct values taken by
    # code (no per-cell string conversion); a label the batch does not carry is all nulls
    codes: dict[str, np.ndarray] = {}
    rest = unique_codes.copy()
    lower = bucket_lower_edges(config.length_edges)
    length_keys = lower[rest % n_len]
    rest //= n_len
    for dim in reversed(dims):
        if dim not in uniques:
            continue
        codes[dim] = rest % len(uniques[dim])
        rest //= len(uniques[dim])
    columns = {}
    for dim in dims:
        if dim in codes:
            columns[dim] = label_column(uniques[dim], codes[dim])
        else:
            columns[dim] = pd.arrays.ArrowStringArray(pa.nulls(len(unique_codes), pa.large_string()))
    columns[LENGTH_KEY] = pd.array(length_keys, dtype="int64")
    seq_keys = pd.DataFrame(columns, copy=False)

    has_turns = batch.turn_index is not None
    n_turn = len(config.turn_edges) + 1 if has_turns else 1
    return Cells(
        seq_cell=torch.as_tensor(seq_cell.reshape(-1), dtype=torch.int64, device=device),
        seq_length=seq_length,
        num_seq_cells=len(unique_codes),
        num_turn_buckets=n_turn,
        seq_keys=seq_keys,
        has_turns=has_turns,
        turn_lower_edges=bucket_lower_edges(config.turn_edges),
    )
