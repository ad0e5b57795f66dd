"""The project's simulator through a collector: each step's batch, the weight syncs and resyncs
its pools performed, and its training outcomes, all in the run.

    recorder = SimulationRecorder(collector, sim)
    for out in sim.run(steps):
        recorder.record(out)

A pool syncs at the start of a step, before it samples, so its event takes that step (the first
step whose batches come after it). What is recorded is what the trainer knows: the version it
pushed to a pool. A fault that corrupts a push (wrong weights, a prefix cache left stale) is
recorded as the ordinary sync it looks like, so the monitor has to find it in the mismatch; a
pipeline that stopped syncing pushes nothing and records nothing. ``fingerprints=True`` models
a pipeline that checks its pushes: each sync also gives the fingerprint of the weights the
pool was sent and of the version the trainer meant (``mismatch_monitor.fingerprint``), so a
wrong-weights push is found at its sync step (``collectors/fingerprints.py``).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from ..sim.simulation import Simulation, SimStep


class Collector(Protocol):
    def log_step(self, step: int, batch: Any = None, **fields: Any) -> dict[str, float]: ...

    def log_event(self, kind: str, *, step: int | None = None, pool: str | None = None,
                  version: int | None = None, message: str = "", fingerprint: str | None = None,
                  trainer_fingerprint: str | None = None) -> None: ...

    def log_outcomes(self, step: int, values: Mapping[str, float], *, pool: str | None = None) -> None: ...


# the simulator's sync kinds (``Simulation._sync``) as run events; the others push nothing
_EVENT_OF = {"sync": "weight_sync", "sync_wrong_weights": "weight_sync", "sync_no_cache_reset": "weight_sync",
             "sync_wrong_weights_no_cache_reset": "weight_sync", "resync": "resync"}


class SimulationRecorder:
    def __init__(self, collector: Collector, sim: Simulation, *, fingerprints: bool = False) -> None:
        self.collector = collector
        self.sim = sim
        self.fingerprints = fingerprints
        self._forwarded = 0                      # sync events of ``sim.sync_events`` recorded so far

    def _fingerprints(self, sync: Mapping[str, Any]) -> dict[str, Any]:
        if not self.fingerprints:
            return {}
        return {"fingerprint": sync.get("fingerprint"), "trainer_fingerprint": sync.get("trainer_fingerprint")}

    def record(self, out: SimStep) -> dict[str, float]:
        """Record one step: its pools' syncs, its batch (the report of ``log_step``), its outcomes."""
        events = self.sim.sync_events
        for sync in events[self._forwarded:]:
            kind = _EVENT_OF.get(str(sync["kind"]))
            if kind is not None:
                self.collector.log_event(kind, step=int(sync["step"]), pool=str(sync["pool"]),
                                         version=int(sync["version"]), message="weights pushed by the trainer",
                                         **self._fingerprints(sync))
        self._forwarded = len(events)
        report = self.collector.log_step(out.step, out.batch)
        values = {"reward": out.reward_mean, "loss": out.loss, "grad_norm": out.grad_norm, "entropy": out.entropy}
        eval_reward = getattr(out, "eval_reward", None)
        if eval_reward is not None:
            values["eval_reward"] = eval_reward
        self.collector.log_outcomes(out.step, values)
        for pool, reward in out.reward_by_pool.items():
            self.collector.log_outcomes(out.step, {"reward": reward}, pool=pool)
        return report
