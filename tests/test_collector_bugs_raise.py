"""A bug is not bad data: the collector raises a programming error in every mode, after keeping
its row in the run, while bad data and a failing environment are still counted and training goes on.

Before, a NameError inside the step's computation read as "step N was not recorded" on every
step of the run: a quiet dashboard with a counter, and the bug never surfaced.
"""

from __future__ import annotations

import re

import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector, collector as collector_module
from mismatch_monitor.collectors.errors import is_programming_error
from mismatch_monitor.batch import BatchError

from synthetic import make_batch


def _failing_engine(exc: Exception):
    real = collector_module.compute_stats_with_sequences
    calls = []

    def engine(batch, config, **kw):
        calls.append(1)
        if len(calls) == 2:                       # the second step meets the bug
            raise exc
        return real(batch, config, **kw)
    return engine


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("bug", [NameError("name 'tails' is not defined"),
                                 AttributeError("'NoneType' object has no attribute 'sum'"),
                                 TypeError("unsupported operand type(s) for +: 'Tensor' and 'str'")])
def test_a_programming_error_in_the_step_raises_and_is_kept_in_the_run(tmp_path, monkeypatch, strict, bug):
    monkeypatch.setattr(collector_module, "compute_stats_with_sequences", _failing_engine(bug))
    run = tmp_path / "r"
    with MismatchCollector(run, strict=strict, flush_every_steps=1) as mc:
        mc.log_step(0, make_batch(0))
        with pytest.raises(type(bug), match=re.escape(str(bug))):
            mc.log_step(1, make_batch(1))
    errors = query.collector_errors(query.connect(), run)         # in strict mode too
    assert errors[["step", "kind", "message"]].values.tolist() == [[1, type(bug).__name__, str(bug)]]
    assert "raised: a programming error" in errors["where"].iloc[0]
    assert query.steps_index(query.connect(), run)["step"].tolist() == [0]   # step 0 is kept


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access"),
                                 OSError(28, "No space left on device"),
                                 ValueError("could not convert")])
def test_an_environment_or_data_failure_is_still_counted_and_training_goes_on(tmp_path, monkeypatch, exc):
    monkeypatch.setattr(collector_module, "compute_stats_with_sequences", _failing_engine(exc))
    run = tmp_path / "r"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        for step in range(3):
            out = mc.log_step(step, make_batch(step))
    assert out["mismatch/collector_errors"] == 1 and "mismatch/k3_kl" in out
    errors = query.collector_errors(query.connect(), run)
    assert errors["where"].tolist() == ["step 1 was not recorded"]
    assert query.steps_index(query.connect(), run)["step"].tolist() == [0, 1, 2]


def test_a_bug_in_the_alert_evaluator_raises(tmp_path):
    class Evaluator:
        def observe(self, step, wall_time, by_pool, *, fleet=None):
            return by_pool.missing_field          # a bug: GroupMetrics has no such attribute

    with MismatchCollector(tmp_path / "r", alert_evaluator=Evaluator()) as mc:
        with pytest.raises(AttributeError, match="missing_field"):
            mc.log_step(0, make_batch(0))
    errors = query.collector_errors(query.connect(), tmp_path / "r")
    assert errors["kind"].tolist() == ["AttributeError"]


def test_an_evaluator_that_fails_at_run_time_is_counted(tmp_path):
    class Evaluator:
        def observe(self, step, wall_time, by_pool, *, fleet=None):
            raise RuntimeError("rules server unreachable")

    with MismatchCollector(tmp_path / "r") as mc:
        mc.alert_evaluator = Evaluator()
        out = mc.log_step(0, make_batch(0))
    assert out == {"mismatch/collector_errors": 1.0}


def test_bad_data_is_never_taken_for_a_bug():
    assert not is_programming_error(BatchError("shape mismatch"))
    assert is_programming_error(KeyError("pool"))
    assert not is_programming_error(RuntimeError("out of memory"))
    assert is_programming_error(RecursionError("maximum recursion depth exceeded"))


def test_odd_inputs_through_the_real_engine_are_never_taken_for_a_bug(tmp_path):
    """Odd data reaches the real engine: each is refused up front as a mistake in the call or
    counted as bad data, never raised as a bug from inside the computation."""
    t = -torch.rand(3, 5)
    ones = torch.ones(3, 5)
    cases = [dict(trainer_logprobs=t, sampler_logprobs=t[:, :4], response_mask=ones),
             dict(trainer_logprobs=t, sampler_logprobs=t, response_mask=ones, labels={"pool": ["a", None, 3]}),
             dict(trainer_logprobs=t, sampler_logprobs=t, response_mask=ones, turn_index=torch.full((3, 5), -2)),
             dict(trainer_logprobs=t, sampler_logprobs=t, response_mask=ones, policy_version=[1, 2]),
             dict(trainer_logprobs=t, sampler_logprobs=t, response_mask=ones, advantages=[1.0]),
             dict(trainer_logprobs=t, sampler_logprobs=t, response_mask=ones,
                  trainer_experts=torch.zeros(3, 5, 2, dtype=torch.int64)),
             dict(trainer_logprobs=t.to(torch.complex64), sampler_logprobs=t, response_mask=ones),
             dict(trainer_logprobs=t[:0], sampler_logprobs=t[:0], response_mask=ones[:0])]
    raised = []
    with MismatchCollector(tmp_path / "r") as mc:
        for step, fields in enumerate(cases):
            try:
                mc.log_step(step, **fields)
            except Exception as exc:              # noqa: BLE001 - which of the two it was is checked below
                raised.append((step, exc))
    errors = query.collector_errors(query.connect(), tmp_path / "r")
    bugs = errors[errors["where"].str.contains("programming error")]
    assert bugs.empty, bugs[["step", "kind", "message"]].values.tolist()
    assert raised == []
    assert sorted(errors["step"]) == [0, 2, 3, 4, 5, 6]   # a label 3 is the text "3"; an empty batch is fine


def test_a_rank_with_a_bug_joins_the_reduction_before_it_raises(tmp_path, monkeypatch):
    """With several ranks a rank that raised at once would leave the others waiting in the
    collective: it joins the step's reduction with nothing (and its error), then raises."""
    class Reducer:
        is_writer = True

        def __init__(self):
            self.calls = []

        def __call__(self, stats, exemplars, *, step, error):
            self.calls.append((step, type(error).__name__ if error is not None else None))
            return stats, exemplars

    monkeypatch.setattr(collector_module, "compute_stats_with_sequences",
                        _failing_engine(KeyError("pool")))
    reducer = Reducer()
    with MismatchCollector(tmp_path / "r", reducer=reducer, alert_evaluator=None) as mc:
        mc.log_step(0, make_batch(0))
        with pytest.raises(KeyError, match="pool"):
            mc.log_step(1, make_batch(1))
    assert reducer.calls == [(0, None), (1, "KeyError")]
