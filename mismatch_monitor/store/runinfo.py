"""``run.json``: what a run is (id, start, config, per-pool metadata) and whether it is live."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

RUN_FILE = "run.json"
RunStatus = Literal["live", "finished", "stale"]


class RunNotFound(FileNotFoundError):
    """A directory that is not a run (no run.json)."""


def read_run_info(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        raise RunNotFound(f"{run_dir} is not a run directory (no {RUN_FILE})")
    with open(path, encoding="utf-8") as fh:
        info = json.load(fh)
    for key in ("run_id", "started_at", "config", "pools"):
        if key not in info:
            raise ValueError(f"{path} is missing {key!r}; expected a run.json written by mismatch-monitor")
    return info


def run_status(info: dict[str, Any], last_wall_time: float | None, *, now: float | None = None,
               stale_after_seconds: float = 300.0) -> RunStatus:
    """finished once closed; live while steps keep arriving; stale when a run stopped unclosed."""
    if info.get("closed_at") is not None:
        return "finished"
    now = time.time() if now is None else now
    latest = last_wall_time if last_wall_time is not None else info["started_at"]
    return "live" if now - latest <= stale_after_seconds else "stale"


def find_runs(root: str | Path) -> list[Path]:
    """Run directories directly under ``root`` (or ``root`` itself when it is one), sorted."""
    root = Path(root)
    if (root / RUN_FILE).exists():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / RUN_FILE).exists())
