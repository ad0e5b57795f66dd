"""Step bins: a bin of ``width`` consecutive steps merges their sufficient statistics exactly
(sum/max/min/logsumexp, ``fields.merge_sql``), so a binned value is the value of the merged
steps, never a mean of per-step values. Whole blocks of steps are read from the store's rollups
where that is exact (``rollup.plan``), the rest from cells. Identifiers are checked and every
value is bound.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import duckdb
import pandas as pd
import pyarrow as pa

from ..engine.fields import TABLES, merge_rules
from ..store.schema import STEPS_TABLE, file_id_of
from . import rollup
from .core import StepRange, _check_keys, _columns, _label_filter, _merged_columns, _step_filter, table_files
from .files import RunDir, _memo, _retry, current_files, current_index, file_columns, raw_index


def step_width(first: int, last: int, max_points: int) -> int:
    """Steps per bin so that [first, last] fits in at most ``max_points`` bins (>= 1)."""
    if max_points < 1:
        raise ValueError(f"expected max_points >= 1, got {max_points}")
    span = max(0, int(last) - int(first) + 1)
    return max(1, -(-span // max_points))


def _current_sources(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str,
                     steps: tuple[int, int | None] | None = None) -> tuple[list[str], list[str], bool]:
    """(data files, index files, exact) for reading the current rows of ``table`` [in ``steps``].

    Only the data files that hold a current step (in ``steps``) are returned: the index names
    each step's file (a file's name carries its file_id). ``exact``: no step is listed twice in
    the index (no re-logged step, no compaction in progress), so the current rows are exactly the
    rows of those files and the per-row join with the index can be skipped; otherwise the caller
    joins.
    """
    listed = current_files(run_dir, table)             # index first: see current_files
    files, step_files = listed["files"], listed["steps"]
    if not files or not step_files:
        return files, step_files, False
    named = {f: file_id_of(f) for f in files}
    if any(i is None for i in named.values()):
        return files, step_files, False
    current = current_index(con, step_files)
    c_step, c_fid = current["step"].to_numpy(), current["file_id"].to_numpy()
    if steps is not None:
        keep = c_step >= steps[0] if steps[1] is None else (c_step >= steps[0]) & (c_step <= steps[1])
        c_fid = c_fid[keep]
    ids = set(c_fid.tolist())
    exact = len(raw_index(con, step_files)) == len(current)     # no step listed twice
    return [f for f in files if named[f] in ids], step_files, exact


def _categorical_keys(table: pa.Table) -> pd.DataFrame:
    """A frame whose string columns are categorical: a histogram repeats each label hundreds of
    times, and building one Python string per row would cost more than the query."""
    for i, f in enumerate(table.schema):
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            table = table.set_column(i, f.name, table.column(i).dictionary_encode())
        elif pa.types.is_decimal(f.type):     # DuckDB sums integers as HUGEINT; .df() gives float64
            table = table.set_column(i, f.name, table.column(i).cast(pa.float64()))
    return table.to_pandas()


def _raw_columns(rules: Mapping[str, str], available: set[str]) -> list[str]:
    """Each value column as it is (NULL for a column no file has yet)."""
    return [f't."{col}"' if col in available else f'NULL AS "{col}"' for col in rules]


def _rollup_plan(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, dims: Sequence[str], first: int,
                 width: int, steps: StepRange, step_files: list[str]) -> tuple[rollup.Plan, list[str], set[str]] | None:
    """The rollups a binned read can use (``rollup.plan``), their files and columns; None if none."""
    rfiles = table_files(run_dir, rollup.rollup_name(table))        # listed after the index
    rolled = {i for i in map(file_id_of, rfiles) if i is not None}
    if not rolled or rollup.choose(table, dims) is None:
        return None
    lo, hi = steps if steps is not None else (None, None)
    blocks = _memo("blocks", step_files,
                   lambda: rollup.blocks_of(raw_index(con, step_files), current_index(con, step_files)))
    plan = rollup.plan(blocks, rolled, table, dims, first=first, width=width, lo=lo, hi=hi)
    if plan is None:
        return None
    return plan, rfiles, set(file_columns(con, rfiles))


def aggregate_binned(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, by: Sequence[str] = (),
                     *, first: int, width: int, steps: StepRange = None,
                     where: Mapping[str, str] | None = None, times: bool = True) -> pd.DataFrame:
    """Like :func:`aggregate` per step, with steps merged into bins of ``width`` starting at ``first``.

    Columns: step (first step of the bin), step_last (last visible step in it), wall_time (of
    step_last), *by, the table's extra keys, the merged fields. ``width=1`` is per step.
    ``times=False`` leaves out step_last and wall_time.

    Whole blocks of steps are read from the store's rollups where that is exact
    (``rollup.plan``), the rest from cells; both give the same merged values.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    if int(width) < 1:
        raise ValueError(f"expected width >= 1, got {width}")
    by = list(by)
    extra = list(TABLES[table][0])
    rules = merge_rules(table)
    out_cols = ["step"] + (["step_last", "wall_time"] if times else []) + by + extra + list(rules)
    files = table_files(run_dir, table)
    if not files or not table_files(run_dir, STEPS_TABLE):
        return pd.DataFrame({c: [] for c in out_cols})
    available = _columns(con, run_dir, table)
    _check_keys(by + list((where or {}).keys()), available, table)
    params: dict[str, Any] = {"first": int(first), "width": int(width)}
    clauses = ["t.step >= $first"] + _step_filter(steps, params) + _label_filter(where, params)
    keys = [f'"{c}"' for c in by + extra]
    bin_and_keys = ["$first + (t.s - $first) // $width * $width AS step"] + [f"t.{k}" for k in keys]
    aggs = _merged_columns(rules, set(rules))          # every column is in src (NULL where absent)
    order = ["step"] + keys

    def cells(exact: bool, only: str = "") -> str:
        """Rows of the cell files $files (current rows only: joined with the index unless exact)."""
        source = "read_parquet($files, union_by_name=true) t" + (
            "" if exact else " SEMI JOIN idx USING (step, file_id)")
        select = ["t.step AS s", "t.step AS step_last"] + [f"t.{k}" for k in keys] + _raw_columns(rules, available)
        return f"SELECT {', '.join(select)} FROM {source}{only} WHERE {' AND '.join(clauses)}"

    def run() -> pd.DataFrame:
        lo = int(first) if steps is None or steps[0] is None else max(int(first), int(steps[0]))
        files, step_files, exact = _current_sources(con, run_dir, table, (lo, None if steps is None else steps[1]))
        p = dict(params)
        ctes = {"idx": "SELECT * FROM idx_now"}
        use = _rollup_plan(con, run_dir, table, by + list((where or {}).keys()), first, width, steps, step_files)
        if use is None:                       # every row from cells
            if not files:
                return pd.DataFrame({c: [] for c in out_cols})
            ctes["src"] = cells(exact)
            p["files"] = files
        else:                                 # whole blocks from rollups, the other steps from cells
            plan, rfiles, r_available = use
            ctes["ok"] = "SELECT unnest($ok_f) AS file_id, unnest($ok_b) AS block"
            select = ["t.block AS s", "t.step_last"] + [f"t.{k}" for k in keys] + _raw_columns(rules, r_available)
            ctes["src"] = (f"SELECT {', '.join(select)} FROM read_parquet($rfiles, union_by_name=true) t "
                           "SEMI JOIN ok USING (file_id, block) WHERE "
                           + " AND ".join(["t.grouping = $grouping"] + _label_filter(where, p)))
            p.update(rfiles=rfiles, grouping=plan.grouping, ok_f=plan.file_ids, ok_b=plan.blocks)
            # the cells' files from the same listing as the index (see current_files); a flush
            # with no rows for this table has no file, and then no cells to add
            wanted = set(plan.cell_file_ids)
            cell_files = [f for f in files if file_id_of(f) in wanted]
            if plan.cell_steps and cell_files:
                ctes["todo"] = "SELECT unnest($todo) AS step"
                ctes["src"] = cells(False, " SEMI JOIN todo USING (step)") + " UNION ALL " + ctes["src"]
                p.update(files=cell_files, todo=plan.cell_steps)
        ctes["src"] = ctes.pop("src")         # last: it reads the others
        with_sql = "WITH " + ", ".join(f"{name} AS ({body})" for name, body in ctes.items())
        if times:
            inner = bin_and_keys + ["max(t.step_last) AS step_last"] + aggs
            outer = ["agg.step", "agg.step_last", "idx.wall_time"] + [f"agg.{k}" for k in keys] + [
                f'agg."{c}"' for c in rules]
            sql = (f"{with_sql}, agg AS (SELECT {', '.join(inner)} FROM src t GROUP BY ALL) "
                   f"SELECT {', '.join(outer)} FROM agg LEFT JOIN idx ON idx.step = agg.step_last "
                   f"ORDER BY {', '.join(f'agg.{k}' for k in order)}")
        else:
            sql = (f"{with_sql} SELECT {', '.join(bin_and_keys + aggs)} FROM src t GROUP BY ALL "
                   f"ORDER BY {', '.join(order)}")
        used = set(re.findall(r"\$(\w+)", sql))
        bound = {k: v for k, v in p.items() if k in used}
        # the current index, read once per list of index files (``current_index``)
        con.register("idx_now", current_index(con, step_files)[["step", "file_id", "wall_time"]])
        try:
            if times:
                return con.execute(sql, bound).df()
            return _categorical_keys(con.sql(sql, params=bound).to_arrow_table())
        finally:
            con.unregister("idx_now")

    return _retry(run)[out_cols]
