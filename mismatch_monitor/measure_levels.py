"""Measure expected levels from a healthy run: rows for ``expected_levels.csv``.

    python -m mismatch_monitor.measure_levels RUN_DIR --pools bf16,fp8 [--steps FIRST LAST]

Each chosen pool's ``LEVEL_METRICS`` merged from their sums over the steps (one number per pool
and metric, as a marginal means, never a mean of per-step values), with the pool's precision and
engine from ``run.json``; each row's source is the command that measured it. A level of 0 (no
extreme token in the range) or none (no tokens) cannot be a healthy level and is left out, with
a line on stderr saying so.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Sequence

from . import query
from .expected_levels import COLUMNS, LEVEL_METRICS
from .store.runinfo import read_run_info


def measure(run_dir: str | Path, pools: Sequence[str], steps: tuple[int, int] | None,
            source: str) -> tuple[list[list[str]], list[str]]:
    """(rows, notes): the CSV rows measured and what was left out."""
    info = read_run_info(run_dir)
    con = query.connect()
    merged = query.metric_series(con, run_dir, ["pool"], metrics=list(LEVEL_METRICS), steps=steps, per_step=False)
    rows, notes = [], []
    for pool in pools:
        meta = info["pools"].get(pool)
        if meta is None or "precision" not in meta or "engine" not in meta:
            raise ValueError(f"pool {pool!r} of {run_dir} has no precision and engine in run.json; "
                             f"its pools: {sorted(info['pools'])}")
        found = merged[merged["pool"] == pool]
        for metric in LEVEL_METRICS:
            value = float(found[metric].iloc[0]) if len(found) else math.nan
            if not (math.isfinite(value) and value > 0):
                notes.append(f"{pool} {metric}: {value} is not a healthy level > 0; left out")
                continue
            rows.append([metric, meta["precision"], meta["engine"], f"{value:.4g}", source])
    return rows, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mismatch_monitor.measure_levels", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--pools", required=True, help="comma-separated pool names of healthy pools")
    parser.add_argument("--steps", nargs=2, type=int, metavar=("FIRST", "LAST"))
    parser.add_argument("--note", default="", help="what the run is, appended to each row's source")
    args = parser.parse_args(argv)
    pools = [p for p in args.pools.split(",") if p]
    command = f"python -m mismatch_monitor.measure_levels {args.run_dir} --pools {args.pools}"
    if args.steps:
        command += f" --steps {args.steps[0]} {args.steps[1]}"
    source = f"measured: {command}" + (f" ({args.note})" if args.note else "")
    rows, notes = measure(args.run_dir, pools, tuple(args.steps) if args.steps else None, source)
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(rows)
    for note in notes:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
