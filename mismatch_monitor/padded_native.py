"""The padded layout's compiled row scan and run copies (``_padded.c``), called through ctypes.

``batch_layout.PaddedRows`` takes them for CPU tensors when the extension was built and numpy
otherwise, with the same result bit for bit. They read the mask once in its own dtype (verl's
int64 mask is 64 MB at [2048, 4096]: casting it to bool first costs as much as this whole scan)
and copy each row's run of slots with one ``memcpy``. Each function returns None for input it
does not read (another device, a float mask, slots not contiguous within a row), and the
caller takes numpy then.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math

import numpy as np
import torch

# MM_PADDED_VERSION of _padded.c
VERSION = 2
_P, _I = ctypes.c_void_p, ctypes.c_int64
# masks read on their bits: a slot is a token when its value is non-zero (as .to(torch.bool))
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The extension ``mismatch_monitor._padded``, or None when it was not built (or built from
    another version of _padded.c)."""
    spec = importlib.util.find_spec(f"{__package__}._padded")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.mm_padded_version.restype = _I
    if lib.mm_padded_version() != VERSION:
        return None
    lib.mm_padded_rows.argtypes = [_P, _I, _I, _I, _I, _P, _P]
    lib.mm_padded_rows.restype = _I
    lib.mm_gather_runs.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I]
    lib.mm_gather_runs.restype = None
    return lib


def available() -> bool:
    return library() is not None


def _readable(t: torch.Tensor) -> bool:
    """A CPU tensor whose memory holds its values as they are, each row's slots contiguous."""
    if t.device.type != "cpu" or t.requires_grad or t.is_conj() or t.is_neg() or t.dim() < 2:
        return False
    row = t[0] if t.shape[0] else t.new_empty(t.shape[1:])
    return row.is_contiguous()


def rows(mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """Per row of the ``[B, T]`` mask its number of non-zero slots and its first one (0 when
    none), both ``[B]`` int64, and whether every row's slots are one run ``first .. first +
    count``. None where the extension is not built or the mask is not an integer or bool
    tensor in memory read as it is."""
    lib = library()
    if lib is None or mask.dtype not in _MASK_DTYPES or mask.dim() != 2 or not _readable(mask):
        return None
    B, T = mask.shape
    counts, firsts = np.empty(B, dtype=np.int64), np.empty(B, dtype=np.int64)
    single = lib.mm_padded_rows(mask.data_ptr(), mask.element_size(), B, T, mask.stride(0) if B else T,
                                counts.ctypes.data, firsts.ctypes.data)
    if single < 0:
        return None
    return counts, firsts, bool(single)


def gather(t: torch.Tensor, counts: np.ndarray, firsts: np.ndarray, n: int) -> torch.Tensor | None:
    """``t[mask]`` of a ``[B, T, ...]`` tensor, given its mask's ``rows`` where every row was one
    run (``n``: their total): the rows' runs one after the other, ``[n, ...]``. None where the
    extension is not built or ``t``'s memory is not read as it is (the caller selects then)."""
    lib = library()
    B = len(counts)
    if lib is None or t.dim() < 2 or t.shape[0] != B or not _readable(t):
        return None
    if B and int((firsts + counts).max()) > t.shape[1]:
        raise ValueError(f"padded rows: runs reach slot {int((firsts + counts).max())} of a tensor of "
                         f"{t.shape[1]} slots per row")
    out = torch.empty((n, *t.shape[2:]), dtype=t.dtype)
    slot = math.prod(t.shape[2:]) * t.element_size()
    lib.mm_gather_runs(t.data_ptr(), slot, B, t.stride(0) * t.element_size(), counts.ctypes.data,
                       firsts.ctypes.data, out.data_ptr(), n * slot)
    return out
