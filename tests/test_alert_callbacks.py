"""Alert callbacks through the real collector: a resync callback runs once per firing, not every
step; a failing callback never breaks training; events land in the run's ``alerts`` table.

Runtime: about 3 s.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.exporter import MismatchExporter

# steps at which pool fp8's ratios collapse (ESS ~ 0.37): two separate incidents
COLLAPSED = {3, 4, 5, 6, 9, 10, 11}


def batch(step: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(step)
    mu = -(8.0 + 3.0 * torch.rand(8, 64, generator=gen, dtype=torch.float64))
    fp8 = 1.0 if step in COLLAPSED else 0.05
    noise = torch.tensor([0.03] * 4 + [fp8] * 4, dtype=torch.float64)[:, None]
    return TokenBatch.from_padded(mu + noise * torch.randn(8, 64, generator=gen, dtype=torch.float64), mu,
                                  torch.ones(8, 64), labels={"pool": ["bf16"] * 4 + ["fp8"] * 4})


def test_resync_once_per_firing_and_failing_callbacks_are_contained(tmp_path, caplog):
    exporter = MismatchExporter()
    resyncs: list[Any] = []
    alerts: list[Any] = []
    reports = []
    with caplog.at_level(logging.ERROR, logger="mismatch_monitor"):
        with MismatchCollector(tmp_path / "run", alert_evaluator=AlertEvaluator(), exporter=exporter,
                               flush_every_steps=3) as mc:
            @mc.on_alert
            def broken(event: Any) -> None:
                alerts.append(event)
                raise RuntimeError("pager is down")

            mc.on_resync(resyncs.append)

            @mc.on_resync
            def also_broken(event: Any) -> None:
                raise ValueError("resync service unreachable")

            for step in range(14):
                reports.append(mc.log_step(step, batch(step)))
    # the collapse (steps 3-6 and 9-11) holds MismatchLowESS and MismatchStepJump two steps each: both
    # fire at 4 and at 10 for fp8, and each time one resync is asked (one request per pool and step,
    # by the first rule that asks); each collapse ends within the 3-step watch, so each request helped
    assert [(e.step, e.pool, e.since_step, e.alert) for e in resyncs] == [(4, "fp8", 3, "MismatchLowESS"),
                                                                         (10, "fp8", 9, "MismatchLowESS")]
    jumps = [e for e in alerts if e.alert == "MismatchStepJump"]
    assert [(e.step, e.state, e.resync) for e in jumps] == [(4, "firing", False), (7, "resolved", False),
                                                            (10, "firing", False), (12, "resolved", False)]
    low_ess = [e for e in alerts if e.alert == "MismatchLowESS"]
    assert [(e.step, e.state) for e in low_ess] == [(4, "firing"), (7, "resolved"), (10, "firing"),
                                                    (12, "resolved")]
    # training went on: every step has its metrics; the failures were counted and logged
    assert all("mismatch/pool=fp8/ess" in r for r in reports)
    assert mc.errors_by_kind == {"RuntimeError": len(alerts), "ValueError": len(resyncs)}
    assert any("pager is down" in r.getMessage() for r in caplog.records)
    assert exporter.registry.get_sample_value("mismatch_resyncs_total", {"pool": "fp8"}) == 2

    every = query.rows(query.connect(), tmp_path / "run", "alerts")
    stored = every[every["alert"] == "MismatchLowESS"]
    assert stored[["step", "alert", "pool", "state", "resync"]].values.tolist() == [
        [4, "MismatchLowESS", "fp8", "firing", True], [7, "MismatchLowESS", "fp8", "resolved", False],
        [10, "MismatchLowESS", "fp8", "firing", True], [12, "MismatchLowESS", "fp8", "resolved", False]]
    assert every.loc[every["resync"], "summary"].tolist() == [e.summary for e in resyncs]
