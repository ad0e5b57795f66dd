"""What the collector talks to, as protocols, and its default alert evaluator.

Each is passed in (``MismatchCollector(reducer=..., alert_evaluator=..., exporter=...)``) with a
sensible default, so a test or a framework can put its own in.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import pandas as pd

from .. import query
from ..alerts import AlertEvaluator
from ..engine import MismatchStats
from ..metrics import GroupMetrics
from ..store.runinfo import read_run_info


class Reducer(Protocol):
    """Combines per-rank statistics into the global view (see ``collectors/distributed.py``)."""

    is_writer: bool

    def __call__(self, stats: MismatchStats, exemplars: dict[str, pd.DataFrame], *, step: int | None,
                 error: BaseException | None) -> tuple[MismatchStats, dict[str, pd.DataFrame]]: ...


class Evaluator(Protocol):
    """``by_pool``/``fleet``: :class:`GroupMetrics` (``.to_frame()`` gives the frame of
    ``metrics.report``). An evaluator may also define ``observe_event(row)``: the collector then
    hands it every event row it stores (``store/event_log.EVENT_COLUMNS``: weight syncs,
    resumes, resyncs, resync requests) as it stores them, and ``set_pools(pools)``: the collector
    then hands it its ``pools`` (``run.json``'s metadata: expected levels, declared bounds)."""

    def observe(self, step: int, wall_time: float, by_pool: GroupMetrics, *,
                fleet: GroupMetrics | None = None) -> list[Any]: ...


class Exporter(Protocol):
    def observe(self, step: int, stats: MismatchStats) -> None: ...

    def count_resync(self, pool: str | None) -> None: ...


def default_evaluator(run_dir: os.PathLike[str]) -> Evaluator:
    """The project's alert rules; a restarted run first replays its stored history, so an alert
    that was firing stays firing (and does not ask for a second resync)."""
    con = query.connect()
    pools = read_run_info(run_dir)["pools"]   # precision and engine: each firing's "x times its expected level"
    steps = query.steps_index(con, run_dir)["step"]   # steps without observations resolve alerts too
    if steps.empty:
        return AlertEvaluator(pools=pools)
    history = query.metric_series(con, run_dir, ["pool"])
    fleet = query.metric_series(con, run_dir)
    evaluator, _ = AlertEvaluator.replay(history, fleet_history=fleet, steps=steps, pools=pools)
    return evaluator
