"""MoE routing flips: does the top-k expert *set* of a (token, layer) differ between sides?

Order inside the top-k does not count. Most rows are identical in order too, so the rows are
first compared as whole words (the K ids of a row reinterpreted as one or a few integers), and
only the rows whose ordered ids differ are put in order and compared again. Small K is ordered
with a sorting network of elementwise min/max over the columns (Batcher's odd-even merge sort);
``torch.sort`` along a dimension of a few elements is more than an order of magnitude slower.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from . import native_routing
from . import torch_pass

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices of the True entries of a 1-D bool tensor. On the CPU numpy's
    ``flatnonzero`` is ~4x faster than ``torch.nonzero``; both keep the order."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy())).to(torch.int64)
    return mask.nonzero().squeeze(1)
_NETWORK_MAX_K = 32


def _words(ids: torch.Tensor) -> torch.Tensor:
    """[n, L, K] ids -> [n, L, W] integers holding the same bytes (W = 1 when they fit one)."""
    row_bytes = ids.shape[-1] * ids.element_size()
    ids = ids.contiguous()
    if row_bytes in _WORD:
        return ids.view(_WORD[row_bytes])
    if row_bytes % 8 == 0:
        return ids.view(torch.int64)
    return ids


@lru_cache(maxsize=None)
def sorting_network(k: int) -> tuple[tuple[int, int], ...]:
    """Comparators (i, j), i < j, of Batcher's odd-even merge sort for k inputs."""
    n = 1
    while n < k:
        n *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < n:
        q = p
        while q >= 1:
            for j in range(q % p, n - q, 2 * q):
                for i in range(min(q, n - j - q)):
                    a, b = i + j, i + j + q
                    if a // (2 * p) == b // (2 * p) and b < k:
                        pairs.append((a, b))
            q //= 2
        p *= 2
    return tuple(pairs)


def _sorted_columns(cols: list[torch.Tensor]) -> list[torch.Tensor]:
    """K columns [m] -> the same K columns with every row sorted ascending."""
    cols = list(cols)
    for i, j in sorting_network(len(cols)):
        cols[i], cols[j] = torch.minimum(cols[i], cols[j]), torch.maximum(cols[i], cols[j])
    return cols


def flip_rows(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor) -> torch.Tensor:
    """[n, L, K] ids from both sides -> ascending flat indices ``token * L + layer`` of the
    (token, layer) pairs whose expert sets differ."""
    n, L, K = trainer_experts.shape
    differ = _words(trainer_experts) != _words(sampler_experts)             # [n, L, W]
    differ = differ.squeeze(-1) if differ.shape[-1] == 1 else differ.any(-1)
    rows = flat_nonzero(differ.view(-1))
    if rows.numel() == 0:
        return rows
    # only rows whose ordered ids differ: put them in order and compare as sets
    t_rows = torch.index_select(trainer_experts.reshape(n * L, K), 0, rows)   # [m, K]
    s_rows = torch.index_select(sampler_experts.reshape(n * L, K), 0, rows)
    if K <= _NETWORK_MAX_K:
        # column copies are ~3x cheaper than a transpose of the [m, K] block
        t_cols = _sorted_columns([t_rows[:, j].contiguous() for j in range(K)])
        s_cols = _sorted_columns([s_rows[:, j].contiguous() for j in range(K)])
        still = t_cols[0] != s_cols[0]
        for a, b in zip(t_cols[1:], s_cols[1:]):
            still |= a != b
    else:
        still = (t_rows.sort(dim=-1).values != s_rows.sort(dim=-1).values).any(-1)
    return rows[still]  # boolean indexing keeps the order


def routing_flips(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor) -> torch.Tensor:
    """[n, L, K] integer ids from both sides -> [n, L] bool, True where the sets differ."""
    n, L, _ = trainer_experts.shape
    out = torch.zeros(n * L, dtype=torch.bool, device=trainer_experts.device)
    out[flip_rows(trainer_experts, sampler_experts)] = True
    return out.view(n, L)


def routing_counts(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor,
                   token_cell: torch.Tensor, num_cells: int, chunk: int, compiled: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-cell routing statistics.

    Returns (n_routed_tokens [C], n_tokens_any_flip [C], flips per cell and layer [C, L], L).
    ``chunk`` bounds the tokens per pass; it is lowered so that one side's ids of a chunk stay
    near 16 MiB whatever L and K. ``compiled`` runs the loop of ``native_routing.py`` instead (CPU
    tensors, K <= 64): one read of both id tensors, the same counts.
    """
    N, L, K = trainer_experts.shape
    device = token_cell.device
    any_flip = torch.zeros(num_cells, dtype=torch.int64, device=device)
    per_layer = torch.zeros(num_cells * L, dtype=torch.int64, device=device)
    if torch_pass.sync_free(device):
        return _counts_without_waits(trainer_experts, sampler_experts, token_cell, num_cells, chunk, any_flip,
                                     per_layer)
    routed = torch.bincount(token_cell, minlength=num_cells)
    if compiled and K <= 64:
        native_routing.routing_flips(trainer_experts, sampler_experts, token_cell, sorting_network(K), per_layer, any_flip)
        return routed, any_flip, per_layer.view(num_cells, L), L
    chunk = max(1, min(chunk, (16 << 20) // max(1, L * K * trainer_experts.element_size())))
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        flat = flip_rows(trainer_experts[start:stop], sampler_experts[start:stop])   # ascending
        if flat.numel() == 0:
            continue
        tok = flat // L
        cell = token_cell[start:stop]
        per_layer += torch.bincount(cell[tok] * L + (flat - tok * L), minlength=num_cells * L)
        any_flip += torch.bincount(cell[torch.unique_consecutive(tok)], minlength=num_cells)
    return routed, any_flip, per_layer.view(num_cells, L), L


def _counts_without_waits(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor, token_cell: torch.Tensor,
                          num_cells: int, chunk: int, any_flip: torch.Tensor, per_layer: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``routing_counts`` without a wait for the device (a GPU): every row sorted along K and
    compared, counts added with ``scatter_add_`` (finding the rows that differ in order first,
    as the CPU does, would wait for their number)."""
    N, L, K = trainer_experts.shape
    routed = torch.zeros(num_cells, dtype=torch.int64, device=token_cell.device)
    routed.scatter_add_(0, token_cell, torch.ones_like(token_cell))
    layer = torch.arange(L, device=token_cell.device)
    chunk = max(1, min(chunk, (16 << 20) // max(1, L * K * trainer_experts.element_size())))
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        t = trainer_experts[start:stop].sort(dim=-1).values
        s = sampler_experts[start:stop].sort(dim=-1).values
        differ = (t != s).any(-1)                                        # [n, L]
        cell = token_cell[start:stop]
        per_layer.scatter_add_(0, (cell[:, None] * L + layer).reshape(-1), differ.reshape(-1).to(torch.int64))
        any_flip.scatter_add_(0, cell, differ.any(-1).to(torch.int64))
    return routed, any_flip, per_layer.view(num_cells, L), L
