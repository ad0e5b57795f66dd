"""Atomic files: write to a temporary name that no reader globs, fsync, rename into place.

A reader (DuckDB globbing ``*.parquet``) therefore sees either no file or a whole one, never a
half-written file ("No magic bytes"); a write that fails removes its temporary file, and a
process killed mid-write leaves at most a stray ``.tmp`` file (compaction removes it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

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


def remove_quietly(path: Path) -> None:
    """Remove ``path`` if it exists; a failure to remove is not a second error to report."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _replace_from_tmp(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, then rename into place; a write that fails (a full disk) removes its tmp."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            os.fsync(fh.fileno())

    _replace_from_tmp(path, write)


def write_json_atomic(data: Any, path: Path) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())

    _replace_from_tmp(path, write)
