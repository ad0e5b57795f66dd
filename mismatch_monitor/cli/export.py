"""``mismatch-monitor export RUN_DIR --metric KEY --by pool --format csv|parquet``.

One row per step and group (``--total``: one per group, merged over the steps in range), the
metrics derived from summed statistics, so a group or a range means what one cell means.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from .. import query
from ..batch import STANDARD_DIMENSIONS
from ..engine.fields import LENGTH_KEY, TURN_KEY, merge_rules
from ..metrics import METRIC_BY_KEY
from ..query.core import file_columns
from ..store.schema import STEP_COLUMNS

BUCKETS = (LENGTH_KEY, TURN_KEY)


def _metric_key(name: str) -> str:
    key = name if name.startswith("mismatch/") else f"mismatch/{name}"
    if key not in METRIC_BY_KEY:
        raise argparse.ArgumentTypeError(
            f"unknown metric {name!r}; expected one of: "
            + ", ".join(k[len('mismatch/'):] for k in METRIC_BY_KEY))
    return key


def _step(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step >= 0, got {value}")
    return value


def group_columns(run_dir: str | Path) -> list[str]:
    """What a run's metrics can be grouped by: the label dimensions it logged (the standard ones
    always) and the length and turn buckets; never the store's own columns (step, write_id, ...)."""
    present = file_columns(query.connect(), query.table_files(run_dir, "tokens"))
    internal = set(STEP_COLUMNS) | {"wall_time"} | set(merge_rules("tokens"))
    labels = sorted(c for c in present if c not in internal and c not in BUCKETS
                    and c not in STANDARD_DIMENSIONS)
    return list(STANDARD_DIMENSIONS) + labels + list(BUCKETS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds run.json)")
    parser.add_argument("--metric", action="append", type=_metric_key, required=True, metavar="KEY",
                        help="metric key, e.g. k3_kl or abs_log_ratio/p99 (repeatable; an unknown "
                             "name lists them all)")
    parser.add_argument("--by", action="append", default=[], metavar="COLUMN",
                        help="group by a label or bucket: " + ", ".join(STANDARD_DIMENSIONS + BUCKETS)
                             + ", or another label the run logged (repeatable; every row is one step "
                               "already, unless --total)")
    parser.add_argument("--total", action="store_true",
                        help="one row per group, merged over the steps in range (from sums, not a mean "
                             "of per-step values)")
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv",
                        help="csv (default) or parquet")
    parser.add_argument("--output", "-o", default="-", metavar="FILE",
                        help="file to write; '-' = standard output (csv only; the default)")
    parser.add_argument("--steps", type=_step, nargs=2, metavar=("FIRST", "LAST"), default=None,
                        help="only steps FIRST..LAST, both included")


def _check(args: argparse.Namespace) -> None:
    """Every option against the run, before anything is read or written."""
    if args.steps and args.steps[0] > args.steps[1]:
        raise ValueError(f"--steps {args.steps[0]} {args.steps[1]}: expected FIRST <= LAST")
    query.run_config(args.run_dir)                      # a clear error for a non-run directory
    allowed = group_columns(args.run_dir)
    for col in args.by:
        if col == "step":
            raise ValueError("--by step: every row is one step already; group by one of "
                             + ", ".join(allowed))
        if col not in allowed:
            raise ValueError(f"--by {col}: not a label or bucket of this run; expected one of "
                             + ", ".join(allowed))
    if len(set(args.by)) != len(args.by):
        raise ValueError(f"--by names a column twice: {' '.join(args.by)}")
    if args.format == "parquet" and args.output == "-":
        raise ValueError("--format parquet needs --output FILE")
    if args.output != "-":
        target = Path(args.output)
        if target.is_dir():
            raise ValueError(f"--output {target} is a directory; expected a file name")
        if not target.parent.is_dir():
            raise ValueError(f"--output {target}: directory {target.parent} does not exist")


def _write(df: pd.DataFrame, args: argparse.Namespace) -> None:
    try:
        if args.format == "csv":
            df.to_csv(sys.stdout if args.output == "-" else args.output, index=False)
        else:
            df.to_parquet(args.output, index=False)
    except OSError as exc:                   # a read-only directory, a full disk, ...
        raise ValueError(f"cannot write --output {args.output}: {exc.strerror or exc}") from exc


def run(args: argparse.Namespace) -> int:
    _check(args)
    con = query.connect()
    df = query.metric_series(con, args.run_dir, args.by, metrics=args.metric,
                             steps=tuple(args.steps) if args.steps else None, per_step=not args.total)
    idx = query.steps_index(con, args.run_dir)
    observed = idx[idx["n_tokens"] > 0]["step"]
    if args.steps:
        observed = observed[observed.between(*args.steps)]
    if observed.empty:                       # said, not left to an empty file
        where = f" in steps {args.steps[0]}..{args.steps[1]}" if args.steps else ""
        have = f"steps {int(idx['step'].min())}..{int(idx['step'].max())}" if len(idx) else "no steps"
        print(f"export: no observations{where} (the run has {have})", file=sys.stderr)
    _write(df, args)
    if args.output != "-":
        print(f"wrote {len(df)} rows to {args.output}", file=sys.stderr)
    return 0
