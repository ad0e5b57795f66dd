"""Atomic files: write to a temporary name that no reader globs, fsync, rename into place.

A reader (DuckDB globbing ``*.parquet``) therefore sees either no file or a whole one, never a
half-written file ("No magic bytes"), and a crash leaves at most a stray ``.tmp`` file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

TMP_SUFFIX = ".tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    # leading dot and trailing .tmp: matches neither *.parquet nor *.json
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as fh:
        pq.write_table(table, fh, compression="zstd")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json_atomic(data: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
