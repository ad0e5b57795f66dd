"""The plain step hook (the adapter for any custom loop) and micro-batch concatenation.

Splitting a step into micro-batches and concatenating them back must give exactly the step's
statistics; a bad micro-batch must become a recorded collector error, not a crash (unless
strict). Uses the real collector and reads its Parquet back with DuckDB. Runtime: ~3 s.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_monitor.batch import BatchError, TokenBatch
from mismatch_monitor.collectors.collector import MismatchCollector
from mismatch_monitor.collectors.step_hook import StepHook, concat_batches
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine.fields import TABLES

torch.set_num_threads(1)


def padded(seed: int, B: int = 7, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    mu = -torch.rand(B, T, generator=g) * 4
    pi = (mu + torch.randn(B, T, generator=g) * 0.3).clamp(max=0)
    return dict(trainer_logprobs=pi, sampler_logprobs=mu, response_mask=mask,
                labels={"pool": [f"p{i % 3}" for i in range(B)]},
                turn_index=torch.arange(T).repeat(B, 1) // 5,
                policy_version=torch.randint(0, 4, (B,), generator=g), trainer_version=4,
                advantages=torch.randn(B, generator=g), token_ids=torch.randint(0, 50, (B, T), generator=g))


def rows(fields: dict, lo: int, hi: int) -> dict:
    out = {}
    for k, v in fields.items():
        if k == "labels":
            out[k] = {d: vals[lo:hi] for d, vals in v.items()}
        elif isinstance(v, torch.Tensor):
            out[k] = v[lo:hi]
        else:
            out[k] = v
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 6), max_size=4, unique=True))
def test_concatenated_micro_batches_are_the_step(seed, cuts):
    fields = padded(seed)
    bounds = [0] + sorted(cuts) + [7]
    parts = [TokenBatch.from_padded(**rows(fields, lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    whole = TokenBatch.from_padded(**fields)
    joined = concat_batches(parts)
    for name in ("trainer_logprobs", "sampler_logprobs", "seq_index", "position", "turn_index",
                 "policy_version", "advantages", "token_ids"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert joined.labels == whole.labels and joined.num_sequences == whole.num_sequences
    got, want = compute_stats(joined), compute_stats(whole)
    for table in TABLES:
        assert got[table].equals(want[table]), table


def test_staleness_survives_micro_batches_scored_at_different_versions():
    a = TokenBatch.from_padded(**{**rows(padded(1), 0, 3), "trainer_version": 4})
    b = TokenBatch.from_padded(**{**rows(padded(1), 3, 7), "policy_version": torch.tensor([5, 6, 6, 7]),
                                  "trainer_version": 7})
    joined = concat_batches([a, b])
    staleness = joined.trainer_version - joined.policy_version
    expected = torch.cat([4 - a.policy_version, 7 - b.policy_version])
    assert torch.equal(staleness, expected)


def test_micro_batches_must_agree_on_fields():
    a = TokenBatch.from_padded(**rows(padded(2), 0, 3))
    no_turns = rows(padded(2), 3, 7)
    del no_turns["turn_index"]
    b = TokenBatch.from_padded(**no_turns)
    with pytest.raises(BatchError, match="turn_index in every micro-batch or in none"):
        concat_batches([a, b])
    other_labels = TokenBatch.from_padded(**{**rows(padded(2), 3, 7), "labels": {"env": ["e"] * 4}})
    with pytest.raises(BatchError, match="same label dimensions"):
        concat_batches([a, other_labels])


def steps_table(run_dir):
    files = sorted(str(p) for p in (run_dir / "steps").glob("*.parquet"))
    return duckdb.connect().execute(
        "SELECT step, n_tokens, collector_errors FROM read_parquet($f) ORDER BY step", {"f": files}).fetchall()


def test_hook_logs_one_step_per_optimizer_step(tmp_path):
    with MismatchCollector(tmp_path / "run", flush_every_steps=1) as collector:
        hook = StepHook(collector)
        assert hook.end_step(0) == {}                          # nothing added: nothing logged
        fields = padded(3)
        hook.add(**rows(fields, 0, 4))
        hook.add(TokenBatch.from_padded(**rows(fields, 4, 7)))
        assert hook.pending == 2
        report = hook.end_step(1)
        n = int(fields["response_mask"].sum())
        assert report["mismatch/n_tokens"] == n and hook.pending == 0
        lr = (fields["trainer_logprobs"].double() - fields["sampler_logprobs"].double())[fields["response_mask"]].numpy()
        np.testing.assert_allclose(report["mismatch/k3_kl"], np.mean(np.expm1(lr) - lr), rtol=1e-5)
        assert hook.log(2, **padded(4))["mismatch/n_tokens"] == int(padded(4)["response_mask"].sum())
    assert steps_table(tmp_path / "run") == [(1, n, 0), (2, int(padded(4)["response_mask"].sum()), 0)]


def test_a_bad_micro_batch_is_recorded_by_the_collector_not_raised(tmp_path):
    with MismatchCollector(tmp_path / "run", flush_every_steps=1) as collector:
        hook = StepHook(collector)
        good = rows(padded(5), 0, 4)
        bad = {**rows(padded(5), 4, 7), "sampler_logprobs": torch.zeros(2, 3)}   # wrong shape
        hook.add(**good)
        hook.add(**bad)
        report = hook.end_step(9)
        assert report == {"mismatch/collector_errors": 1.0}
        assert "shape mismatch" in collector.last_error
    assert steps_table(tmp_path / "run") == [(9, 0, 1)]


def test_strict_hooks_raise(tmp_path):
    with MismatchCollector(tmp_path / "run", strict=True) as collector:
        hook = StepHook(collector)
        with pytest.raises(BatchError, match="shape mismatch"):
            hook.add(**{**padded(6), "sampler_logprobs": torch.zeros(1)})
    lenient = StepHook(MismatchCollector(tmp_path / "run2"), strict=False)
    a = TokenBatch.from_padded(**rows(padded(7), 0, 3))
    b = TokenBatch.from_padded(**{**rows(padded(7), 3, 7), "labels": {"env": ["e"] * 4}})
    lenient.add(a)
    lenient.add(b)
    assert lenient.end_step(3) == {"mismatch/step_hook_errors": 1.0}
    lenient.collector.close()
