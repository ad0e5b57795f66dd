"""Write and file ids that order a run's flushes: one more than the largest the run has used.

Readers take, for each step, the row of the highest ``write_id`` (``current.CURRENT``), so a step
logged again after a restart must get a higher id than every earlier flush. Ids used to come
from the clock, and a host whose clock ran behind re-logged steps that lost to their old values.
They now come from the run itself: the largest id any file name in the run carries (committed,
orphaned, rollups and quarantine included) or that ``RUN_DIR/ids`` records, plus
one. ``ids`` is updated under its own ``flock``, so a writer and a concurrent compaction never
take the same id (and never the same file name).
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from pathlib import Path

IDS_FILE = "ids"
_ID_IN_NAME = re.compile(r"^part-(\d+)\.parquet$")
_INT64_MAX = 2**63 - 1       # ids are stored as int64; a larger number in a name is not one of ours


def largest_stored_id(run_dir: Path) -> int:
    """The largest id a ``part-<id>.parquet`` name carries under ``run_dir`` (temporary files are
    left out: a live writer's took its id from ``IDS_FILE``, a dead one's is never renamed)."""
    largest = 0
    for root, _dirs, names in os.walk(run_dir):
        for name in names:
            m = _ID_IN_NAME.match(name)
            if m and int(m.group(1)) <= _INT64_MAX:
                largest = max(largest, int(m.group(1)))
    return largest


class IdSource:
    """Strictly increasing ids for one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._floor = largest_stored_id(self.run_dir)   # once: later ids all pass through IDS_FILE
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / IDS_FILE, "a+") as fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)    # held for a read and a write of a line
                fh.seek(0)
                text = fh.read().strip()
                recorded = int(text) if text.isdigit() else 0
                new = max(recorded, self._floor) + 1
                fh.seek(0)
                fh.truncate()
                fh.write(f"{new}\n")
                fh.flush()
            self._floor = new
            return new
