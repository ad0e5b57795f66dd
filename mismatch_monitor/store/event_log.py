"""The run's event and outcome logs: what happened to the weights, and how training went.

* ``events``: one row per weight sync, resume, resync or resync request (``EVENT_KINDS``):
  step (the first step whose batches come after the event), wall_time, kind, pool (null: every
  pool), version (the weight version, null when unknown), message.
* ``outcomes``: one row per training outcome and step: step, wall_time, pool (null: the whole
  batch), name ("reward", "loss", "grad_norm", "entropy", "eval_reward" or any other), value.

Both are logs, not per-step statistics: their rows carry their own step and are written with the
next flush (also one with no step to write: its index file is then empty), and are read once
that flush's index exists, like the ``errors`` table. Every event is kept; an outcome logged
again for the same (step, pool, name) replaces the earlier one (a restarted run that re-logs a
step wins, as its statistics do): within a flush the last row is written, across flushes the
reader takes the latest ``write_id``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pandas as pd

EVENTS_TABLE = "events"
OUTCOMES_TABLE = "outcomes"
EVENT_KINDS: tuple[str, ...] = ("weight_sync", "resume", "resync", "resync_request")

EVENT_COLUMNS: dict[str, str] = {"step": "int64", "wall_time": "float64", "kind": "string",
                                 "pool": "string", "version": "Int64", "message": "string"}
OUTCOME_COLUMNS: dict[str, str] = {"step": "int64", "wall_time": "float64", "pool": "string",
                                   "name": "string", "value": "float64"}
# an outcome is one value per (step, pool, name): the row logged last wins
OUTCOME_KEY: tuple[str, ...] = ("step", "pool", "name")
COLUMNS_OF: dict[str, dict[str, str]] = {EVENTS_TABLE: EVENT_COLUMNS, OUTCOMES_TABLE: OUTCOME_COLUMNS}


def resync_request_message(alert: str, what: str, step: int, callbacks: int) -> str:
    """A ``resync_request`` event's message: the alert that asked comes first (``requested_by``)."""
    return f"{alert} {what} at step {step}; {callbacks} on_resync callback(s) called"


def requested_by(message: object) -> str | None:
    """The alert named by a ``resync_request`` message (its first word); None when there is none."""
    return message.split(" ", 1)[0] if isinstance(message, str) and message.strip() else None


def empty_frame(table: str) -> pd.DataFrame:
    """The table's columns, no rows (what a reader gives for a run without the table)."""
    return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in COLUMNS_OF[table].items()})


def log_frame(table: str, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``rows`` as a frame of the table's columns and types (a missing column is null)."""
    columns = COLUMNS_OF[table]
    if not rows:
        return empty_frame(table)
    return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows]).astype(columns)


def last_per_key(table: str, df: pd.DataFrame) -> pd.DataFrame:
    """The rows one flush writes: for ``outcomes``, the last row per (step, pool, name); the
    other tables unchanged. ``df`` is in the order the rows were logged."""
    if table != OUTCOMES_TABLE or not len(df):
        return df
    return df.drop_duplicates(list(OUTCOME_KEY), keep="last").reset_index(drop=True)
