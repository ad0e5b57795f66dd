"""Which weights a pool holds after a sync (``mismatch_monitor/fingerprint.py``,
``collectors/fingerprints.py``).

* the fingerprint: the same for the same named tensors in any order, layout or grad state;
  different for another dtype, shape, name or value at a position it reads; its stated blind
  spot (a change between the positions it reads) is real, and ``sample=None`` closes it;
* through the collector: a push whose fingerprint is the version's is one applied event; one
  that carries an older version's weights records that version as applied and the push as
  not, so staleness (read back by DuckDB) counts from the older version, with one counted
  error; weights of no known version leave the push not applied; strict mode raises after
  recording; a mistake in the call raises;
* the simulator's wrong-weights fault (the pool is sent the warm-start weights from step 3)
  through the demo's wiring (``benchmarks/bench_fingerprints.py``'s run): with fingerprints the pool's staleness is counted from version 0
  from the sync step and ``MismatchStalenessHigh`` fires on it; without, staleness reads 0.

Runtime: about 20 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.collectors.fingerprints import WrongWeights
from mismatch_monitor.fingerprint import Fingerprint, fingerprinted, weights_fingerprint
from mismatch_monitor.query.events import run_events


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(100, 100, generator=g), "head.bias": torch.randn(7, generator=g),
            "layers.0.mask": torch.rand(5, generator=g) > 0.5}


def test_the_same_named_tensors_give_the_same_fingerprint_in_any_order_or_layout():
    a = state(0)
    fp = weights_fingerprint(a)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    assert weights_fingerprint(dict(reversed(list(a.items())))) == fp
    assert weights_fingerprint(list(a.items())) == fp
    as_params = {k: torch.nn.Parameter(v.clone(), requires_grad=v.is_floating_point()) for k, v in a.items()}
    assert weights_fingerprint(as_params) == fp                             # tensors that require grad
    t = a["embed.weight"].t().contiguous().t()                             # same values, other strides
    assert not t.is_contiguous()
    assert weights_fingerprint({**a, "embed.weight": t}) == fp
    passed, into = [], Fingerprint()
    for name, tensor in fingerprinted(a.items(), into):                   # the receiving side's wrapper
        passed.append((name, tensor))
    assert [n for n, _ in passed] == list(a) and all(x is a[n] for n, x in passed)
    assert into.hexdigest() == fp


def test_another_dtype_shape_name_or_value_changes_it():
    a = state(0)
    fp = weights_fingerprint(a)
    assert weights_fingerprint(state(1)) != fp
    assert weights_fingerprint({**a, "head.bias": a["head.bias"].to(torch.bfloat16)}) != fp
    assert weights_fingerprint({**a, "embed.weight": a["embed.weight"].reshape(50, 200)}) != fp
    renamed = {("lm_head.bias" if k == "head.bias" else k): v for k, v in a.items()}
    assert weights_fingerprint(renamed) != fp
    bumped = a["embed.weight"].clone()
    bumped.view(-1)[0] = torch.nextafter(bumped.view(-1)[0], torch.tensor(10.0))   # one ulp at a read position
    assert weights_fingerprint({**a, "embed.weight": bumped}) != fp


def test_its_stated_blind_spot_and_sample_none():
    a = state(0)
    changed = a["embed.weight"].clone()
    changed.view(-1)[1] += 1.0     # 10,000 elements, 4,096 read at k * 10000 // 4096: 0, 2, 4, ... skips 1
    b = {**a, "embed.weight": changed}
    assert weights_fingerprint(b) == weights_fingerprint(a)
    assert weights_fingerprint(b, sample=None) != weights_fingerprint(a, sample=None)
    with pytest.raises(ValueError, match="given twice"):
        weights_fingerprint([("w", torch.ones(2)), ("w", torch.ones(2))])
    with pytest.raises(ValueError, match="no tensors"):
        weights_fingerprint({})
    with pytest.raises(ValueError, match="sample"):
        weights_fingerprint(a, sample=0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        weights_fingerprint({"w": [1.0, 2.0]})


def batch(step: int, claim: int) -> TokenBatch:
    g = torch.Generator().manual_seed(step)
    mu = -(1.0 + torch.rand(4, 16, generator=g, dtype=torch.float64))
    return TokenBatch.from_padded(mu + 0.01 * torch.randn(4, 16, generator=g, dtype=torch.float64), mu,
                                  torch.ones(4, 16), labels={"pool": ["fp8"] * 4},
                                  policy_version=[claim] * 4, trainer_version=step)


def staleness(run) -> list[float]:
    series = query.metric_series(query.connect(), run, ["pool"], metrics=["mismatch/staleness/max"])
    return series.sort_values("step")["mismatch/staleness/max"].tolist()


def test_a_push_of_an_older_versions_weights_counts_staleness_from_that_version(tmp_path):
    run = tmp_path / "run"
    versions = {v: weights_fingerprint(state(v)) for v in range(6)}
    with MismatchCollector(run, alert_evaluator=None) as mc:
        for step in range(6):
            # from step 3 the pipeline sends version 1's buffer again while the trainer pushes `step`
            held = step if step < 3 else 1
            mc.log_event("weight_sync", step=step, pool="fp8", version=step, fingerprint=versions[held],
                         trainer_fingerprint=versions[step])
            mc.log_step(step, batch(step, step))                        # the batches claim the new version
        assert mc.errors_by_kind == {"WrongWeights": 1, "VersionNotApplied": 3}
    assert staleness(run) == [0.0, 0.0, 0.0, 2.0, 3.0, 4.0]            # counted from version 1
    events = run_events(query.connect(), run)
    assert events["version"].tolist() == [0, 1, 2, 1, 3, 1, 4, 1, 5]
    assert events["message"].iloc[3].startswith("pool holds version 1's weights")
    assert events["message"].iloc[4].startswith("weights not applied")
    errors = query.collector_errors(query.connect(), run)
    wrong = errors[errors["message"].str.contains("fingerprint of version 1")]
    assert wrong["step"].tolist() == [3]                               # at the sync, once for the same weights
    assert "the pool runs version 1's weights" in wrong["message"].iloc[0]


def test_weights_of_no_known_version_leave_the_push_not_applied(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, alert_evaluator=None) as mc:
        mc.log_event("weight_sync", step=0, pool="fp8", version=0, trainer_fingerprint=weights_fingerprint(state(0)),
                     fingerprint=weights_fingerprint(state(0)))
        mc.log_step(0, batch(0, 0))
        # the trainer gives version 1's fingerprint; the pool's weights are no version seen
        mc.log_event("weight_sync", step=1, pool="fp8", version=1, trainer_fingerprint=weights_fingerprint(state(1)),
                     fingerprint=weights_fingerprint(state(99)))
        mc.log_step(1, batch(1, 1))
        mc.log_event("weight_sync", step=2, pool="fp8", version=2, trainer_fingerprint=weights_fingerprint(state(2)),
                     fingerprint=weights_fingerprint(state(2)))                  # a push that lands ends it
        mc.log_step(2, batch(2, 2))
        assert mc.errors_by_kind == {"WrongWeights": 1, "VersionNotApplied": 1}
    assert staleness(run) == [0.0, 1.0, 0.0]
    events = run_events(query.connect(), run)
    assert events["version"].tolist() == [0, 1, 2]
    assert events["message"].iloc[1].startswith("weights not applied: fingerprint ")
    errors = query.collector_errors(query.connect(), run)
    assert errors["message"].str.contains("which is no version given in this run").sum() == 1


def test_strict_raises_after_recording_and_mistakes_in_the_call_raise(tmp_path):
    run = tmp_path / "run"
    fp0, fp1 = weights_fingerprint(state(0)), weights_fingerprint(state(1))
    with MismatchCollector(run, alert_evaluator=None, strict=True) as mc:
        mc.log_event("weight_sync", step=0, pool="fp8", version=0, trainer_fingerprint=fp0)
        mc.log_event("weight_sync", step=1, pool="fp8", version=1, trainer_fingerprint=fp1, fingerprint=fp1)
        with pytest.raises(WrongWeights, match="fingerprint of version 0"):
            mc.log_event("weight_sync", step=2, pool="fp8", version=2, trainer_fingerprint=weights_fingerprint(state(2)),
                         fingerprint=fp0)
        with pytest.raises(ValueError, match="weight_sync or resync"):
            mc.log_event("resume", step=3, fingerprint=fp0, version=0)
        with pytest.raises(ValueError, match="version=None"):
            mc.log_event("weight_sync", step=3, fingerprint=fp0)
        with pytest.raises(TypeError, match="non-empty str"):
            mc.log_event("weight_sync", step=3, version=3, trainer_fingerprint=b"sha256:00")
    events = run_events(query.connect(), run)
    assert events["version"].tolist() == [0, 1, 0, 2]                  # recorded before it raised


def simulated(fingerprints: bool) -> tuple[list[float], list[tuple[int, str, str]]]:
    """The benchmark's run (dense fleet, bf16 sent the warm-start weights from step 3, 8 steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_fingerprints import run as bench_run

    out = bench_run(onset=3, horizon=4, variant="dense", fingerprints=fingerprints)
    return out["staleness"], out["fired"]


def test_the_simulators_wrong_weights_fault_is_found_at_its_sync_with_fingerprints():
    with_fp, fired = simulated(True)
    assert with_fp == [0.0, 0.0, 0.0, 3.0, 4.0, 5.0, 6.0, 7.0]          # the warm-start weights: version 0
    assert (5, "MismatchStalenessHigh", "bf16") in fired                # staleness > 4 from step 5
    without, _ = simulated(False)
    assert without == [0.0] * 8                                         # the push looks like any other
