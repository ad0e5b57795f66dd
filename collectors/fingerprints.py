"""Which weights a pool really holds after a sync, from fingerprints (``mismatch_monitor.fingerprint``).

``log_event("weight_sync" | "resync", pool=p, version=v, fingerprint=f, trainer_fingerprint=t)``:

* ``t`` (the trainer's fingerprint of version ``v``, what it meant to send) is remembered as
  version ``v``'s, for this pool and every other;
* ``f`` (the fingerprint of what the pool loaded) is compared with version ``v``'s (``t``, or
  the one remembered from an earlier event). Equal: the sync is recorded as applied. Different
  and equal to an older version ``u``'s: the pool runs version ``u``'s weights (a stale buffer
  or an old checkpoint sent again); the run records a sync of version ``u`` (applied) and the
  push of ``v`` as not applied, so the staleness of the sequences that claim ``v`` is counted
  from ``u`` from this step on (``versions.py``) and ``MismatchStalenessHigh`` judges it. Equal
  to no version seen: the push of ``v`` is recorded as not applied (staleness from the version
  last applied) and the message names both fingerprints;
* either fingerprint alone, with nothing to compare it with, only records.

A difference is also a counted error of the run (``summary`` and the dashboard show its text)
at the step of the sync, not only at the first batch that claims ``v``: once per pool and
weights found (a pipeline that keeps sending the same stale buffer is one error; every push is
still an event). Fingerprints are
remembered in this process: a continued run compares a new push with the fingerprints given
since it started (a trainer gives ``trainer_fingerprint`` at every push, so the applied check
needs nothing older).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mismatch_monitor.batch import BatchError

SYNC_KINDS = ("weight_sync", "resync")


class WrongWeights(BatchError):
    """A pool's fingerprint after a sync is not the fingerprint of the version pushed."""


@dataclass(frozen=True)
class SyncResolution:
    """What to record for one sync: events ``(version, applied, message)`` in order, and the error."""

    events: tuple[tuple[int | None, bool, str], ...]
    error: WrongWeights | None = None


def check_fingerprint_call(kind: str, version: Any, fingerprint: Any, trainer_fingerprint: Any) -> None:
    for name, value in (("fingerprint", fingerprint), ("trainer_fingerprint", trainer_fingerprint)):
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise TypeError(f"expected {name} to be a non-empty str (weights_fingerprint(...)), got {value!r}")
        if kind not in SYNC_KINDS:
            raise ValueError(f"{name} describes a weight_sync or resync, got kind {kind!r}")
        if version is None:
            raise ValueError(f"{name} needs the version it is the fingerprint of, got version=None")


def _short(fp: str) -> str:
    return fp.removeprefix("sha256:")[:12]


class WeightFingerprints:
    """The trainer's fingerprint of each version given so far, and the comparison at each sync."""

    def __init__(self) -> None:
        self._of_version: dict[int, str] = {}
        self._reported: set[tuple[str | None, str]] = set()   # (pool, fingerprint found) told once

    def _once(self, pool: str | None, fingerprint: str, text: str) -> WrongWeights | None:
        if (pool, fingerprint) in self._reported:
            return None                       # the same weights again: the events still say so
        self._reported.add((pool, fingerprint))
        return WrongWeights(text + " (reported once per pool and weights found; the events table "
                                   "records every push)")

    def resolve(self, pool: str | None, version: int | None, applied: bool, message: str,
                fingerprint: str | None, trainer_fingerprint: str | None, step: int | None) -> SyncResolution:
        plain = SyncResolution(((version, applied, message),))
        if version is None:
            return plain
        if trainer_fingerprint is not None:
            self._of_version[version] = trainer_fingerprint     # the newest word of the trainer
        expected = self._of_version.get(version)
        if fingerprint is None or expected is None or fingerprint == expected or not applied:
            return plain
        where = "every pool" if pool is None else f"pool {pool!r}"
        at = "" if step is None else f" at step {step}"
        older = [v for v, fp in self._of_version.items() if fp == fingerprint and v != version]
        if older:
            held = max(older)
            text = (f"{where}: after the push of weight version {version}{at} the pool's weights have the "
                    f"fingerprint of version {held} ({_short(fingerprint)}), not of version {version} "
                    f"({_short(expected)}): the pool runs version {held}'s weights; its staleness is counted "
                    f"from version {held}")
            events = ((held, True, f"pool holds version {held}'s weights (fingerprint {_short(fingerprint)}) "
                                   f"after a push of version {version}"),
                      (version, False, message or "wrong weights loaded"))
            return SyncResolution(events, self._once(pool, fingerprint, text))
        text = (f"{where}: after the push of weight version {version}{at} the pool's weights have fingerprint "
                f"{_short(fingerprint)}, which is no version given in this run (version {version}: "
                f"{_short(expected)}); the push is recorded as not applied. If every push reads so, check that both "
                f"sides fingerprint the same form (the dtype and names sent over the wire)")
        return SyncResolution(((version, False, message or f"fingerprint {_short(fingerprint)} is no known version"),),
                              self._once(pool, fingerprint, text))
