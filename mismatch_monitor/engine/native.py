"""The compiled token pass and routing loops (``_native.c``), called through ctypes.

The extension is built by ``pip install`` when a C compiler is there (``setup.py``); without
it the engine runs its torch implementation, which computes the same statistics (the tests run
both against one float64 reference). ``MetricConfig.kernel`` chooses: ``"auto"`` takes the
compiled loops for CPU tensors when they were built, ``"native"`` insists on them, ``"torch"``
never uses them. The loops only read the inputs and add into the caller's accumulators; ctypes
releases the GIL during a call, so Python threads run them in parallel.

Everything the loops compare against (bin edges, regions, bucket edges, the sorting network)
is computed here from the one definition in Python and passed in.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import MetricConfig
from .histogram import LogBins

if TYPE_CHECKING:
    from .regions import JointCoder

# the rows of joint sums the compiled pass adds into, in the order mm_token_pass takes them
# (lr^2 and exp|lr| on each cell's first bin: the tables read them per cell only)
SUM_ROWS = ("lr", "lr2", "k3", "exp_abs", "rho2")
_P = ctypes.c_void_p
_I = ctypes.c_int64
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}   # read as they are
# |lr| below this: k3 = rho - 1 - lr and exp|lr| from their Taylor series to x^10 / 10!
# (the first term left out is below 1e-18 relative); above it expm1 and exp
POLY_MAX = 1.0 / 16
SERIES = np.array([1.0 / math.factorial(n) for n in range(2, 11)])


class TokenParams(ctypes.Structure):
    _fields_ = [("n_turn", _I), ("turn_last", _I), ("NL", _I), ("R", _I), ("NB", _I),
                ("tol", ctypes.c_double), ("outlier_abs", ctypes.c_double), ("poly_max", ctypes.c_double),
                ("log_edges", _P), ("region_bounds", _P), ("slot_of_region", _P), ("upper", _P),
                ("lut", _P), ("lut_shift", _I), ("lut_base", _I), ("lut_size", _I),
                ("series", _P), ("n_series", _I), ("n_seq", _I)]


class Network(ctypes.Structure):
    _fields_ = [("pairs", _P), ("n_pairs", _I), ("partner", _P), ("lower", _P), ("n_layers", _I)]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded extension, or None when it was not built."""
    spec = importlib.util.find_spec(f"{__package__}._native")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.mm_token_pass.restype = _I
    lib.mm_token_pass.argtypes = [ctypes.POINTER(TokenParams), _P, _I, _P, ctypes.c_int, _P, ctypes.c_int,
                                  _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]
    lib.mm_count_nonzero.restype = _I
    lib.mm_count_nonzero.argtypes = [_P, _I, _I]
    lib.mm_nonzero_rows.restype = _I
    lib.mm_nonzero_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P]
    lib.mm_routing_flips.restype = _I
    lib.mm_routing_flips.argtypes = [_I, _I, _I, _I, _P, _P, _P, ctypes.POINTER(Network), _P, _P]
    return lib


def available() -> bool:
    return library() is not None


MAX_TOKENS = (1 << 31) - 1   # the compiled pass counts histogram bins in 32 bits


