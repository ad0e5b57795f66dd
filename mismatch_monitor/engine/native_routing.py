"""The compiled routing loop (``mm_routing_flips`` of ``_native.c``), called through ctypes.

The sorting network comes from ``routing.sorting_network`` (one definition); here it is laid
out for the loop: comparator pairs, and for top-8 byte ids the same comparators in layers of
16-lane vectors. Every array is checked against the layout the loop reads (``boundary.py``).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from .boundary import Network, checked
from .native import library

_EXPERT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def byte_layers(network: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The comparators of an 8-input network in layers of disjoint pairs, as the 16-lane vectors
    of the top-8 byte path of _native.c ([layers, 16] uint8 each): each lane's partner (itself
    when it has none) and 0xff where the lane keeps the minimum; lanes 8-15 repeat 0-7 for the
    second row. A pair joins the current layer when it shares no lane with it: only
    comparators on disjoint lanes change places, so the layers sort as the sequence does."""
    layers: list[list[tuple[int, int]]] = []
    for i, j in network:
        if not layers or any({i, j} & {a, b} for a, b in layers[-1]):
            layers.append([])
        layers[-1].append((i, j))
    partner = np.tile(np.arange(16, dtype=np.uint8), (len(layers), 1))
    lower = np.full((len(layers), 16), 255, dtype=np.uint8)
    for row, layer in enumerate(layers):
        for half in (0, 8):
            for i, j in layer:
                partner[row, half + i], partner[row, half + j] = half + j, half + i
                lower[row, half + j] = 0
    return partner, lower


@functools.lru_cache(maxsize=None)
def _network(network: tuple[tuple[int, int], ...], k: int) -> tuple[Network, tuple]:
    """The ctypes form of a sorting network for ``k`` inputs (kept with the arrays it points
    into); for 8 inputs with the byte layers too."""
    pairs = np.array(network, dtype=np.int32).reshape(-1)
    if k == 8:
        partner, lower = byte_layers(network)
    else:
        partner = lower = np.zeros((0, 16), dtype=np.uint8)
    return Network(_addr(pairs), len(network), _addr(partner), _addr(lower), len(partner)), (pairs, partner, lower)


def routing_flips(trainer: torch.Tensor, sampler: torch.Tensor, cell: torch.Tensor,
                  network: tuple[tuple[int, int], ...], per_layer: torch.Tensor, any_flip: torch.Tensor) -> int:
    """Flips of [n, L, K] integer ids into ``per_layer`` [C * L] and ``any_flip`` [C] (int64);
    ``network`` sorts K inputs (routing.sorting_network)."""
    where = "compiled routing loop"
    if trainer.dim() != 3 or trainer.dtype not in _EXPERT_DTYPES:
        raise TypeError(f"{where}: expected trainer_experts as [n, L, K] integer ids, got {trainer.dtype} "
                        f"of shape {tuple(trainer.shape)}")
    n, L, K = trainer.shape
    trainer, sampler, cell = trainer.contiguous(), sampler.contiguous(), cell.contiguous()
    C = any_flip.numel()
    args = (checked(where, "trainer_experts", trainer, (trainer.dtype,), (n, L, K)),
            checked(where, "sampler_experts", sampler, (trainer.dtype,), (n, L, K)),
            checked(where, "token_cell", cell, (torch.int64,), (n,)))
    outs = (checked(where, "per_layer", per_layer, (torch.int64,), (C * L,)),
            checked(where, "any_flip", any_flip, (torch.int64,), (C,)))
    net, _ = _network(network, K)
    total = library().mm_routing_flips(n, L, K, trainer.element_size(), *args, C, ctypes.byref(net), *outs)
    if total == -2:
        raise IndexError(f"{where}: expected token cells in [0, {C})")
    if total < 0:
        raise ValueError(f"the compiled routing loop takes top-k up to 64, got K={K}")
    return total


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data
