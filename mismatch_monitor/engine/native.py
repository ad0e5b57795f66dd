"""The compiled token pass (``_native.c``), called through ctypes, and the choice of kernel.

The extension is built by ``pip install`` when a C compiler is there (``setup.py``); without
it the engine runs its torch implementation, which computes the same statistics (the tests run
both against one float64 reference). ``MetricConfig.kernel`` chooses: ``"auto"`` takes the
compiled loops for CPU tensors when they were built, ``"native"`` insists on them, ``"torch"``
never uses them. The loops only read the inputs and add into the caller's accumulators; ctypes
releases the GIL during a call, so Python threads run them in parallel.

Everything the loops compare against (bin edges, regions, bucket edges, the sorting network)
is computed here from the one definition in Python and passed in; every array is checked
against the layout the loops read (``boundary.py``). The routing loop's caller is
``native_routing.py``; the token order, ``ranges.py``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import MetricConfig
from .accumulators import PSUM_ROWS
from .boundary import ABI_VERSION, LOGPROB_DTYPES, OUT_ARRAYS, SUM_ROWS, Out, TokenParams, TokenPass
from .boundary import abi_version, bind, checked
from .histogram import LogBins

if TYPE_CHECKING:
    from .regions import JointCoder

_DTYPES = LOGPROB_DTYPES
# |lr| below this: k3 = rho - 1 - lr and exp|lr| from their Taylor series to x^10 / 10!
# (the first term left out is below 1e-18 relative); above it expm1 and exp
POLY_MAX = 1.0 / 16
SERIES = np.array([1.0 / math.factorial(n) for n in range(2, 11)])
# what the compiled pass saves, measured (benchmarks/README.md: 1M-32M tokens, one thread): the
# torch ops take about this many times its time on the same batch
TORCH_OPS_SLOWDOWN = 4


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded extension, "") or (None, why it cannot be used)."""
    spec = importlib.util.find_spec(f"{__package__}._native")
    if spec is None or not spec.origin:
        return None, "the compiled extension mismatch_monitor.engine._native was not built (reinstall with a C compiler)"
    lib = ctypes.CDLL(spec.origin)
    version = abi_version(lib)
    if version != ABI_VERSION:
        return None, (f"the compiled extension {spec.origin} has layout version {version}, this module passes "
                      f"version {ABI_VERSION} (reinstall to rebuild it)")
    return bind(lib), ""


def library() -> ctypes.CDLL | None:
    """The loaded extension, or None when it was not built (or built from another version)."""
    return _load()[0]


def available() -> bool:
    return library() is not None


MAX_TOKENS = (1 << 31) - 1   # the compiled pass counts histogram bins in 32 bits


def use_native(config: MetricConfig, device: torch.device, num_tokens: int = 0) -> bool:
    """Whether the engine takes the compiled loops for ``num_tokens`` tokens on ``device``;
    with ``kernel="native"``, why not is an error; with ``kernel="auto"`` on a CPU tensor, a
    warning (once per reason) that names the cost. Other devices take the torch ops by design."""
    if config.kernel == "torch":
        return False
    if device.type != "cpu":
        why: Exception = ValueError(f"runs on CPU tensors only, got {device}")
    elif num_tokens > MAX_TOKENS:
        why = ValueError(f"takes up to {MAX_TOKENS} tokens a batch, got {num_tokens}")
    elif bin_lookup(LogBins.from_config(config)) is None:
        why = ValueError(f"needs a histogram lookup of at most {LOOKUP_MAX} keys; hist_relative_accuracy="
                         f"{config.hist_relative_accuracy} over [hist_min, hist_max] needs more")
    elif library() is None:
        why = RuntimeError("is not available: " + (_load()[1] or "the compiled extension "
                           "mismatch_monitor.engine._native was not built (reinstall with a C compiler)"))
    else:
        return True
    if config.kernel == "native":
        raise type(why)(f"MetricConfig.kernel='native', but the compiled pass {why}")
    if device.type == "cpu":
        _warn_fallback(str(why))
    return False


@functools.lru_cache(maxsize=None)
def _warn_fallback(why: str) -> None:
    """One warning per reason and process: the engine silently running 4x slower is a cost the
    user should hear about once, not every step."""
    warnings.warn(f"mismatch-monitor: the metric engine runs its torch ops on CPU, about {TORCH_OPS_SLOWDOWN}x "
                  f"slower than its compiled per-token loops (benchmarks/README.md), because the compiled "
                  f"pass {why}. MetricConfig(kernel='torch') chooses the torch ops without this warning.",
                  RuntimeWarning, stacklevel=4)


def _ptr(t: torch.Tensor | np.ndarray | None) -> int | None:
    if t is None:
        return None
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


LOOKUP_MAX = 1 << 22        # keys of the histogram lookup (32 MiB); finer histograms take the torch ops