def use_native(config: MetricConfig, device: torch.device, num_tokens: int = 0) -> bool:
    """Whether the engine takes the compiled loops for ``num_tokens`` tokens on ``device``;
    with ``kernel="native"``, why not is an error."""
    if config.kernel == "torch":
        return False
    if device.type != "cpu":
        why: Exception | None = ValueError(f"MetricConfig.kernel='native' runs on CPU tensors only, got {device}")
    elif num_tokens > MAX_TOKENS:
        why = ValueError(f"MetricConfig.kernel='native' takes up to {MAX_TOKENS} tokens a batch, got {num_tokens}")
    elif bin_lookup(LogBins.from_config(config)) is None:
        why = ValueError(f"MetricConfig.kernel='native' needs a histogram lookup of at most {LOOKUP_MAX} "
                         f"keys; hist_relative_accuracy={config.hist_relative_accuracy} over [hist_min, "
                         f"hist_max] needs more")
    elif library() is None:
        why = RuntimeError("MetricConfig.kernel='native' but the compiled extension mismatch_monitor.engine._native "
                           "was not built (reinstall with a C compiler)")
    else:
        return True
    if config.kernel == "native":
        raise why
    return False


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

    @classmethod
    def build(cls, config: MetricConfig, coder: JointCoder, bins: LogBins, n_turn: int,
              turn_last: int, n_seq: int) -> "TokenKernel":
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
            series=_ptr(series), n_series=len(series), n_seq=n_seq)
        return cls(params, keep)

    def run(self, ranges: np.ndarray, t: torch.Tensor, s: torch.Tensor, seq: torch.Tensor,
            turn: torch.Tensor | None, seq_cell: torch.Tensor, turn_table: torch.Tensor | None, acc) -> int:
        """The tokens of ``ranges`` ([n, 3] int64 rows (start, stop, sequence), or sequence -1 for
        a range whose ids are read from ``seq``; see :func:`sequence_ranges`) of the whole-batch
        tensors into the accumulators ``acc`` (token_pass.TokenAccumulators, ``abs_hist``
        int32 here)."""
        t, s = _float(t), _float(s)
        seq, seq_cell = seq.contiguous(), seq_cell.contiguous()
        turn = None if turn is None else turn.contiguous()
        ranges = np.ascontiguousarray(ranges, dtype=np.int64)
        sums = acc.sum_rows()
        rows = (_P * len(SUM_ROWS))(*[_ptr(sums[name]) for name in SUM_ROWS])
        valid = library().mm_token_pass(
            ctypes.byref(self.params), _ptr(ranges), len(ranges), _ptr(t), _DTYPES[t.dtype], _ptr(s),
            _DTYPES[s.dtype], _ptr(seq), _ptr(turn), _ptr(seq_cell), _ptr(turn_table), _ptr(acc.joint_n), rows,
            _ptr(acc.abs_hist),
            _ptr(acc.min_lr), _ptr(acc.max_lr), _ptr(acc.n_nonfinite), _ptr(acc.n_positive),
            _ptr(acc.seq_invalid), _ptr(acc.seq_sum_lr), _ptr(acc.seq_sum_exp_abs), _ptr(acc.seq_max_abs))
        if valid == -2:
            raise MemoryError("the compiled token pass could not allocate its per-cell buffers")
        if valid == -3:
            raise IndexError(f"expected seq_index in [0, {self.params.n_seq}) and turn_index >= 0 "
                             "(build batches with TokenBatch.from_flat / from_padded, which check them)")
        if valid < 0:
            raise RuntimeError("the compiled token pass was built for another series length; reinstall")
        return valid


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


def _float(t: torch.Tensor) -> torch.Tensor:
    """float32, float64 and bfloat16 as they are (the loop reads them); float16 widens to
    float32 exactly."""
    t = t.contiguous()
    return t if t.dtype in _DTYPES else t.to(torch.float32)


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
    return Network(_ptr(pairs), len(network), _ptr(partner), _ptr(lower), len(partner)), (pairs, partner, lower)


def routing_flips(trainer: torch.Tensor, sampler: torch.Tensor, cell: torch.Tensor,
                  network: tuple[tuple[int, int], ...], per_layer: torch.Tensor, any_flip: torch.Tensor) -> int:
    """Flips of [n, L, K] integer ids into ``per_layer`` [C * L] and ``any_flip`` [C] (int64);
    ``network`` sorts K inputs (routing.sorting_network)."""
    n, L, K = trainer.shape
    trainer, sampler, cell = trainer.contiguous(), sampler.contiguous(), cell.contiguous()
    net, _ = _network(network, K)
    total = library().mm_routing_flips(n, L, K, trainer.element_size(), _ptr(trainer), _ptr(sampler),
                                       _ptr(cell), ctypes.byref(net), _ptr(per_layer), _ptr(any_flip))
    if total < 0:
        raise ValueError(f"the compiled routing loop takes top-k up to 64, got K={K}")
    return total


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
