"""MoE routing flips: does the top-k expert *set* of a (token, layer) differ between sides?

Order inside the top-k does not count. Most rows are identical in order too, so the rows are
first compared as whole words (K uint8 ids packed into one int64 when K <= 8), and only the
rows whose ordered ids differ are sorted along K and compared as sets.
"""

from __future__ import annotations

import torch


def _packed_words(ids: torch.Tensor) -> torch.Tensor | None:
    """[n, L, K] uint8 ids -> [n, L] int64 words, when K <= 8; else None."""
    K = ids.shape[-1]
    if ids.dtype != torch.uint8 or K > 8:
        return None
    if K < 8:
        ids = torch.nn.functional.pad(ids, (0, 8 - K))
    return ids.contiguous().view(torch.int64).squeeze(-1)


def routing_flips(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor) -> torch.Tensor:
    """[n, L, K] integer ids from both sides -> [n, L] bool, True where the sets differ."""
    words_t, words_s = _packed_words(trainer_experts), _packed_words(sampler_experts)
    if words_t is not None and words_s is not None:
        differ = words_t != words_s                           # [n, L]
    else:
        differ = (trainer_experts != sampler_experts).any(-1)  # [n, L]
    rows = differ.nonzero(as_tuple=True)
    if rows[0].numel() == 0:
        return differ
    # only rows whose ordered ids differ: sort along K and compare as sets
    t_sorted = trainer_experts[rows].sort(dim=-1).values      # [m, K]
    s_sorted = sampler_experts[rows].sort(dim=-1).values
    differ[rows] = (t_sorted != s_sorted).any(-1)
    return differ


def routing_counts(trainer_experts: torch.Tensor, sampler_experts: torch.Tensor,
                   token_cell: torch.Tensor, num_cells: int, chunk: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-cell routing statistics.

    Returns (n_routed_tokens [C], n_tokens_any_flip [C], flips per cell and layer [C, L], L).
    """
    N, L = trainer_experts.shape[0], trainer_experts.shape[1]
    device = token_cell.device
    routed = torch.bincount(token_cell, minlength=num_cells)
    any_flip = torch.zeros(num_cells, dtype=torch.int64, device=device)
    per_layer = torch.zeros(num_cells * L, dtype=torch.int64, device=device)
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        flips = routing_flips(trainer_experts[start:stop], sampler_experts[start:stop])  # [n, L]
        tok, layer = flips.nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        cell = token_cell[start:stop]
        per_layer += torch.bincount(cell[tok] * L + layer, minlength=num_cells * L)
        any_flip += torch.bincount(cell[flips.any(1)], minlength=num_cells)
    return routed, any_flip, per_layer.view(num_cells, L), L
