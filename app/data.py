"""The dashboard's data access: one cached DuckDB connection, cached page queries.

A cached result is keyed on the run's *fingerprint*: the names, sizes and modification times of
``run.json`` and the ``steps`` index files. A flush, a compaction or a close changes it (a step
becomes visible only when an index file lists it), so a live run's pages refresh and a finished
run's pages are served from the cache.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import streamlit as st

from mismatch_monitor import query
from mismatch_monitor.store import RUN_FILE, STEPS_TABLE, read_run_info, run_status
from mismatch_monitor.store.health import set_aside

from . import loaders
from .runs import list_runs

MAX_POINTS = 600          # step bins per chart: longer runs are merged into bins of whole steps
Stamp = tuple[tuple[str, int, int], ...]


@st.cache_resource(show_spinner=False)
def connection() -> duckdb.DuckDBPyConnection:
    """The server's one DuckDB connection; every query runs on a cursor of it (thread-safe)."""
    return query.connect()


def fingerprint(run_dir: Path) -> Stamp:
    parts = []
    for path in [Path(run_dir) / RUN_FILE, *sorted((Path(run_dir) / STEPS_TABLE).glob("*.parquet"))]:
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed by a compaction meanwhile: the next call sees the new set
            continue
        parts.append((path.name, stat.st_mtime_ns, stat.st_size))
    return tuple(parts)


@st.cache_data(show_spinner=False, max_entries=512)
def _cached(_con: duckdb.DuckDBPyConnection, loader: str, run_dir: str, stamp: tuple[Stamp, ...],
            params: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return getattr(loaders, loader)(_con, Path(run_dir), **dict(params))


def load(loader: str, run_dir: Path, *, also: tuple[Path, ...] = (), **params: Any) -> dict[str, Any]:
    """``loaders.<loader>(con, run_dir, **params)``, cached until the run's files (or those of the
    runs in ``also``) change."""
    stamp = tuple(fingerprint(p) for p in (run_dir, *also))
    cursor = connection().cursor()
    try:
        return _cached(cursor, loader, str(run_dir), stamp, tuple(sorted(params.items())))
    finally:
        cursor.close()


def meta(run_dir: Path) -> dict[str, Any]:
    return load("meta", run_dir)


@st.cache_data(show_spinner=False, max_entries=256, ttl=60)
def _set_aside(run_dir: str, stamp: Stamp) -> list[tuple[str, str]]:
    return [(str(Path(p).relative_to(run_dir)), reason) for p, reason in set_aside(run_dir)]


def damaged_files(run_dir: Path) -> list[tuple[str, str]]:
    """(path relative to the run, reason) of each data file the readers set aside: a file that
    is not the store's, or is truncated or corrupt (rechecked at most once a minute)."""
    return _set_aside(str(run_dir), fingerprint(run_dir))


@st.cache_data(show_spinner=False, max_entries=256)
def _run_row(_con: duckdb.DuckDBPyConnection, run_dir: str, stamp: Stamp) -> dict[str, Any]:
    try:
        info = read_run_info(run_dir)
    except (ValueError, OSError) as exc:  # a broken run.json must not hide the other runs
        return {"error": str(exc)}
    index = query.steps_index(_con, run_dir)
    return {"info": info, "n_steps": len(index),
            "last_step": int(index["step"].max()) if len(index) else None,
            "last_wall_time": float(index["wall_time"].max()) if len(index) else None}


CATALOG_COLUMNS = ["name", "path", "run_id", "status", "steps", "last_step", "last_update", "started_at",
                   "pools", "error"]


def describe(name: str, path: Path) -> dict[str, Any]:
    """One catalog row: status (live / finished / stale, computed now), steps, last update, pools."""
    cursor = connection().cursor()
    try:
        row = _run_row(cursor, str(path), fingerprint(path))
    finally:
        cursor.close()
    if "error" in row:
        return {"name": name, "path": str(path), "run_id": name, "status": "unreadable", "steps": 0,
                "last_step": None, "last_update": None, "started_at": None, "pools": "", "error": row["error"]}
    info = row["info"]
    return {"name": name, "path": str(path), "run_id": info["run_id"],
            "status": run_status(info, row["last_wall_time"], now=time.time()),
            "steps": row["n_steps"], "last_step": row["last_step"],
            "last_update": row["last_wall_time"] or info.get("started_at"),
            "started_at": info.get("started_at"), "pools": ", ".join(sorted(info.get("pools", {}))),
            "error": None}


def catalog(root: Path) -> pd.DataFrame:
    """Every run directly under ``root``, one :func:`describe` row each."""
    return pd.DataFrame([describe(name, path) for name, path in list_runs(root).items()],
                        columns=CATALOG_COLUMNS)