@functools.lru_cache(maxsize=16)
def bin_lookup(bins: LogBins) -> tuple[np.ndarray, np.ndarray, int, int] | None:
    """(upper edges, first bin per key, shift, base) for ``bins_of`` in _native.c: a key is the
    exponent and top mantissa bits of a positive double; the lookup gives the first bin its
    values can fall in, and the loop steps up once when |x| lies above that bin's upper edge.
    None when that takes more than LOOKUP_MAX keys (hist_relative_accuracy below ~1e-4 over
    the default [hist_min, hist_max]) or a key would span two edges."""
    bits = max(0, math.ceil(math.log2(1.0 / (bins.gamma - 1.0))) + 1)   # key narrower than a bin
    octaves = math.log2(bins.max_value / bins.min_value) + 3
    if bits > 52 or octaves * 2.0 ** bits > LOOKUP_MAX:
        return None
    upper = bins.upper_edges()
    shift = 52 - bits
    lo = int(np.array(upper[0]).view(np.int64)) >> shift
    hi = int(np.array(upper[-2]).view(np.int64)) >> shift
    if hi - lo + 1 > LOOKUP_MAX:
        return None
    keys = np.arange(lo, hi + 2, dtype=np.int64)
    first = (keys << shift).view(np.float64)                         # smallest value of each key
    lut = np.searchsorted(upper, first, side="left")
    if (lut[1:] - lut[:-1]).max(initial=0) > 1:                      # a key spanning two edges
        return None
    return upper, lut[:-1].astype(np.int64), shift, lo


@dataclass
class TokenKernel:
    """The compiled pass's parameters for one config and batch layout (arrays kept alive)."""

    params: TokenParams
    keep: tuple
    n_seq_cells: int            # sequence cells: token cells are n_seq_cells * params.n_turn

    @classmethod
    def build(cls, config: MetricConfig, coder: JointCoder, bins: LogBins, n_turn: int,
              turn_last: int, n_seq: int, n_seq_cells: int) -> "TokenKernel":
        upper, lut, shift, base = bin_lookup(bins)
        log_edges = np.array(coder.log_edges, dtype=np.float64)
        bounds = coder.region_bounds.cpu().numpy().astype(np.float64)
        slots = coder.slot_of_region.cpu().numpy().astype(np.int64)
        series = SERIES.copy()
        keep = (upper, lut, log_edges, bounds, slots, series)
        params = TokenParams(
            n_turn=n_turn, turn_last=turn_last, NL=len(log_edges) + 1, R=coder.R, NB=bins.num_bins,
            tol=config.positive_logprob_tol, outlier_abs=coder.outlier_abs, poly_max=POLY_MAX,
            log_edges=_ptr(log_edges), region_bounds=_ptr(bounds), slot_of_region=_ptr(slots),
            upper=_ptr(upper), lut=_ptr(lut), lut_shift=shift, lut_base=base, lut_size=len(lut),
            series=_ptr(series), n_series=len(series), n_seq=n_seq, n_cells=n_seq_cells * n_turn + 1)
        return cls(params, keep, n_seq_cells)

    def run(self, ranges: np.ndarray, t: torch.Tensor, s: torch.Tensor, seq: torch.Tensor | None,
            turn: torch.Tensor | None, seq_cell: torch.Tensor, turn_table: torch.Tensor | None, acc) -> int:
        """The tokens of ``ranges`` ([n, 3] int64 rows (start, stop, sequence), or sequence -1 for
        a range whose ids are read from ``seq``, which may be None when no range is; see
        :func:`sequence_ranges`) of the whole-batch
        tensors into the accumulators ``acc`` (token_pass.TokenAccumulators, ``abs_hist``
        int32 here). Every array is checked against the layout the loop reads (boundary.py)."""
        # float16 widened, strided views copied: the arrays passed are these, alive to the call's end
        t, s = _float(t), _float(s)
        seq = None if seq is None else seq.contiguous()
        if seq is None and len(ranges) and (ranges[:, 2] < 0).any():
            raise ValueError(f"{_WHERE}: a range without a sequence needs the per-token seq_index")
        turn = None if turn is None else turn.contiguous()
        N = t.numel()
        call = TokenPass(version=ABI_VERSION, params=ctypes.pointer(self.params))
        call.t, call.s, call.seq, call.turn = self._inputs(t, s, seq, turn, N)
        call.t_dtype, call.s_dtype = _DTYPES[t.dtype], _DTYPES[s.dtype]
        call.ranges, call.n_ranges = self._ranges(ranges, N), len(ranges)
        call.seq_cell, call.turn_table = self._tables(seq_cell, turn_table)
        call.out = self._out(acc)
        valid = library().mm_token_pass(ctypes.byref(call))
        if valid == -2:
            raise MemoryError("the compiled token pass could not allocate its per-cell buffers")
        if valid == -3:
            raise IndexError(f"expected seq_index in [0, {self.params.n_seq}) and turn_index >= 0 "
                             "(build batches with TokenBatch.from_flat / from_padded, which check them)")
        if valid == -4:
            raise RuntimeError(f"the compiled token pass has another layout than version {ABI_VERSION}; reinstall")
        if valid < 0:
            raise RuntimeError("the compiled token pass was built for another series length; reinstall")
        return valid

    @staticmethod
    def _inputs(t: torch.Tensor, s: torch.Tensor, seq: torch.Tensor | None, turn: torch.Tensor | None, N: int
                ) -> tuple[int, int, int, int | None]:
        """Addresses of the batch's [N] inputs."""
        floats = tuple(_DTYPES)
        return (checked(_WHERE, "trainer_logprobs", t, floats, (N,)),
                checked(_WHERE, "sampler_logprobs", s, floats, (N,)),
                checked(_WHERE, "seq_index", seq, (torch.int64,), (N,), optional=True),
                checked(_WHERE, "turn_index", turn, (torch.int64,), (N,), optional=True))

    def _ranges(self, ranges: np.ndarray, N: int) -> int:
        addr = checked(_WHERE, "ranges", ranges, (np.int64,), (len(ranges), 3))
        start, stop, seq = ranges[:, 0], ranges[:, 1], ranges[:, 2]
        if len(ranges) and not ((0 <= start) & (start <= stop) & (stop <= N) & (seq < self.params.n_seq)).all():
            raise IndexError(f"{_WHERE}: expected ranges with 0 <= start <= stop <= {N} and sequence < "
                             f"{self.params.n_seq}")
        return addr

    def _tables(self, seq_cell: torch.Tensor, turn_table: torch.Tensor | None) -> tuple[int, int | None]:
        """The per-sequence cells and the turn table: small, so their values are checked too
        (the loop indexes the accumulators with them)."""
        p = self.params
        cells = checked(_WHERE, "seq_cell", seq_cell, (torch.int64,), (p.n_seq,))
        if p.n_seq and not (0 <= int(seq_cell.min()) and int(seq_cell.max()) < self.n_seq_cells):
            raise IndexError(f"{_WHERE}: expected seq_cell in [0, {self.n_seq_cells})")
        table = checked(_WHERE, "turn_table", turn_table, (torch.int64,), (p.turn_last + 1,), optional=True)
        if turn_table is not None and not (0 <= int(turn_table.min()) and int(turn_table.max()) < p.n_turn):
            raise IndexError(f"{_WHERE}: expected turn_table in [0, {p.n_turn})")
        return cells, table

    def _out(self, acc) -> Out:
        """The accumulators' addresses, each checked for the length the loop adds into."""
        p = self.params
        C1, B1 = self.n_seq_cells * p.n_turn + 1, p.n_seq + 1        # + the dump cell / sequence
        J = C1 * p.NL * p.R
        f64, i64 = (torch.float64,), (torch.int64,)
        checked(_WHERE, "acc.joint_sums", acc.joint_sums, f64, (len(SUM_ROWS), J))
        assert p.n_cells == C1, (p.n_cells, C1)
        sums = acc.sum_rows()
        shapes = {"joint_n": (i64, J), "abs_hist": ((torch.int32,), C1 * p.NB), "min_lr": (f64, C1),
                  "max_lr": (f64, C1), "n_nonfinite": (i64, C1), "n_positive": (i64, C1), "n_lr_zero": (i64, C1),
                  "seq_invalid": (i64, B1),
                  "seq_sum_lr": (f64, B1), "seq_sum_exp_abs": (f64, B1), "seq_max_abs": (f64, B1)}
        shapes.update({f"joint_{name}": (f64, J) for name in SUM_ROWS})
        arrays = {name: getattr(acc, name) for name in OUT_ARRAYS if not name.startswith("joint_") or name == "joint_n"}
        arrays.update({f"joint_{name}": sums[name] for name in SUM_ROWS})
        shapes.update({"p_sums": (f64, (len(PSUM_ROWS), C1)), "max_abs_dp": (f64, C1)})
        return Out(**{name: checked(_WHERE, f"acc.{name}", arrays[name], shapes[name][0],
                                    shapes[name][1] if name == "p_sums" else (shapes[name][1],))
                      for name in OUT_ARRAYS})


