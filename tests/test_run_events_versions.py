"""Honest staleness when a version was bumped but the weights never landed (``collectors/versions.py``).

A pool's pipeline bumps its version counter every step; from step 3 its pushes fail and the
trainer says so (``weight_sync`` with ``applied=False``). Its batches still claim the new
versions: without the events staleness would read 0. Checked through the stored statistics
(``mismatch/staleness/max`` read by DuckDB), the counted errors, and a restarted run that
rebuilds the same bookkeeping from its ``events`` table.
"""

from __future__ import annotations

import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.query.events import run_events

POOLS = ("bf16", "fp8")


def batch(step: int, claims: dict[str, int]) -> TokenBatch:
    """Four sequences per pool, each claiming its pool's version; trainer version = step."""
    g = torch.Generator().manual_seed(step)
    mu = -(1.0 + torch.rand(8, 16, generator=g, dtype=torch.float64))
    pools = [POOLS[i // 4] for i in range(8)]
    return TokenBatch.from_padded(mu + 0.01 * torch.randn(8, 16, generator=g, dtype=torch.float64), mu,
                                  torch.ones(8, 16), labels={"pool": pools},
                                  policy_version=[claims[p] for p in pools], trainer_version=step)


def staleness(run) -> dict[tuple[str, int], float]:
    series = query.metric_series(query.connect(), run, ["pool"], metrics=["mismatch/staleness/max"])
    return {(p, int(s)): float(v) for s, p, v in series[["step", "pool", "mismatch/staleness/max"]].values}


def test_claims_of_versions_not_applied_count_from_the_version_applied(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        for step in range(6):
            # the pipeline pushes the trainer's weights at the start of every step; from step 3 on
            # fp8's pushes fail, and the trainer knows it
            mc.log_event("weight_sync", step=step, pool="bf16", version=step)
            mc.log_event("weight_sync", step=step, pool="fp8", version=step, applied=step < 3,
                         message="" if step < 3 else "update_weights timed out")
            mc.log_step(step, batch(step, {"bf16": step, "fp8": step}))       # both claim the new version
            mc.log_step(step + 100, batch(step + 100, {"bf16": step + 100, "fp8": step + 100}))  # never pushed
        assert mc.errors_by_kind == {"VersionNotApplied": 3}
    got = staleness(run)
    assert [got[("bf16", s)] for s in range(6)] == [0.0] * 6
    assert [got[("fp8", s)] for s in range(6)] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]    # from version 2
    assert all(got[("fp8", s + 100)] == 0.0 for s in range(6))   # a version no event names: as claimed
    errors = query.collector_errors(query.connect(), run).sort_values("step")
    assert errors["step"].tolist() == [3, 4, 5]
    assert ("pool 'fp8': 4 sequence(s) at step 3 claim weight version 3, whose push was recorded as not applied; "
            "the weights last applied are version 2") in errors["message"].iloc[0]
    stored = run_events(query.connect(), run)
    fp8 = stored[stored["pool"] == "fp8"]
    assert fp8["message"].tolist()[3:] == ["weights not applied: update_weights timed out"] * 3

    # a restart rebuilds what was applied from the stored events; a push that lands ends it
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_step(6, batch(6, {"bf16": 6, "fp8": 5}))
        mc.log_event("weight_sync", step=7, pool="fp8", version=7)
        mc.log_step(7, batch(7, {"bf16": 7, "fp8": 7}))
        mc.log_step(8, batch(8, {"bf16": 8, "fp8": 5}))                    # 5 is older than what landed
    got = staleness(run)
    assert (got[("fp8", 6)], got[("fp8", 7)], got[("fp8", 8)]) == (4.0, 0.0, 3.0)


def test_every_pool_event_and_unlabelled_batches(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_event("weight_sync", step=0, version=0)                     # every pool
        mc.log_event("weight_sync", step=1, version=1, applied=False)
        b = batch(1, {"bf16": 1, "fp8": 1})
        unlabelled = TokenBatch.from_padded(b.trainer_logprobs.view(8, 16), b.sampler_logprobs.view(8, 16),
                                            torch.ones(8, 16), policy_version=[1] * 8, trainer_version=1)
        mc.log_step(1, unlabelled)
        mc.log_step(2, batch(2, {"bf16": 1, "fp8": 1}))
    got = query.metric_series(query.connect(), run, metrics=["mismatch/staleness/max"])
    assert got["mismatch/staleness/max"].tolist() == [1.0, 2.0]             # both counted from version 0


def test_mistakes_in_applied_raise(tmp_path):
    with MismatchCollector(tmp_path / "run", alert_evaluator=None) as mc:
        with pytest.raises(TypeError, match="expected applied to be a bool"):
            mc.log_event("weight_sync", version=1, applied="no")
        with pytest.raises(ValueError, match="a weight_sync or resync, got kind 'resume'"):
            mc.log_event("resume", applied=False)
