"""The Parquet run store: atomic, append-only files that never lose a committed step."""

from .compact import compact_run
from .runinfo import RUN_FILE, RunNotFound, find_runs, read_run_info, run_status
from .runlock import RunLocked
from .schema import ALL_TABLES, DATA_TABLES, SCHEMA_VERSION, STEPS_TABLE
from .writer import IdSource, RunWriter

__all__ = ["RunWriter", "IdSource", "compact_run", "read_run_info", "run_status", "find_runs",
           "RunNotFound", "RunLocked", "RUN_FILE", "SCHEMA_VERSION", "ALL_TABLES", "DATA_TABLES", "STEPS_TABLE"]
