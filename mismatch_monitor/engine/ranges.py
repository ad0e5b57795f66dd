"""The order the compiled token pass takes a batch's tokens in, and its split between workers.

Pure numpy on the sequence offsets and cells (no tokens are read here): ranges of one sequence
cell one after the other keep that cell's bins in cache in the pass (engine/_native.c), and cuts
at cell boundaries let two workers add into one set of accumulators with nothing to merge.
"""

from __future__ import annotations

import numpy as np


def sequence_ranges(start: int, stop: int, seq_offsets: np.ndarray | None, seq_cell: np.ndarray) -> np.ndarray:
    """The order the compiled pass takes tokens [start, stop) in: [n, 3] int64 rows (start,
    stop, sequence). With ``seq_offsets`` (every sequence contiguous), one row per sequence,
    the sequences of one sequence cell one after the other (stable, so in batch order inside a
    cell): the pass then keeps a cell's bins in cache until the cell's last sequence, instead
    of adding them to the [cells x bins] arrays at every change of cell. Without, one row of
    the tokens in batch order, their sequence ids read per token."""
    if seq_offsets is None:
        return np.array([[start, stop, -1]], dtype=np.int64)
    first = int(np.searchsorted(seq_offsets, start, side="right")) - 1
    last = int(np.searchsorted(seq_offsets, stop, side="left"))
    seqs = np.arange(first, last, dtype=np.int64)
    lo = np.maximum(seq_offsets[first:last], start)
    hi = np.minimum(seq_offsets[first + 1:last + 1], stop)
    keep = hi > lo
    seqs, lo, hi = seqs[keep], lo[keep], hi[keep]
    # cells, then batch order: unique keys, so the (faster) unstable sort is stable here
    order = np.argsort(seq_cell[seqs] * len(seqs) + np.arange(len(seqs)))
    return np.stack([lo[order], hi[order], seqs[order]], axis=1)


def split_by_cell(ranges: np.ndarray, seq_cell: np.ndarray, n: int, slack: float = 0.05) -> list[np.ndarray] | None:
    """``ranges`` (grouped by sequence cell, see :func:`sequence_ranges`) cut at cell boundaries
    into ``n`` parts of about equal tokens, so that no cell (and no sequence) is in two parts;
    None when the cells do not allow parts within ``slack`` of an equal share."""
    if n <= 1:
        return [ranges]
    tokens = np.cumsum(ranges[:, 1] - ranges[:, 0])
    total = int(tokens[-1]) if len(tokens) else 0
    cell = seq_cell[ranges[:, 2]] if (ranges[:, 2] >= 0).all() else None
    if cell is None or total == 0:
        return None
    firsts = np.flatnonzero(np.diff(cell)) + 1                 # ranges that start a new cell
    if len(firsts) < n - 1:
        return None
    before = tokens[firsts - 1]
    cuts = [int(firsts[np.abs(before - total * k / n).argmin()]) for k in range(1, n)]
    bounds = [0] + sorted(set(cuts)) + [len(ranges)]
    if len(bounds) != n + 1:
        return None
    sizes = np.diff(np.concatenate([[0], tokens])[bounds])
    if sizes.max() > (1 + slack) * total / n:
        return None
    return [ranges[a:b] for a, b in zip(bounds, bounds[1:])]
