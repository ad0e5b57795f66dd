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

from . import padded_native

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
    row of each token, in row-major order, follows from them: ``TokenBatch.seq_index``). A slot
    is a token where the mask is non-zero (``mask.to(torch.bool)``; NaN counts as non-zero).

    Where the compiled scan reads the mask (``padded_native``: CPU, integer or bool) it finds
    each row's count and first token in the mask's own dtype, and when every row is one run of
    slots (prompt padding, response, end padding) each tensor's runs are copied out by it; the
    bool mask is made only for a mask that is not (a select by numpy, or torch)."""

    def __init__(self, response_mask: torch.Tensor) -> None:
        self._raw = response_mask
        self._bool: torch.Tensor | None = None
        self._runs: list[tuple[int, int, int]] | None = None
        self._scan = padded_native.rows(response_mask)
        if self._scan is not None:
            counts, firsts, single = self._scan
            self.lengths = torch.from_numpy(counts)
            if not single:
                self._scan = None
            self._np = _as_numpy(self.mask) if self._scan is None else None
        else:
            self._np = _as_numpy(self.mask)
            if self._np is not None:
                lengths = np.count_nonzero(self._np, axis=1)
                self.lengths = torch.from_numpy(lengths.astype(np.int64))
                self._runs = _single_runs(self._np, lengths)
            else:
                self.lengths = self.mask.sum(1, dtype=torch.int64)
        self.offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    @property
    def mask(self) -> torch.Tensor:
        """``[B, T]`` bool: the response mask's token slots (cast once, when asked)."""
        if self._bool is None:
            # a cast is the same test as != 0 (NaN included) at half its time on an integer mask
            self._bool = self._raw.to(torch.bool)
        return self._bool

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """``t[mask]``: ``[B, T, ...]`` -> ``[N, ...]``, the same values in the same order."""
        if self._scan is not None:          # every row one run: one copy per row, compiled
            out = padded_native.gather(t, self._scan[0], self._scan[1], int(self.offsets[-1]))
            if out is not None:
                return out
            if self._runs is None:       # a tensor it does not read: numpy copies the same runs
                counts, firsts, _ = self._scan
                self._runs = [(b, f, f + n) for b, (f, n) in enumerate(zip(firsts.tolist(), counts.tolist())) if n]
        arr = _as_numpy(t) if self._np is not None or self._runs is not None else None
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
