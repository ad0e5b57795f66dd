"""The exporter's view of one step: statistics merged to (pool, hardware) cells of label texts,
with at most ``LabelLimit.max_values`` values of each label; pure array work, no Prometheus.

Which values keep their own series is decided by :class:`Admission`: the first time a value
is seen while fewer than the limit have been admitted, it is admitted for good (the values of
a step with the most tokens first). Every other value is merged into ``%other``. Admission is
sticky so that each exported counter only ever grows (a series that moved in and out of
``%other`` would read as counter resets); the number of series stays bounded by the limit.
Merging follows each field's rule (``engine/fields.py``), so ``%other`` and the fleet are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .config import MetricConfig
from .engine import MismatchStats
from .engine.fields import merge_rules
from .engine.stats import merge_column
from .label_limits import texts_of
from .metrics import GroupMetrics, report_by_label
from .report_keys import OTHER_TEXT, label_text

DIMS = ("pool", "hardware")
TABLES = ("tokens", "sequences", "abs_hist")
Cell = tuple[str, str]   # (pool label text, hardware label text)


@dataclass
class Admission:
    """Label texts that have their own series, per dimension (see the module docstring)."""

    limit: int
    admitted: dict[str, set[str]] = field(default_factory=lambda: {d: set() for d in DIMS})

    def capped(self, dim: str, texts: list[str], tokens: np.ndarray) -> list[str]:
        """Each text, or ``%other`` where it is not (and can no longer be) admitted."""
        chosen = self.admitted[dim]
        for i in sorted(range(len(texts)), key=lambda i: (-tokens[i], texts[i])):
            if len(chosen) >= self.limit:
                break
            chosen.add(texts[i])
        return [t if t in chosen else OTHER_TEXT for t in texts]

    def text(self, dim: str, text: str) -> str:
        return self.capped(dim, [text], np.zeros(1))[0]


@dataclass(frozen=True)
class Cells:
    """``keys`` [C]; ``tokens``/``sequences``: merged columns [C] (``seq_present`` [C]: the cell
    has sequence rows); ``hist_cell``/``hist_bin``/``hist_count`` [H]: merged histogram rows;
    ``merged``: per dimension, how many of this step's values went into ``%other``."""

    keys: list[Cell]
    tokens: dict[str, np.ndarray]
    sequences: dict[str, np.ndarray]
    seq_present: np.ndarray
    hist_cell: np.ndarray
    hist_bin: np.ndarray
    hist_count: np.ndarray
    merged: dict[str, int]


def _row_texts(df: pd.DataFrame, dim: str) -> tuple[np.ndarray, list[str]]:
    return texts_of(df[dim]) if dim in df else (np.zeros(len(df), dtype=np.int64), [label_text(None)])


def cells_of(stats: MismatchStats, admission: Admission) -> Cells:
    """Merge the exporter's tables of ``stats`` to capped (pool, hardware) cells."""
    coded = {t: {d: _row_texts(stats.tables[t], d) for d in DIMS} for t in TABLES}
    tok = stats.tables["tokens"]
    mapping: dict[str, dict[str, str]] = {}
    merged: dict[str, int] = {}
    for dim in DIMS:
        codes, texts = coded["tokens"][dim]
        tokens = dict(zip(texts, np.bincount(codes, weights=tok["n_tokens"].to_numpy(np.float64),
                                             minlength=len(texts))))
        every = sorted({t for table in TABLES for t in coded[table][dim][1]})
        capped = admission.capped(dim, every, np.array([tokens.get(t, 0.0) for t in every]))
        mapping[dim] = dict(zip(every, capped))
        merged[dim] = sum(c == OTHER_TEXT for c in capped)
    index: dict[Cell, int] = {}
    cell_codes = {}
    for table in TABLES:
        (pc, pt), (hc, ht) = coded[table]["pool"], coded[table]["hardware"]
        pair, inverse = np.unique(pc * len(ht) + hc, return_inverse=True)   # distinct (pool, hw) rows
        ids = [index.setdefault((mapping["pool"][pt[p // len(ht)]], mapping["hardware"][ht[p % len(ht)]]),
                                len(index)) for p in pair.tolist()]
        cell_codes[table] = np.asarray(ids, dtype=np.int64)[inverse.reshape(-1)]
    C = len(index)
    merged_tokens = _merged(tok, "tokens", cell_codes["tokens"], C)
    seq = stats.tables["sequences"]
    merged_seq = _merged(seq, "sequences", cell_codes["sequences"], C)
    present = np.bincount(cell_codes["sequences"], minlength=C) > 0
    hist = stats.tables["abs_hist"]
    bins = hist["bin"].to_numpy(np.int64)
    span = int(bins.max()) + 1 if len(bins) else 1
    rows, inverse = np.unique(cell_codes["abs_hist"] * span + bins, return_inverse=True)
    counts = merge_column(hist["count"].to_numpy(), "sum", inverse.reshape(-1), len(rows))
    return Cells(list(index), merged_tokens, merged_seq, present, rows // span, rows % span, counts, merged)


def _merged(df: pd.DataFrame, table: str, codes: np.ndarray, C: int) -> dict[str, np.ndarray]:
    return {col: merge_column(df[col].to_numpy(), rule, codes, C) for col, rule in merge_rules(table).items()}


def slice_metrics(cells: Cells, config: MetricConfig) -> tuple[list[dict[str, str]], GroupMetrics]:
    """Metrics of every pool, every hardware and the fleet, in one ``report_by_label``: each
    cell is stacked under its three slice names and merged by the fields' own rules."""
    C = len(cells.keys)
    names = ["fleet"] + [f"pool\0{p}" for p, _ in cells.keys] + [f"hardware\0{h}" for _, h in cells.keys]
    slice_of = np.array(names[1:], dtype=object)   # [2C]: the pool slice, then the hardware slice, of each cell
    level = lambda codes: np.concatenate([np.full(len(codes), "fleet", dtype=object),  # noqa: E731
                                          slice_of[codes], slice_of[C + codes]])
    cell = np.arange(C)
    tables = {
        "tokens": pd.DataFrame({"slice": level(cell), **{k: np.tile(v, 3) for k, v in cells.tokens.items()}}),
        "sequences": pd.DataFrame({"slice": level(cell[cells.seq_present]),
                                   **{k: np.tile(v[cells.seq_present], 3) for k, v in cells.sequences.items()}}),
        "abs_hist": pd.DataFrame({"slice": level(cells.hist_cell), "bin": np.tile(cells.hist_bin, 3),
                                  "count": np.tile(cells.hist_count, 3)}),
    }
    by, _ = report_by_label(MismatchStats(tables, ("slice",)), "slice", config)
    labels = []
    for name in by.labels:
        dim, _, text = str(name).partition("\0")
        labels.append({dim: text} if text else {})
    return labels, by
