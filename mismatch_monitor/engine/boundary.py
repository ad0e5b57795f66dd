"""What crosses into ``_native.c``: the ctypes layouts of its structs, and a check of every array
against what the C loops assume.

The loops index raw pointers: an int32 array passed where int64 is read, a view with strides,
or an array one element short reads (or writes) past its end without a word. So every array
is checked here, by name, for dtype, length and layout, before its address is taken; a
mismatch is a programming error and raises, naming the array, what was expected and what came.
The structs carry ``ABI_VERSION`` (``MM_ABI_VERSION`` in C), so a library built from another
version of the file is never called with a layout it does not have.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

_P = ctypes.c_void_p
_I = ctypes.c_int64

# MM_ABI_VERSION of _native.c: the layout of the structs below and of the functions' arguments
ABI_VERSION = 4

# the rows of joint sums the compiled pass adds into, in the order of Out in _native.c (lr^2 and
# exp|lr| on each cell's first bin: the tables read them per cell only)
SUM_ROWS = ("lr", "lr2", "k3", "exp_abs", "rho2")
# the accumulators the pass adds into (token_pass.TokenAccumulators), in the order of Out
OUT_ARRAYS = ("joint_n",) + tuple(f"joint_{name}" for name in SUM_ROWS) + (
    "min_lr", "max_lr", "seq_sum_lr", "seq_sum_exp_abs", "seq_max_abs", "abs_hist", "n_nonfinite", "n_positive",
    "seq_invalid", "n_lr_zero", "p_sums", "max_abs_dp")
# log-prob dtypes the loop reads as they are, by the code it takes
LOGPROB_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}


class TokenParams(ctypes.Structure):
    _fields_ = [("n_turn", _I), ("turn_last", _I), ("NL", _I), ("R", _I), ("NB", _I),
                ("tol", ctypes.c_double), ("outlier_abs", ctypes.c_double), ("poly_max", ctypes.c_double),
                ("log_edges", _P), ("region_bounds", _P), ("slot_of_region", _P), ("upper", _P),
                ("lut", _P), ("lut_shift", _I), ("lut_base", _I), ("lut_size", _I),
                ("series", _P), ("n_series", _I), ("n_seq", _I), ("n_cells", _I)]


class Out(ctypes.Structure):
    _fields_ = [(name, _P) for name in OUT_ARRAYS]


class TokenPass(ctypes.Structure):
    """One call of ``mm_token_pass``; ``version`` is ABI_VERSION."""

    _fields_ = [("version", _I), ("params", ctypes.POINTER(TokenParams)), ("ranges", _P), ("n_ranges", _I),
                ("t", _P), ("s", _P), ("t_dtype", _I), ("s_dtype", _I), ("seq", _P), ("turn", _P),
                ("seq_cell", _P), ("turn_table", _P), ("out", Out)]


class Network(ctypes.Structure):
    _fields_ = [("pairs", _P), ("n_pairs", _I), ("partner", _P), ("lower", _P), ("n_layers", _I)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (any build of _native.c of this ABI_VERSION) with its functions' types set."""
    lib.mm_token_pass.restype = _I
    lib.mm_token_pass.argtypes = [ctypes.POINTER(TokenPass)]
    lib.mm_count_nonzero.restype = _I
    lib.mm_count_nonzero.argtypes = [_P, _I, _I]
    lib.mm_nonzero_rows.restype = _I
    lib.mm_nonzero_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P]
    lib.mm_routing_flips.restype = _I
    lib.mm_routing_flips.argtypes = [_I, _I, _I, _I, _P, _P, _P, _I, ctypes.POINTER(Network), _P, _P]
    return lib


def abi_version(lib: ctypes.CDLL) -> int:
    """The layout version a build answers (builds from before the version existed: 1)."""
    if not hasattr(lib, "mm_abi_version"):
        return 1
    lib.mm_abi_version.restype = _I
    lib.mm_abi_version.argtypes = []
    return int(lib.mm_abi_version())


def _describe(a: torch.Tensor | np.ndarray) -> str:
    if isinstance(a, np.ndarray):
        layout = "" if a.flags.c_contiguous else " non-contiguous"
        return f"numpy {a.dtype} shape {a.shape}{layout}"
    layout = "" if a.is_contiguous() else " non-contiguous"
    return f"{a.dtype} {a.device.type} tensor of shape {tuple(a.shape)}{layout}"


def checked(where: str, name: str, a: torch.Tensor | np.ndarray | None,
            dtypes: Sequence[torch.dtype | np.dtype], shape: tuple[int, ...], *, optional: bool = False) -> int | None:
    """The address of ``a`` once it is a C-contiguous CPU array of one of ``dtypes`` and exactly
    ``shape``; ``None`` for an optional array that is absent. Raises TypeError (not an array,
    wrong dtype or device) or ValueError (wrong shape, strided), naming ``where`` and ``name``."""
    want = " or ".join(str(d) for d in dtypes)
    expected = f"a contiguous CPU {want} array of shape {shape}"
    if a is None:
        if optional:
            return None
        raise TypeError(f"{where}: expected {name} as {expected}, got None")
    if isinstance(a, torch.Tensor):
        ok_type = a.dtype in dtypes and a.device.type == "cpu"
        ok_layout = tuple(a.shape) == shape and a.is_contiguous()
    elif isinstance(a, np.ndarray):
        ok_type = a.dtype in [np.dtype(d) for d in dtypes if not isinstance(d, torch.dtype)]
        ok_layout = a.shape == shape and a.flags.c_contiguous
    else:
        raise TypeError(f"{where}: expected {name} as {expected}, got {type(a).__name__}")
    if not ok_type:
        raise TypeError(f"{where}: expected {name} as {expected}, got {_describe(a)}")
    if not ok_layout:
        raise ValueError(f"{where}: expected {name} as {expected}, got {_describe(a)}")
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data
