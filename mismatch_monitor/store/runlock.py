"""One writer per run directory: an exclusive ``flock`` on ``RUN_DIR/writer.lock``.

The kernel holds the lock for the open file and drops it when the holder exits, however it
exits (kill -9 included), so a lock left by a dead process is simply taken: the file's text,
which names the last holder, is only read to say who holds a lock that is taken, and to log a
take-over. Compaction takes the same lock without waiting to learn that no writer is live.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

LOCK_FILE = "writer.lock"

log = logging.getLogger(__name__)


class RunLocked(RuntimeError):
    """Another live process (or another writer in this one) writes this run directory."""


def _holder_text(fh: IO[bytes]) -> dict[str, Any]:
    fh.seek(0)
    raw = fh.read(4096)
    try:
        holder = json.loads(raw.decode("utf-8")) if raw else {}
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """Held from :meth:`acquire` to :meth:`release` (or the holder's exit; a lock object that is
    garbage-collected closes its file, which drops the lock too)."""

    def __init__(self, run_dir: str | os.PathLike[str], role: str = "writer") -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.role = role
        self._file: IO[bytes] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, wait_for_compaction: float = 30.0) -> None:
        """Take the lock now or raise :class:`RunLocked` naming the holder. A compaction holds it
        only while it removes orphans (a moment): that holder is waited for."""
        deadline = time.monotonic() + wait_for_compaction
        while not self.try_acquire():
            holder = self.holder()
            # a compaction holds it a moment; an empty text is a holder rewriting it right now
            if holder.get("role", "compaction") == "compaction" and time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            raise RunLocked(
                f"run directory {self.path.parent} is being written by another {holder.get('role', 'writer')}: "
                f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since "
                f"{holder.get('since_iso', '?')}); a run takes one writer at a time. Close that "
                f"writer, or log to another run directory.")

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False when a live holder has it."""
        if self._file is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+b")          # noqa: SIM115 - held open for as long as the lock
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return False
        previous = _holder_text(fh)
        if previous.get("pid") is not None and not previous.get("released"):
            log.warning("mismatch-monitor: took over the lock of %s left by %s pid %s on host %s (it ended "
                        "without releasing it)", self.path.parent, previous.get("role", "writer"),
                        previous.get("pid"), previous.get("host", "?"))
        now = time.time()
        self._rewrite(fh, {"pid": os.getpid(), "host": socket.gethostname(), "role": self.role, "since": now,
                           "since_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))})
        self._file = fh
        return True

    def holder(self) -> dict[str, Any]:
        """Who holds (or last held) the lock, as its file says."""
        try:
            with open(self.path, "rb") as fh:
                return _holder_text(fh)
        except FileNotFoundError:
            return {}

    def release(self) -> None:
        if self._file is None:
            return
        fh, self._file = self._file, None
        try:
            self._rewrite(fh, {**_holder_text(fh), "released": True})
        except OSError:           # a full disk must not keep the lock: closing the file drops it
            pass
        finally:
            fh.close()

    @staticmethod
    def _rewrite(fh: IO[bytes], holder: dict[str, Any]) -> None:
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(holder, sort_keys=True).encode("utf-8"))
        fh.flush()
