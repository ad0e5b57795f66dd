"""What ``log_event`` and ``log_outcomes`` check, and the rows they store (``store/event_log.py``).

The same two kinds of trouble as ``log_step`` (``checks.py``):

* **a mistake in the call** raises at once in every mode: an unknown event kind, a step or
  version that is not an integer, a pool or message that is not a string, values that are not a
  mapping of names to numbers;
* **bad data** is counted and kept in the run's ``errors`` table (raised only in strict mode):
  a step or version outside int64 (steps >= 0), a non-finite outcome (the call's finite values
  are still stored).

``step=None`` for an event means "from the next step on": the last step logged (in this process,
or stored in the run it continues) + 1, 0 in a new run: the first step whose batches are sampled
after the event.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, Mapping

import numpy as np
import torch

from mismatch_monitor import query
from mismatch_monitor.batch import BatchError
from mismatch_monitor.store import RunWriter
from mismatch_monitor.store.event_log import EVENT_KINDS

from .checks import MAX_STEP, checked_step
from .fingerprints import WeightFingerprints
from .versions import WeightVersions, not_applied_message

# the collector's error sink: (what failed, the error, its step, wall time)
Note = Callable[[str, BaseException, "int | None", float], None]


class OutcomeError(BatchError):
    """An outcome value the run cannot store (not finite)."""


class VersionError(BatchError):
    """A weight version outside int64."""


def check_event_call(kind: Any, step: Any, pool: Any, version: Any, message: Any) -> None:
    """Raise ``TypeError``/``ValueError`` for a ``log_event`` call that cannot be meant."""
    if not isinstance(kind, str) or kind not in EVENT_KINDS:
        raise ValueError(f"expected kind to be one of {', '.join(map(repr, EVENT_KINDS))}, got {kind!r}")
    if step is not None:
        _check_int("step", step)
    if version is not None:
        _check_int("version", version)
    if pool is not None and not isinstance(pool, str):
        raise TypeError(f"expected pool to be a str or None (every pool), got {type(pool).__name__} {pool!r}")
    if not isinstance(message, str):
        raise TypeError(f"expected message to be a str, got {type(message).__name__}")


def check_outcomes_call(step: Any, values: Any, pool: Any) -> dict[str, float]:
    """The values as floats; ``TypeError`` for a call that cannot be meant."""
    _check_int("step", step)
    if pool is not None and not isinstance(pool, str):
        raise TypeError(f"expected pool to be a str or None (the whole batch), got {type(pool).__name__} "
                        f"{pool!r}")
    if not isinstance(values, Mapping):
        raise TypeError(f"expected values to be a mapping of outcome name -> number, got {type(values).__name__}")
    out: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"expected outcome names to be non-empty strings, got {name!r}")
        out[name] = _as_float(name, value)
    return out


def event_row(kind: str, step: int, pool: str | None, version: int | None, message: str,
              wall_time: float) -> dict[str, Any]:
    """The stored row; ``VersionError`` (bad data) for a version outside int64."""
    if version is not None:
        version = operator.index(version)
        if not -MAX_STEP - 1 <= version <= MAX_STEP:
            raise VersionError(f"expected version to fit an int64, got {version}; the {kind} event at step "
                               f"{step} is not recorded")
    return {"step": checked_step(step), "wall_time": float(wall_time), "kind": kind, "pool": pool,
            "version": version, "message": message}


def outcome_rows(step: int, values: Mapping[str, float], pool: str | None,
                 wall_time: float) -> tuple[list[dict[str, Any]], list[OutcomeError]]:
    """The finite values' rows, and an error per non-finite value (it is not stored)."""
    rows, errors = [], []
    for name, value in values.items():
        if math.isfinite(value):
            rows.append({"step": step, "wall_time": float(wall_time), "pool": pool, "name": name, "value": value})
        else:
            where = "" if pool is None else f" of pool {pool!r}"
            errors.append(OutcomeError(f"outcome {name!r}{where} at step {step} is {value}: not stored "
                                       f"(the step's finite outcomes are)"))
    return rows, errors


def _check_int(what: str, value: Any) -> None:
    if isinstance(value, bool):
        raise TypeError(f"expected {what} to be an int, got bool {value!r}")
    try:
        operator.index(value)
    except TypeError:
        raise TypeError(f"expected {what} to be an int, got {type(value).__name__} {value!r}") from None


