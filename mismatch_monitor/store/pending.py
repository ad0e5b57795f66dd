"""What the writer holds between flushes: per table, the frames of unwritten steps, their index
rows and which append logged each (``RunWriter`` takes a whole :class:`_Pending` per flush)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import pandas as pd

from .schema import DATA_TABLES


# per table: (step or None for rows that carry their own, the append that logged it, frame)
Buffer = dict[str, list[tuple["int | None", "int | None", pd.DataFrame]]]
_APPEND = "_append"   # temporary column: the append a row of deferred tables belongs to


class DeferredTables(Protocol):
    """Tables built when the writer flushes (off the training thread), many steps at once:
    ``frames_of([(key, obj), ...], key=name)`` returns table -> frame with a ``name`` column."""

    @staticmethod
    def frames_of(items: Sequence[tuple[int, Any]], key: str = "step") -> Mapping[str, pd.DataFrame]: ...


class FlushError(RuntimeError):
    """What went wrong in a background flush (the cause is chained)."""


@dataclass
class _Pending:
    """Steps taken out of the buffer for one flush: the tables, the index rows, and which append
    logged each index row (a step logged twice before a flush is written once: the later)."""

    buffer: Buffer = field(default_factory=lambda: {t: [] for t in DATA_TABLES})
    steps: list[dict[str, Any]] = field(default_factory=list)
    appends: list[int] = field(default_factory=list)
    # (step, append, tables built when written, off the training thread)
    deferred: list[tuple[int, int, DeferredTables]] = field(default_factory=list)
    errors: list[FlushError] = field(default_factory=list)

    def extend(self, later: "_Pending") -> None:
        for table, frames in later.buffer.items():
            self.buffer[table].extend(frames)
        self.steps.extend(later.steps)
        self.appends.extend(later.appends)
        self.deferred.extend(later.deferred)
        self.errors.extend(later.errors)

    def latest(self) -> tuple[list[dict[str, Any]], set[int]]:
        """The index rows to write (the last append of each step, in order) and those appends."""
        last: dict[int, int] = {}
        for row, append in zip(self.steps, self.appends):
            last[row["step"]] = append
        keep = set(last.values())
        return [row for row, append in zip(self.steps, self.appends) if append in keep], keep

    def build_deferred(self) -> None:
        """Build the deferred tables into the buffer, once (a write that fails and is tried
        again does not build them twice), every step of a kind together. A set that cannot be
        built loses only its own rows (a bad one must not stop every later flush); its error is
        kept. Built rows carry their append, so a step logged again later still wins."""
        deferred, self.deferred = self.deferred, []
        kinds: dict[type, list[tuple[int, int, DeferredTables]]] = {}
        for item in deferred:
            kinds.setdefault(type(item[2]), []).append(item)
        for items in kinds.values():
            try:
                self._add_built(items)
            except Exception:
                for item in items:               # find the set that fails: the others are kept
                    try:
                        self._add_built([item])
                    except Exception as exc:
                        error = FlushError(f"the tables built at flush time for step {item[0]} failed and "
                                           f"were left out: {type(exc).__name__}: {exc}")
                        error.__cause__ = exc
                        self.errors.append(error)

    def _add_built(self, items: list[tuple[int, int, DeferredTables]]) -> None:
        built = type(items[0][2]).frames_of([(append, obj) for _, append, obj in items], key=_APPEND)
        frames = [(table, df) for table, df in built.items() if len(df)]
        unknown = sorted(t for t, _ in frames if t not in self.buffer)
        if unknown:
            raise ValueError(f"unknown tables {unknown}")
        for table, df in frames:
            self.buffer[table].append((None, None, df))

    def drop_oldest(self, n: int) -> list[int]:
        """Take the ``n`` oldest steps out, with their rows; their step numbers, oldest first.
        Rows that carry their own step (alerts, errors) stay; built rows of a dropped append
        are left out at write time (they are not in ``latest``)."""
        gone = set(self.appends[:n])
        dropped = [row["step"] for row in self.steps[:n]]
        del self.steps[:n], self.appends[:n]
        for table, entries in self.buffer.items():
            k = 0                     # rows are in append order: the dropped ones lead
            while k < len(entries) and (entries[k][1] is None or entries[k][1] in gone):
                k += 1
            if k:
                self.buffer[table] = [e for e in entries[:k] if e[1] is None] + entries[k:]
        self.deferred = [d for d in self.deferred if d[1] not in gone]
        return dropped

    def prune_built(self) -> None:
        """Drop the rows of built tables whose append is no longer kept (dropped steps): a flush
        that failed built them, and they would otherwise wait for a write that never takes them."""
        kept = set(self.appends)
        for table, entries in self.buffer.items():
            for i, (step, append, df) in enumerate(entries):
                if step is None and _APPEND in df.columns and not df[_APPEND].isin(kept).all():
                    entries[i] = (step, append, df[df[_APPEND].isin(kept)])

    def step_range(self) -> str:
        steps = [row["step"] for row in self.steps]
        if not steps:
            return "collector errors (no step)"
        return f"step {steps[0]}" if len(steps) == 1 else f"steps {min(steps)}-{max(steps)}"
