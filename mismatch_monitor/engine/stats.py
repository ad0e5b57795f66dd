"""The engine's output: small per-cell tables of sufficient statistics, and their merge.

``merge(stats(A), stats(B)) == stats(A | B)``: every value column merges by the rule declared in
``fields.py`` (sum, max or min), grouped by the table's key columns. That one law is what lets
ranks, steps and slices combine exactly, in pandas here and in SQL in the query layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..batch import STANDARD_DIMENSIONS
from ..config import MetricConfig, StatsParameters, parameter_differences
from .fields import LENGTH_KEY, TABLES, TOKEN_CELL_TABLES, TURN_KEY, merge_rules
from .groupby import columns_of, group, merge_columns


def key_columns(table: str, dims: Sequence[str]) -> list[str]:
    """Key columns of a table: label dimensions, length bucket, turn bucket (token cells), extras."""
    keys = list(dims) + [LENGTH_KEY]
    if table in TOKEN_CELL_TABLES:
        keys.append(TURN_KEY)
    return keys + list(TABLES[table][0])


@dataclass(frozen=True)
class MismatchStats:
    """One table per entry of ``fields.TABLES``; every table has the key columns of
    :func:`key_columns` followed by its value fields. Only non-empty cells are present.

    ``params``: the config parameters the tables mean something under
    (``MetricConfig.stats_parameters()``: histogram accuracy and range, bands, caps, bucket
    edges, thresholds), set by the engine; merging or reading statistics under other parameters
    is refused (:func:`merge`, ``metrics.report``). None: not recorded (tables built by hand or
    read back from a store, whose run records the config).
    """

    tables: dict[str, pd.DataFrame]
    dims: tuple[str, ...] = field(default=STANDARD_DIMENSIONS)
    params: StatsParameters | None = field(default=None, compare=False)

    def __getitem__(self, table: str) -> pd.DataFrame:
        return self.tables[table]

    def column(self, table: str, name: str) -> np.ndarray:
        """One value column as a numpy array (without building a Series: see ``columns_of``)."""
        return np.asarray(columns_of(self.tables[table], [name])[name])

    def check_parameters(self, config: MetricConfig, reader: str) -> None:
        """Raise unless ``config`` has the parameters these statistics were computed under (or
        they record none): ``reader`` would read their bins, bands and buckets as other numbers."""
        differences = [] if self.params is None else parameter_differences(self.params, config.stats_parameters())
        if differences:
            raise ValueError(f"{reader}: the statistics were computed under other MetricConfig parameters than "
                             f"the config given (computed vs given: {'; '.join(differences)}); pass the config "
                             f"they were computed with")

    @property
    def is_empty(self) -> bool:
        t = self.tables["tokens"]
        return len(t) == 0 or int(t["n_tokens"].sum()) == 0

    @classmethod
    def empty(cls, dims: Sequence[str] = STANDARD_DIMENSIONS, params: StatsParameters | None = None
              ) -> "MismatchStats":
        return cls({name: empty_table(name, dims) for name in TABLES}, tuple(dims), params)

    def marginal(self, by: Sequence[str]) -> "MismatchStats":
        """Merge cells down to the columns in ``by`` (a subset of the cell keys); others vanish."""
        return MismatchStats({name: _group(df, name, list(by)) for name, df in self.tables.items()},
                             tuple(d for d in self.dims if d in by), self.params)


def table_schema(table: str, dims: Sequence[str]) -> dict[str, str]:
    """Column -> pandas dtype of a table, in column order: label dimensions are strings (null
    when a batch does not give them), the turn bucket a nullable integer."""
    schema: dict[str, str] = {}
    for key in key_columns(table, dims):
        if key in dims or key == "kind":
            schema[key] = "string"
        else:
            schema[key] = "Int64" if key == TURN_KEY else "int64"
    schema.update({f.name: f.dtype for f in TABLES[table][1]})
    return schema


def empty_table(table: str, dims: Sequence[str]) -> pd.DataFrame:
    return _empty_template(table, tuple(dims)).copy()


@functools.lru_cache(maxsize=256)
def _empty_template(table: str, dims: tuple[str, ...]) -> pd.DataFrame:
    # building typed empty columns costs milliseconds; the engine asks for them every step
    return pd.DataFrame({c: pd.Series([], dtype=dt) for c, dt in table_schema(table, dims).items()})


def _group(df: pd.DataFrame, table: str, by: list[str]) -> pd.DataFrame:
    rules = merge_rules(table)
    keys = [k for k in df.columns if k not in rules]
    group_keys = [k for k in keys if k in by or k in TABLES[table][0]]
    if not group_keys and len(df) == 0:
        return df[list(rules)].iloc[0:0].reset_index(drop=True)     # a grand total of nothing: no row
    return aggregate(df, group_keys, rules)


def aggregate(df: pd.DataFrame, keys: list[str], rules: dict[str, str]) -> pd.DataFrame:
    """Group by ``keys`` (nulls are a group, groups in key order) and merge every value column
    by its rule (``groupby``: numpy on factorised keys; pandas' groupby costs milliseconds per
    call on string keys, and the collector merges every step)."""
    cols = columns_of(df, keys + list(rules))
    groups = group([cols], keys)
    # build every column first and the frame once: setting columns one by one costs more
    return pd.DataFrame(groups.values | merge_columns(cols, rules, groups.codes[0], groups.size))


def merge(parts: Iterable[MismatchStats]) -> MismatchStats:
    """Merge several stats (ranks, steps, splits of a batch) into one, exactly."""
    parts = list(parts)
    if not parts:
        return MismatchStats.empty()
    params = common_parameters(parts)
    dims: list[str] = []
    for p in parts:
        dims += [d for d in p.dims if d not in dims]
    tables = {}
    for name in TABLES:
        frames = [_with_dims(p.tables[name], name, dims) for p in parts]
        frames = [f for f in frames if len(f)]
        if not frames:
            tables[name] = empty_table(name, dims)
            continue
        df = pd.concat(frames, ignore_index=True)
        tables[name] = aggregate(df, key_columns(name, dims), merge_rules(name)).astype(
            table_schema(name, dims))
    return MismatchStats(tables, tuple(dims), params)


def common_parameters(parts: Sequence[MismatchStats]) -> StatsParameters | None:
    """The parameters every part that records them shares (None when none does); parts computed
    under different ones do not merge: a sum of histogram bins of two accuracies, or of counts
    outside two bands, is no statistic at all."""
    known = [p.params for p in parts if p.params is not None]
    for other in known[1:]:
        if other != known[0]:
            raise ValueError("cannot merge statistics computed under different MetricConfig parameters ("
                             + "; ".join(parameter_differences(known[0], other)) + ")")
    return known[0] if known else None


def _with_dims(df: pd.DataFrame, table: str, dims: list[str]) -> pd.DataFrame:
    missing = [d for d in dims if d not in df.columns]
    if missing:
        df = df.assign(**{d: pd.array([pd.NA] * len(df), dtype="string") for d in missing})
    return df[list(table_schema(table, dims))]
