"""``mismatch-monitor compact RUN_DIR``."""

from __future__ import annotations

import argparse

from ..store import compact_run, read_run_info
from ..store.compact import REPAIRS, ROLLUPS_ADDED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds run.json)")


def run(args: argparse.Namespace) -> int:
    read_run_info(args.run_dir)  # a clear error for a directory that is not a run
    removed = compact_run(args.run_dir)
    added = removed.pop(ROLLUPS_ADDED, 0)
    repairs = {k: removed.pop(k, 0) for k in REPAIRS}
    total = sum(removed.values())
    done = [f"{n} {k.replace('_', ' ')}" for k, n in repairs.items() if n]
    print(f"compacted {args.run_dir}: {total} file(s) merged"
          + (f", {added} rollup file(s) added" if added else "")
          + (f"; {', '.join(done)}" if done else "")
          + ("" if total or added or done else " (nothing to do)"))
    return 0
