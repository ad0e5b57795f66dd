"""``mismatch-monitor serve RUN_DIR``: export a stored run to Prometheus.

For runs logged without an exporter (or read on another machine): the latest step's gauges, the
run's totals as counters and histogram, and the resyncs recorded in its ``alerts`` table, served
on ``/metrics``. New steps are picked up every ``--poll-seconds`` while the run is written.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

DEFAULT_PORT = 9464


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds run.json)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to serve /metrics on (0: any free port)")
    parser.add_argument("--addr", default="127.0.0.1", help="address to bind (default: 127.0.0.1 only)")
    parser.add_argument("--poll-seconds", type=float, default=5.0, help="how often to look for new steps")
    parser.add_argument("--max-label-values", type=int, default=None,
                        help="values of a label (pool, hardware) exported one by one; the rest are merged "
                             "into %%other (default: LabelLimit's, 100)")


def load_run(exporter: Any, con: Any, run_dir: str | Path) -> int | None:
    """Load the run's latest step and totals into ``exporter``; the step, or None when empty."""
    from .. import query
    from ..engine.stats import MismatchStats

    idx = query.steps_index(con, run_dir)
    observed = idx[idx["n_tokens"] > 0]
    if observed.empty:
        return None
    last = int(observed["step"].max())
    by = ["pool", "hardware"]

    def stats(steps: tuple[int, int], per_step: bool) -> MismatchStats:
        tables = {}
        for table in ("tokens", "sequences", "abs_hist"):
            df = query.aggregate(con, run_dir, table, by, steps=steps, per_step=per_step)
            tables[table] = df.drop(columns=["step", "wall_time"], errors="ignore")
        return MismatchStats(tables, tuple(by))

    latest = stats((last, last), per_step=True)
    cumulative = stats((int(idx["step"].min()), last), per_step=False)
    exporter.load(last, latest, cumulative, resyncs=_resyncs(con, run_dir),
                  step_time=float(observed.loc[observed["step"] == last, "wall_time"].iloc[0]))
    return last


def _resyncs(con: Any, run_dir: str | Path) -> dict[str | None, float]:
    """Resync requests per pool as the alert events name it (its label text); None: fleet-wide."""
    import pandas as pd

    from .. import query

    alerts = query.rows(con, run_dir, "alerts")
    if alerts.empty or not {"resync", "state", "pool"} <= set(alerts.columns):
        return {}
    asked = alerts[(alerts["state"] == "firing") & alerts["resync"].astype(bool)]
    return {(None if pd.isna(p) else str(p)): float(n)
            for p, n in asked.groupby(asked["pool"].astype(object), dropna=False).size().items()}


def run(args: argparse.Namespace) -> int:
    from .. import query
    from ..exporter import MismatchExporter
    from ..label_limits import LabelLimit
    from ..store import read_run_info

    info = read_run_info(args.run_dir)  # a clear error when it is not a run
    if not args.poll_seconds > 0:
        raise ValueError(f"expected --poll-seconds > 0, got {args.poll_seconds}")
    limit = LabelLimit() if args.max_label_values is None else LabelLimit(args.max_label_values)
    con = query.connect()
    exporter = MismatchExporter(config=query.run_config(args.run_dir), limit=limit, pools=info["pools"])
    step = load_run(exporter, con, args.run_dir)
    port = exporter.start(args.port, args.addr)
    print(f"serving {args.run_dir} on http://{args.addr}:{port}/metrics "
          f"(step {'-' if step is None else step}); Ctrl-C to stop", flush=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(args.poll_seconds):
            try:
                load_run(exporter, con, args.run_dir)
            except Exception as exc:  # a transient read error must not stop the endpoint
                print(f"mismatch-monitor serve: reading {args.run_dir} failed: {exc}", file=sys.stderr)
    finally:
        exporter.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
