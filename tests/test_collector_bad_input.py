"""Bad input through the collector: never raised by default, counted, logged once; strict raises."""

from __future__ import annotations

import logging

import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.batch import BatchError
from mismatch_monitor.collectors import MismatchCollector

from synthetic import make_batch


def _bad_fields():
    t = -torch.rand(4, 6)
    return dict(trainer_logprobs=t, sampler_logprobs=t[:, :5], response_mask=torch.ones(4, 6))


def test_default_mode_counts_and_logs_once(tmp_path, caplog):
    run = tmp_path / "r"
    with caplog.at_level(logging.ERROR, logger="mismatch_monitor"):
        with MismatchCollector(run, flush_every_steps=1) as mc:
            assert mc.log_step(0, make_batch(0))["mismatch/collector_errors"] == 0
            r1 = mc.log_step(1, **_bad_fields())
            r2 = mc.log_step(2, **_bad_fields())
            r3 = mc.log_step(3, make_batch(3))
    assert r1 == {"mismatch/collector_errors": 1.0}
    assert r2 == {"mismatch/collector_errors": 2.0}
    assert r3["mismatch/collector_errors"] == 2.0 and "mismatch/k3_kl" in r3
    records = [r for r in caplog.records if "was not recorded" in r.getMessage()]
    assert len(records) == 1                              # the same error is logged once
    assert "shape mismatch: trainer_logprobs (4, 6) vs sampler_logprobs (4, 5)" in records[0].getMessage()
    assert mc.errors_by_kind == {"BatchError": 2}
    idx = query.steps_index(query.connect(), run)
    assert idx["step"].tolist() == [0, 1, 2, 3]           # failed steps are recorded, empty
    assert idx["collector_errors"].tolist() == [0, 1, 2, 2]
    assert idx["n_tokens"].tolist()[1:3] == [0, 0]


def test_strict_mode_raises_the_same_message(tmp_path):
    with MismatchCollector(tmp_path / "r", strict=True) as mc:
        with pytest.raises(BatchError, match=r"shape mismatch: trainer_logprobs \(4, 6\) vs sampler_logprobs \(4, 5\)"):
            mc.log_step(0, **_bad_fields())


@pytest.mark.parametrize("make, kind", [
    (lambda: dict(trainer_logprobs=torch.zeros(3, 4, dtype=torch.int64),
                  sampler_logprobs=torch.zeros(3, 4), response_mask=torch.ones(3, 4)), "BatchError"),
    (lambda: dict(trainer_logprobs=-torch.rand(3, 4), sampler_logprobs=-torch.rand(3, 4),
                  response_mask=torch.ones(3, 4), labels={"pool": ["a", "b"]}), "BatchError"),
])
def test_other_bad_inputs_are_counted(tmp_path, make, kind):
    with MismatchCollector(tmp_path / "r") as mc:
        out = mc.log_step(0, **make())
    assert out["mismatch/collector_errors"] == 1 and mc.errors_by_kind == {kind: 1}


def test_nonfinite_logprobs_are_a_data_quality_count_not_an_error(tmp_path):
    t = -torch.rand(4, 8, dtype=torch.float64)
    s = t + 1e-3
    t[0, 0] = float("nan")
    s[1, 2] = float("-inf")
    s[2, 3] = 0.5                                          # a log-prob above 0
    with MismatchCollector(tmp_path / "r") as mc:
        out = mc.log_step(0, trainer_logprobs=t, sampler_logprobs=s, response_mask=torch.ones(4, 8))
    assert out["mismatch/collector_errors"] == 0
    assert out["mismatch/data_quality/nonfinite_tokens"] == 2
    assert out["mismatch/data_quality/positive_logprob_tokens"] == 1
    assert out["mismatch/n_tokens"] == 29
    assert out["mismatch/k1_kl"] == pytest.approx(1e-3, rel=1e-9)   # not poisoned by the NaN


def test_failing_callbacks_never_break_training(tmp_path):
    class Event:
        state, resync, pool = "firing", True, "fp8"

        def to_row(self):
            return {"step": 1, "alert": "LowESS", "state": "firing", "pool": "fp8"}

    class Evaluator:
        def observe(self, step, wall_time, by_pool, *, fleet=None):
            return [Event()] if step == 1 else []

    calls = []
    with MismatchCollector(tmp_path / "r", alert_evaluator=Evaluator(), flush_every_steps=1) as mc:
        mc.on_resync(lambda e: calls.append(e.pool))
        mc.on_resync(lambda e: 1 / 0)
        for s in range(3):
            out = mc.log_step(s, make_batch(s))
    assert calls == ["fp8"]                                # once per firing, not every step
    assert out["mismatch/collector_errors"] == 1 and mc.errors_by_kind == {"ZeroDivisionError": 1}
    alerts = query.rows(query.connect(), tmp_path / "r", "alerts")
    assert alerts["alert"].tolist() == ["LowESS"] and alerts["step"].tolist() == [1]


def test_an_overflowing_weight_gives_a_tiny_ess_not_null(tmp_path):
    """rho = exp(400) overflows rho^2 (and exp(800) rho itself): ESS is then ~1/n, and the
    low-ESS resync alert must still fire rather than read a null."""
    resyncs = []
    for huge in (400.0, 800.0):
        t = torch.full((2, 50), -1.0, dtype=torch.float64)
        s = t - 1e-3
        s[0, 0] = -huge - 1.0                                # a token the sampler thought impossible
        with MismatchCollector(tmp_path / f"r{huge}", flush_every_steps=1) as mc:
            mc.on_resync(lambda e: resyncs.append(e.alert))
            for step in range(2):                            # the alert holds for one step first
                out = mc.log_step(step, trainer_logprobs=t, sampler_logprobs=s,
                                  response_mask=torch.ones(2, 50), labels={"pool": ["a", "a"]})
        assert out["mismatch/ess"] == pytest.approx(1 / 100, rel=1e-12)
        assert out["mismatch/pool=a/ess"] == pytest.approx(1 / 100, rel=1e-12)
    assert resyncs == ["MismatchLowESS", "MismatchLowESS"]
