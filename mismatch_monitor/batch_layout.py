"""How the padded and offsets layouts become the flat one, cheaply.

verl and OpenRLHF hand over ``[B, T]`` tensors and a response mask, usually at millions of slots
per step, so this runs every step before the engine. Torch's boolean-mask select and
``nonzero`` are single-threaded and slow on the CPU (8M slots: ~0.1-0.2 s each, a
``bool.sum(1)`` as much), several times the engine's own pass. numpy's boolean select and
``count_nonzero`` do the same work in a fraction of that, so CPU tensors go through numpy views
of the same memory; the sequence of each token follows from the row lengths (``seq_offsets``), not from the
positions of the mask, and is built only when something asks for it. Tokens keep row-major order
either way, so every layout gives the same flat tensors, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

# numpy has no bfloat16: such a tensor is selected through an int16 view of its bytes
_VIEWS = {torch.bfloat16: torch.int16}


def repeat_ids(B: int, lengths: torch.Tensor, N: int) -> torch.Tensor:
    """[N] int64: sequence b repeated lengths[b] times (N = their sum). On the CPU numpy's
    ``repeat`` is ~2x faster than ``torch.repeat_interleave`` (8M tokens: 30 ms against 59); on
    a device the known N spares the wait for the output's size."""
    if lengths.device.type == "cpu":
        return torch.from_numpy(np.repeat(np.arange(B, dtype=np.int64), lengths.numpy()))
    return torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths, output_size=N)


def _as_numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's memory, or None where numpy cannot read it (another
    device, a dtype numpy lacks)."""
    if t.device.type != "cpu" or t.requires_grad or t.is_conj() or t.is_neg():
        return None
    try:
        return t.view(_VIEWS.get(t.dtype, t.dtype)).numpy()
    except (TypeError, RuntimeError):
        return None


class PaddedRows:
    """The rows of a ``[B, T]`` response mask: which slots are tokens, and where each row starts.

    ``lengths`` ``[B]`` int64 tokens per row, ``offsets`` ``[B + 1]`` their cumulative sum (the
    row of each token, in row-major order, follows from them: ``TokenBatch.seq_index``)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask                                  # [B, T] bool
        self._np = _as_numpy(mask)
        B = mask.shape[0]
        self._runs: list[tuple[int, int, int]] | None = None
        if self._np is not None:
            lengths = np.count_nonzero(self._np, axis=1)
            self.lengths = torch.from_numpy(lengths.astype(np.int64))
            self._runs = _single_runs(self._np, lengths)
        else:
            self.lengths = mask.sum(1, dtype=torch.int64)
        self.offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """``t[mask]``: ``[B, T, ...]`` -> ``[N, ...]``, the same values in the same order."""
        arr = _as_numpy(t) if self._np is not None else None
        if arr is None:
            return t[self.mask]
        if self._runs is not None:       # each row one run of slots: copy the runs, no mask read
            out = torch.from_numpy(_concat([arr[b, f:e] for b, f, e in self._runs], arr))
        else:
            out = torch.from_numpy(np.ascontiguousarray(arr[self._np]))
        return out.view(t.dtype) if t.dtype in _VIEWS else out


def _single_runs(mask: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(row, first slot, end) of each row when every non-empty row's tokens are one run of
    consecutive slots (a response mask usually is: prompt padding, response, end padding), else
    None. A row's run starts at its first token (``argmax`` of a bool row stops there) and holds
    ``lengths[b]`` slots, every one a token; with ``lengths[b]`` tokens in the row, those are all.
    (Finding each row's last token instead, from a reversed ``argmax``, is slower: numpy scans a
    reversed row to its end.)"""
    first = mask.argmax(1)
    runs = [(b, f, f + n) for b, (f, n) in enumerate(zip(first.tolist(), lengths.tolist())) if n]
    if not runs or not _concat([mask[b, f:e] for b, f, e in runs], mask).all():
        return None
    return runs


def _concat(parts: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    """The rows of ``parts`` one after the other (an empty [0, ...] array of ``like``'s dtype when none)."""
    return np.concatenate(parts) if parts else np.empty((0,) + like.shape[2:], dtype=like.dtype)
