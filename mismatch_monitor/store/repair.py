"""What compaction clears before it merges: unreadable files, and what killed processes left.

- Files readers set aside (``health.py``) move to ``RUN_DIR/quarantine/<table>/`` (kept for a
  look, out of every reader's glob).
- Temporary files (``.<name>.<pid>.tmp``) of processes that no longer run are removed; a live
  writer's are left alone.
- Orphans (data and rollup files whose file id no index file names: the flush that wrote them
  was killed before its index) are removed only when no writer holds the run (``runlock.py``):
  a live writer's flush in progress looks the same until it writes its index.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .atomic import TMP_SUFFIX
from .health import set_aside, table_dirs
from .runlock import RunLock
from .schema import STEPS_TABLE, file_id_of

QUARANTINE_DIR = "quarantine"
QUARANTINED, TMP_REMOVED, ORPHANS_REMOVED = "quarantined", "tmp_removed", "orphans_removed"
_TMP_PID = re.compile(r"\.(\d+)" + re.escape(TMP_SUFFIX) + "$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def quarantine(run_dir: Path) -> int:
    moved = 0
    for path, _reason in set_aside(run_dir):
        rel = Path(path).relative_to(run_dir)
        target = run_dir / QUARANTINE_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        moved += 1
    return moved


def remove_dead_tmp(run_dir: Path) -> int:
    removed = 0
    for folder in [run_dir, *(run_dir / t for t in table_dirs(run_dir))]:
        for p in folder.glob(f".*{TMP_SUFFIX}") if folder.is_dir() else []:
            m = _TMP_PID.search(p.name)
            pid = int(m.group(1)) if m else None
            if pid is not None and (pid == os.getpid() or _running(pid)):
                continue                   # a live process may still rename it into place
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def remove_orphans(run_dir: Path) -> tuple[int, int]:
    """Remove data and rollup files no index file names (call with the run's lock held); those
    of a quarantined index join it in quarantine. Returns (removed, quarantined)."""
    indexed = {file_id_of(p) for p in (run_dir / STEPS_TABLE).glob("*.parquet")}
    held = {file_id_of(p) for p in (run_dir / QUARANTINE_DIR / STEPS_TABLE).glob("*.parquet")} - {None}
    removed = moved = 0
    for table in table_dirs(run_dir):
        if table == STEPS_TABLE:
            continue
        for p in (run_dir / table).glob("*.parquet"):
            file_id = file_id_of(p)
            if file_id in indexed:
                continue
            if file_id in held:
                target = run_dir / QUARANTINE_DIR / table / p.name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(p, target)
                moved += 1
            else:
                p.unlink(missing_ok=True)
                removed += 1
    return removed, moved


def repair_run(run_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Quarantine unreadable files, remove dead processes' temporary files and, when no writer
    is live, orphans; returns the count of each."""
    run_dir = Path(run_dir)
    out = {QUARANTINED: quarantine(run_dir), TMP_REMOVED: remove_dead_tmp(run_dir), ORPHANS_REMOVED: 0}
    lock = RunLock(run_dir, role="compaction")
    if lock.try_acquire():                 # no writer: every orphan is a dead flush's
        try:
            out[ORPHANS_REMOVED], moved = remove_orphans(run_dir)
            out[QUARANTINED] += moved
        finally:
            lock.release()
    return out
