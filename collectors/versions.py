"""Weight versions as the run's sync events say they were applied, for honest staleness.

A pipeline can bump a pool's version counter while the new weights never reach the engine (a
push that failed or timed out, an update the engine dropped). Its batches then claim the new
version, and staleness (trainer version - policy version) reads 0 for weights that are really
old. A trainer that knows a push did not land says so: ``log_event("weight_sync", pool=p,
version=v, applied=False)``. From that event's step on, sequences of pool ``p`` that claim a
version pushed but not applied are counted at the version last applied to the pool (a
``weight_sync`` or ``resync`` with ``applied=True``, the default), and the batch is reported
as a counted error naming both versions, once per pool and claimed version. Claims of versions
no event mentions are left as they are: the collector corrects only what it was told.

Stored: such an event's message starts with :data:`NOT_APPLIED`, so a restarted run rebuilds
the same bookkeeping from its ``events`` table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd
import torch

from mismatch_monitor.batch import BatchError, TokenBatch

NOT_APPLIED = "weights not applied"


class VersionNotApplied(BatchError):
    """Sequences claimed a weight version whose push was recorded as not applied."""


def not_applied_message(message: str) -> str:
    return f"{NOT_APPLIED}: {message}" if message else NOT_APPLIED


class WeightVersions:
    """Per pool (None: every pool), the weight version last applied and the versions pushed
    since without being applied, each from the step its event takes effect."""

    def __init__(self) -> None:
        self._events: list[tuple[int, str | None, int, bool]] = []   # (step, pool, version, applied)
        self._reported: set[tuple[str | None, int]] = set()

    def add(self, step: int, pool: str | None, version: int | None, applied: bool) -> None:
        if version is not None:
            self._events.append((step, pool, version, applied))

    def replay(self, events: pd.DataFrame) -> None:
        """The sync events a continued run stored (``query.events.run_events``), in their order."""
        syncs = events[events["kind"].isin(["weight_sync", "resync"]) & events["version"].notna()]
        for row in syncs.itertuples(index=False):
            self.add(int(row.step), None if pd.isna(row.pool) else str(row.pool), int(row.version),
                     not str(row.message).startswith(NOT_APPLIED))

    def state(self, pool: str | None, step: int) -> tuple[int | None, set[int]]:
        """(the version last applied to ``pool``, versions pushed to it since and not applied)
        by the events in effect at ``step``."""
        applied, pending = None, set()
        for at, target, version, ok in self._events:
            if at > step or (target is not None and target != pool):
                continue
            if ok:
                applied, pending = version, set()
            else:
                pending.add(version)
        return applied, pending

    def correct(self, batch: TokenBatch, step: int) -> tuple[TokenBatch, list[VersionNotApplied]]:
        """``batch`` with the claims of not-applied versions replaced by the version applied."""
        claimed = batch.policy_version
        if claimed is None or not self._events:
            return batch, []
        pools = batch.labels.get("pool") or (None,) * batch.num_sequences
        corrected, errors = claimed.clone(), []
        for pool in dict.fromkeys(pools):
            applied, pending = self.state(pool, step)
            if applied is None or not pending:
                continue
            rows = torch.tensor([p == pool for p in pools], device=claimed.device)
            for version in sorted(pending):
                hit = rows & (claimed == version)
                n = int(hit.sum())
                if not n:
                    continue
                corrected[hit] = applied
                if (pool, version) not in self._reported:
                    self._reported.add((pool, version))
                    where = "every pool" if pool is None else f"pool {pool!r}"
                    errors.append(VersionNotApplied(
                        f"{where}: {n} sequence(s) at step {step} claim weight version {version}, whose push was "
                        f"recorded as not applied; the weights last applied are version {applied}, so their "
                        f"staleness is counted from version {applied} (reported once per pool and version)"))
        if not errors and torch.equal(corrected, claimed):
            return batch, []
        return dataclasses.replace(batch, policy_version=corrected), errors


def event_applied(kind: str, applied: Any) -> bool:
    """``applied`` checked: a bool, and False only for a weight sync or resync."""
    if not isinstance(applied, bool):
        raise TypeError(f"expected applied to be a bool, got {type(applied).__name__} {applied!r}")
    if not applied and kind not in ("weight_sync", "resync"):
        raise ValueError(f"applied=False describes a weight_sync or resync, got kind {kind!r}")
    return applied
