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
from .engine.groupby import columns_of, group, merge_columns
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
    # every table's rows coded by their capped texts' positions in one sorted list per dimension
    texts = {d: sorted(set(mapping[d].values())) for d in DIMS}
    position = {d: {t: i for i, t in enumerate(texts[d])} for d in DIMS}
    parts = [{d: np.array([position[d][mapping[d][t]] for t in coded[table][d][1]], dtype=np.int64)[coded[table][d][0]]
              for d in DIMS} for table in TABLES]
    cells = group(parts, DIMS)
    C = cells.size
    tok_codes, seq_codes, hist_codes = cells.codes
    merged_tokens = merge_columns(columns_of(tok, list(merge_rules("tokens"))), merge_rules("tokens"), tok_codes, C)
    seq = stats.tables["sequences"]
    merged_seq = merge_columns(columns_of(seq, list(merge_rules("sequences"))), merge_rules("sequences"), seq_codes, C)
    present = np.bincount(seq_codes, minlength=C) > 0
    hist = stats.tables["abs_hist"]
    rows = group([{"cell": hist_codes, "bin": hist["bin"].to_numpy(np.int64)}], ["cell", "bin"])
    counts = merge_columns({"count": hist["count"].to_numpy()}, {"count": "sum"}, rows.codes[0], rows.size)["count"]
    keys = [(texts["pool"][p], texts["hardware"][h])
            for p, h in zip(np.asarray(cells.values["pool"]).tolist(), np.asarray(cells.values["hardware"]).tolist())]
    return Cells(keys, merged_tokens, merged_seq, present, np.asarray(rows.values["cell"]),
                 np.asarray(rows.values["bin"]), counts, merged)


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
