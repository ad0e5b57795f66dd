"""The collector evaluates the project's alert rules by default and hands resyncs to the trainer."""

from __future__ import annotations

import torch

from mismatch_monitor import query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector


def _batch(step: int, stale_scale: float) -> TokenBatch:
    """Two pools; the 'async' pool's log ratios widen with ``stale_scale`` (lag feeds back)."""
    g = torch.Generator().manual_seed(step)
    B, T = 16, 32
    trainer = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.01
    width = torch.tensor([1e-3 if i % 2 == 0 else stale_scale for i in range(B)], dtype=torch.float64)
    sampler = (trainer - torch.randn(B, T, generator=g, dtype=torch.float64) * width[:, None]).clamp(max=0)
    return TokenBatch.from_padded(trainer, sampler, torch.ones(B, T, dtype=torch.bool),
                                  labels={"pool": ["sync" if i % 2 == 0 else "async" for i in range(B)]})


def test_low_ess_fires_once_resyncs_once_and_clears(tmp_path):
    run = tmp_path / "run"
    resyncs, events = [], []
    # healthy, then the async pool degrades for 8 steps, then it is resynced and healthy again
    scales = [1e-3] * 6 + [2.0] * 8 + [1e-3] * 6
    with MismatchCollector(run, flush_every_steps=5) as mc:
        mc.on_resync(lambda e: resyncs.append((e.step, e.pool)))
        mc.on_alert(lambda e: events.append((e.alert, e.pool, e.state, e.step)))
        for step, scale in enumerate(scales):
            report = mc.log_step(step, _batch(step, scale))
            if 6 <= step < 14:
                assert report["mismatch/pool=async/ess"] < 0.5
    low_ess = [e for e in events if e[0] == "MismatchLowESS"]
    assert [e[1:3] for e in low_ess] == [("async", "firing"), ("async", "resolved")]
    assert 6 <= low_ess[0][3] < 14 and low_ess[1][3] == 14
    # one request, at the incident's second step: the step-jump gate holds two steps and LowESS
    # fires the same step; the two ask once between them
    jump = [e for e in events if e[0] == "MismatchStepJump" and e[2] == "firing"]
    assert [(e[3], e[1]) for e in jump] == [(7, "async")]
    assert resyncs == [(7, "async")]
    stored = query.rows(query.connect(), run, "alerts")
    assert ("MismatchLowESS", "async", "firing") in set(zip(stored["alert"], stored["pool"], stored["state"]))
    assert "sync" not in set(stored.loc[stored["alert"] == "MismatchLowESS", "pool"])


def test_restart_replays_history_and_keeps_a_firing_alert_without_a_second_resync(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        for step in range(10):
            mc.log_step(step, _batch(step, 1e-3 if step < 6 else 2.0))
    first = query.rows(query.connect(), run, "alerts")
    assert "MismatchLowESS" in set(first["alert"])
    resyncs = []
    with MismatchCollector(run, flush_every_steps=1) as mc:
        mc.on_resync(lambda e: resyncs.append(e.step))
        for step in range(10, 12):
            mc.log_step(step, _batch(step, 2.0))
    assert resyncs == []                                    # still the same firing
    assert any(a.alert == "MismatchLowESS" for a in mc.alert_evaluator.firing())


def test_the_default_evaluator_reads_the_pools_precision_and_engine_for_expected_levels(tmp_path):
    from mismatch_monitor.expected_levels import expected_level

    pools = {"async": {"precision": "fp8_e4m3", "engine": "transformers/sdpa"}, "sync": {"precision": "bf16"}}
    events = []
    with MismatchCollector(tmp_path / "run", pools=pools, flush_every_steps=5) as mc:
        mc.on_alert(events.append)
        for step in range(10):
            mc.log_step(step, _batch(step, 1e-3 if step < 6 else 2.0))
    jump = next(e for e in events if e.alert == "MismatchStepJump")
    level = expected_level("mismatch/k3_kl", "fp8_e4m3", "transformers/sdpa")
    assert level is not None and f"x its expected healthy level for fp8_e4m3 on {level.engine})" in jump.summary