_WHERE = "compiled token pass"


def _float(t: torch.Tensor) -> torch.Tensor:
    """float32, float64 and bfloat16 as they are (the loop reads them); float16 widens to
    float32 exactly; any other dtype is left for the boundary check to refuse."""
    t = t.contiguous()
    return t.to(torch.float32) if t.dtype == torch.float16 else t


def nonzero_rows(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero entries of a flat [rows * width] int32 or int64 array as (row, column,
    value) int64 arrays, in order: ``divmod(np.flatnonzero(values), width)`` and the values
    there; when the extension is built, a count and then one compiled pass over the values."""
    values = np.ascontiguousarray(values)
    kind = {np.dtype(np.int64): 8, np.dtype(np.int32): 4}.get(values.dtype)
    if kind is None or values.ndim != 1 or values.size < (1 << 16) or library() is None:
        idx = np.flatnonzero(values)
        row = idx // width
        return row, idx - row * width, values[idx].astype(np.int64)
    rows = values.size // width
    assert rows * width == values.size, (values.size, width)
    k = library().mm_count_nonzero(_ptr(values), values.size, kind)
    row, col, val = (np.empty(k + 1, dtype=np.int64) for _ in range(3))
    got = library().mm_nonzero_rows(_ptr(values), rows, width, kind, _ptr(row), _ptr(col), _ptr(val))
    assert got == k
    return row[:k], col[:k], val[:k]