def _as_float(name: str, value: Any) -> float:
    """A real number, or a one-element tensor/array (trainers log 0-d tensors), as a float."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        numel = value.numel() if isinstance(value, torch.Tensor) else value.size
        if numel != 1:
            raise TypeError(f"expected outcome {name!r} to be one number, got an array of shape "
                            f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"expected outcome {name!r} to be a real number, got {type(value).__name__} {value!r}")
    return float(value)


class RunLog:
    """The collector's events and outcomes: the step an event without one takes, the resume a
    reopened run records at its first step, and storing the rows (on the writer rank only)."""

    def __init__(self, clock: Callable[[], float], note: Note, strict: bool,
                 observed: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._clock = clock
        self._observed = observed                 # told of every stored event row (the alert evaluator)
        self._note = note
        self._strict = strict
        self._writer: RunWriter | None = None
        self._last_step: int | None = None
        self._resume: str | None = None           # a reopened run's resume, recorded at its first step
        self.versions = WeightVersions()          # what the sync events say was applied (versions.py)
        self.fingerprints = WeightFingerprints()  # which version's weights a pool holds (fingerprints.py)

    def attach(self, writer: RunWriter) -> None:
        self._writer = writer
        restarts = len(writer.info.get("restarts", []))
        if restarts:
            self._resume = f"the run was reopened (restart {restarts} of its store)"
            from mismatch_monitor.query.events import run_events

            self.versions.replay(run_events(query.connect(), writer.run_dir))

    def step_logged(self, step: int) -> None:
        if self._resume is not None:
            message, self._resume = self._resume, None
            self.event("resume", step, None, None, message)
        self._last_step = step

    def next_step(self) -> int:
        """The step an event without one takes: after the last step logged (module docstring)."""
        if self._last_step is None and self._writer is not None:
            index = query.steps_index(query.connect(), self._writer.run_dir)
            if len(index):                        # a continued run: its latest step
                self._last_step = int(index.sort_values("wall_time", kind="stable")["step"].iloc[-1])
        return 0 if self._last_step is None else self._last_step + 1

    def sync(self, kind: str, step: int | None, pool: str | None, version: int | None, message: str,
             applied: bool, fingerprint: str | None, trainer_fingerprint: str | None) -> None:
        """Store an event whose fingerprints (if any) may say the pool holds other weights."""
        at = self.next_step() if step is None else step
        resolved = self.fingerprints.resolve(pool, version, applied, message, fingerprint, trainer_fingerprint, at)
        for held, ok, text in resolved.events:
            self.event(kind, at, pool, held, text, ok)
        if resolved.error is not None:
            self._bad(f"the {kind} of step {at}", resolved.error, at, self._clock())

    def event(self, kind: str, step: int | None, pool: str | None, version: int | None,
              message: str, applied: bool = True) -> dict[str, Any] | None:
        """Store one event (the call is checked); its row, None when it was bad data."""
        wall = self._clock()
        if not applied:
            message = not_applied_message(message)
        at = self.next_step() if step is None else step
        if kind == "resume":
            self._resume = None                   # the user said it: no second one
        try:
            row = event_row(kind, at, pool, version, message, wall)
        except BatchError as exc:
            self._bad(f"the {kind} event was not recorded", exc, None, wall)
            return None
        if kind in ("weight_sync", "resync"):
            self.versions.add(row["step"], pool, row["version"], applied)
        if self._writer is not None:
            self._writer.append_events([row])
        if self._observed is not None:
            self._observed(row)
        return row

    def outcomes(self, step: int, values: Mapping[str, float], pool: str | None) -> None:
        wall = self._clock()
        try:
            index = checked_step(step)
        except BatchError as exc:
            self._bad("outcomes were not recorded", exc, None, wall)
            return
        rows, errors = outcome_rows(index, values, pool, wall)
        if rows and self._writer is not None:
            self._writer.append_outcomes(rows)
        for error in errors:
            self._bad(f"step {index}", error, index, wall)

    def _bad(self, what: str, exc: BatchError, step: int | None, wall: float) -> None:
        if self._strict:
            raise exc
        self._note(what, exc, step, wall)
