"""``mismatch-monitor export RUN_DIR --metric KEY --by pool --format csv|parquet``."""

from __future__ import annotations

import argparse
import sys

from .. import query
from ..metrics import METRIC_BY_KEY


def _metric_key(name: str) -> str:
    key = name if name.startswith("mismatch/") else f"mismatch/{name}"
    if key not in METRIC_BY_KEY:
        raise argparse.ArgumentTypeError(
            f"unknown metric {name!r}; expected one of: "
            + ", ".join(k[len('mismatch/'):] for k in METRIC_BY_KEY))
    return key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds run.json)")
    parser.add_argument("--metric", action="append", type=_metric_key, required=True,
                        help="metric key, e.g. k3_kl or abs_log_ratio/p99 (repeatable)")
    parser.add_argument("--by", action="append", default=[],
                        help="group by a label or bucket column, e.g. pool (repeatable)")
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv")
    parser.add_argument("--output", "-o", default="-", help="file to write; '-' = stdout (csv only)")
    parser.add_argument("--steps", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None)


def run(args: argparse.Namespace) -> int:
    query.run_config(args.run_dir)
    con = query.connect()
    df = query.metric_series(con, args.run_dir, args.by, metrics=args.metric,
                             steps=tuple(args.steps) if args.steps else None)
    if args.format == "csv":
        if args.output == "-":
            df.to_csv(sys.stdout, index=False)
        else:
            df.to_csv(args.output, index=False)
    else:
        if args.output == "-":
            raise ValueError("--format parquet needs --output FILE")
        df.to_parquet(args.output, index=False)
    if args.output != "-":
        print(f"wrote {len(df)} rows to {args.output}", file=sys.stderr)
    return 0
