"""``run.json``: what a run is (id, start, config, per-pool metadata) and whether it is live."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Literal, Mapping

from ..config import MetricConfig, parameter_differences
from .atomic import write_json_atomic
from .schema import SCHEMA_VERSION

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


def open_run_info(run_dir: Path, config: MetricConfig, now: float, run_id: str | None,
                  pools: Mapping[str, Mapping[str, Any]], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Create ``run_dir``'s run.json, or reopen it for appending (a restart is recorded; the
    config may change only in how the engine ran, see ``MetricConfig.stats_parameters``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = read_run_info(run_dir) if (run_dir / RUN_FILE).exists() else None
    if existing is not None:
        if run_id is not None and run_id != existing["run_id"]:
            raise ValueError(
                f"run directory {run_dir} holds run {existing['run_id']!r}, got run_id={run_id!r}")
        info = dict(existing)
        info["restarts"] = list(info.get("restarts", [])) + [now]
        info["closed_at"] = None
        info["pools"] = {**info.get("pools", {}), **{k: dict(v) for k, v in pools.items()}}
        info["metadata"] = {**info.get("metadata", {}), **dict(metadata)}
        if info.get("config") != config.to_dict():
            # readers take every step under run.json's one config: only how the engine ran may change
            stored = MetricConfig.from_dict(info["config"]).stats_parameters()
            differences = parameter_differences(stored, config.stats_parameters())
            if differences:
                raise ValueError(
                    f"run directory {run_dir} holds statistics computed under other MetricConfig "
                    f"parameters (stored vs given: {'; '.join(differences)}); continue it with its own "
                    "config (MetricConfig.from_dict(read_run_info(run_dir)['config'])) or start another run")
            info.setdefault("config_history", []).append({"at": now, "config": info.get("config")})
            info["config"] = config.to_dict()
    else:
        info = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id or run_dir.name,
            "started_at": now,
            "closed_at": None,
            "restarts": [],
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "config": config.to_dict(),
            "pools": {k: dict(v) for k, v in pools.items()},
            "metadata": dict(metadata),
        }
    write_json_atomic(info, run_dir / RUN_FILE)
    return info
