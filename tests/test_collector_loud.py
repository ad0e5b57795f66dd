"""No silent failures in the collector: every wrong or missing number is loud, and kept in the run.

* log-probs that require grad (taken from a real forward) are read without a copy and stored;
* a mistake in the call (misspelt field, wrong types) raises at once, even when not strict;
* probabilities passed as log-probs are named as such, in the log and in the run;
* steps outside int64 >= 0 are a counted error of that step only, never of later flushes;
* every counted error keeps its text in the run's ``errors`` table, which ``summary`` and the
  dashboard's Overview show.
"""

from __future__ import annotations

import io
import logging
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.cli import main
from mismatch_monitor.collectors import MismatchCollector, StepHook

from synthetic import make_batch


def forward_logprobs(B: int = 4, T: int = 7, V: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-probs of sampled tokens from a real forward of a tiny model (they require grad),
    and a weight of that model (to check a backward through them afterwards)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Tanh(), torch.nn.Linear(8, V))
    ids = torch.randint(0, V, (B, T + 1))
    logits = model(ids[:, :-1])                                          # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp, model[2].weight


def test_logprobs_that_require_grad_are_stored_and_not_copied(tmp_path):
    pi, weight = forward_logprobs()
    assert pi.requires_grad
    g = torch.Generator().manual_seed(1)
    mu = (pi.detach() + 0.02 * torch.randn(pi.shape, generator=g)).clamp(max=0.0)
    mask = torch.ones_like(pi, dtype=torch.bool)
    mask[0, 5:] = False
    run = tmp_path / "run"
    with MismatchCollector(run, flush_every_steps=1, exemplars_k=4) as mc:
        report = mc.log_step(0, trainer_logprobs=pi, sampler_logprobs=mu, response_mask=mask)
        flat_pi = pi[mask]                                               # [N], still requires grad
        flat = TokenBatch.from_flat(flat_pi, mu[mask], seq_offsets=[0, 5, 12, 19, 26])
        report_flat = mc.log_step(1, flat)
    assert report["mismatch/collector_errors"] == 0 and report_flat["mismatch/collector_errors"] == 0
    lr = (pi.detach().double() - mu.double())[mask].numpy()
    assert report["mismatch/n_tokens"] == mask.sum() == len(lr)
    assert report["mismatch/k1_kl"] == pytest.approx(float(np.mean(-lr)), rel=1e-6, abs=1e-9)
    # the batch holds a view of the caller's memory, not a copy, and no graph
    assert flat.trainer_logprobs.data_ptr() == flat_pi.data_ptr() and not flat.trainer_logprobs.requires_grad
    con = query.connect()
    assert query.steps_index(con, run)["n_tokens"].tolist() == [len(lr), len(lr)]
    assert len(query.rows(con, run, "exemplar_tokens")) == 8
    pi.sum().backward()                                                  # the training graph is intact
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize("strict", [False, True])
def test_a_mistake_in_the_call_raises_at_once_even_when_not_strict(tmp_path, strict):
    t = -torch.rand(3, 4)
    mask = torch.ones(3, 4)
    run = tmp_path / "run"
    with MismatchCollector(run, strict=strict, flush_every_steps=1) as mc:
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'trainer_logprob'"):
            mc.log_step(0, trainer_logprob=t, sampler_logprobs=t, response_mask=mask)
        with pytest.raises(TypeError, match="expected sampler_logprobs to be a torch.Tensor, got list"):
            mc.log_step(0, trainer_logprobs=t, sampler_logprobs=t.tolist(), response_mask=mask)
        with pytest.raises(TypeError, match="missing sampler_logprobs"):
            mc.log_step(0, trainer_logprobs=t, response_mask=mask)
        with pytest.raises(TypeError, match="expected step to be an int, got str"):
            mc.log_step("3", trainer_logprobs=t, sampler_logprobs=t, response_mask=mask)
        with pytest.raises(TypeError, match="not both"):
            mc.log_step(0, make_batch(0), labels={"pool": ["a"] * 24})
        with pytest.raises(TypeError, match="expected batch to be a TokenBatch, got dict"):
            mc.log_step(0, {"trainer_logprobs": t})
        with pytest.raises(TypeError, match="cannot be combined with seq_offsets"):
            mc.log_step(0, trainer_logprobs=t, sampler_logprobs=t, response_mask=mask, seq_offsets=[0, 4])
        hook = StepHook(mc)
        with pytest.raises(TypeError, match="did you mean 'sampler_logprobs'"):
            hook.add(trainer_logprobs=t, sampler_logprob=t, response_mask=mask)
        assert mc.error_count == 0                       # a mistake is raised, not counted
        ok = mc.log_step(1, trainer_logprobs=t, sampler_logprobs=t, response_mask=mask)
    assert ok["mismatch/n_tokens"] == 12
    assert query.steps_index(query.connect(), run)["step"].tolist() == [1]


def test_a_data_problem_is_still_counted_not_raised(tmp_path):
    t = -torch.rand(3, 4)
    with MismatchCollector(tmp_path / "run") as mc:
        out = mc.log_step(0, trainer_logprobs=t, sampler_logprobs=t[:, :3], response_mask=torch.ones(3, 4))
    assert out == {"mismatch/collector_errors": 1.0} and mc.errors_by_kind == {"BatchError": 1}


def test_probabilities_instead_of_logprobs_are_named_in_the_log_and_the_run(tmp_path, caplog):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3 - 1e-3
    run = tmp_path / "run"
    with caplog.at_level(logging.ERROR, logger="mismatch_monitor"):
        with MismatchCollector(run, flush_every_steps=1) as mc:
            out = mc.log_step(0, trainer_logprobs=logp, sampler_logprobs=logp.exp(),
                              response_mask=torch.ones(6, 9))
            fine = mc.log_step(1, trainer_logprobs=logp, sampler_logprobs=logp + 1e-3,
                               response_mask=torch.ones(6, 9))
    assert out["mismatch/collector_errors"] == 1 and fine["mismatch/collector_errors"] == 1
    assert out["mismatch/data_quality/positive_logprob_tokens"] == 54
    logged = [r.getMessage() for r in caplog.records]
    assert any("sampler_logprobs (100% of 54 tokens in (0, 1]) look like probabilities" in m for m in logged)
    errors = query.collector_errors(query.connect(), run)
    assert errors["kind"].tolist() == ["ProbabilitiesNotLogProbs"] and errors["step"].tolist() == [0]
    assert "trainer_logprobs" not in errors["message"][0] and "torch.log(p)" in errors["message"][0]
    with MismatchCollector(tmp_path / "strict", strict=True) as mc:
        with pytest.raises(ValueError, match="look like probabilities"):
            mc.log_step(0, trainer_logprobs=logp.exp(), sampler_logprobs=logp, response_mask=torch.ones(6, 9))


def test_a_few_positive_logprobs_are_not_called_probabilities(tmp_path):
    logp = -torch.rand(4, 10, dtype=torch.float64) - 0.1
    sampler = logp.clone()
    sampler[0, :3] = 0.2                                   # 3 of 40 tokens above 0: data quality only
    with MismatchCollector(tmp_path / "run") as mc:
        out = mc.log_step(0, trainer_logprobs=logp, sampler_logprobs=sampler, response_mask=torch.ones(4, 10))
    assert out["mismatch/collector_errors"] == 0 and out["mismatch/data_quality/positive_logprob_tokens"] == 3


@pytest.mark.parametrize("bad", [2**64 + 3, 2**63, -1])
def test_a_step_out_of_range_is_an_error_of_that_step_only(tmp_path, bad):
    run = tmp_path / "run"
    mc = MismatchCollector(run, flush_every_steps=2)
    mc.log_step(0, make_batch(0))
    out = mc.log_step(bad, make_batch(1))
    assert out == {"mismatch/collector_errors": 1.0}
    mc.log_step(np.int64(2), make_batch(2))               # numpy integers are steps too
    mc.flush()
    mc.log_step(3, make_batch(3))
    mc.close()                                             # never raises for a bad step
    assert mc.error_count == 1 and mc.errors_by_kind == {"StepError": 1}
    con = query.connect()
    idx = query.steps_index(con, run)
    assert idx["step"].tolist() == [0, 2, 3] and str(idx["step"].dtype) == "int64"
    assert idx["collector_errors"].tolist() == [0, 1, 1]
    errors = query.collector_errors(con, run)
    assert len(errors) == 1 and errors["step"].isna().all()
    assert f"got {bad}" in errors["message"][0] and "int64 >= 0" in errors["message"][0]
    assert not query.metric_series(con, run).empty       # the readers still read the run


def test_a_bad_last_step_still_leaves_its_error_in_the_run(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        mc.log_step(0, make_batch(0))
        mc.log_step(-5, make_batch(1))                     # nothing else is logged after it
    errors = query.collector_errors(query.connect(), run)
    assert errors["message"].str.contains("got -5").tolist() == [True]
    assert query.steps_index(query.connect(), run)["step"].tolist() == [0]


def test_errors_table_survives_compaction_once(tmp_path):
    from mismatch_monitor.store.compact import compact_run

    run = tmp_path / "run"
    t = -torch.rand(3, 4)
    with MismatchCollector(run, flush_every_steps=1) as mc:
        for step in range(4):
            mc.log_step(step, make_batch(step))
            mc.log_step(step + 10, trainer_logprobs=t, sampler_logprobs=t[:, :2], response_mask=torch.ones(3, 4))
        mc.log_step(-1, make_batch(9))
    before = query.collector_errors(query.connect(), run)
    compact_run(run)
    after = query.collector_errors(query.connect(), run)
    assert len(before) == len(after) == 5
    assert after["step"].tolist() == before["step"].tolist()
    assert after["step"].isna().sum() == 1


def _summary(run) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["summary", str(run)]) == 0
    return out.getvalue()


def test_summary_and_overview_show_each_error_text(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r"
    clock = iter(float(i) for i in range(1000))
    t = -torch.rand(3, 4)
    with MismatchCollector(run, flush_every_steps=1, clock=lambda: next(clock)) as mc:
        mc.log_step(0, make_batch(0))
        mc.log_step(1, trainer_logprobs=t, sampler_logprobs=t[:, :3], response_mask=torch.ones(3, 4))
        mc.log_step(2, trainer_logprobs=t, sampler_logprobs=t[:, :3], response_mask=torch.ones(3, 4))
        mc.log_step(3, trainer_logprobs=t, sampler_logprobs=t.exp(), response_mask=torch.ones(3, 4))
        mc.log_step(4, make_batch(4))
    text = _summary(run)
    assert "collector errors: 3 stored, 2 distinct (latest first):" in text
    lines = [line for line in text.splitlines() if line.startswith("  ") and "x (" in line]
    assert lines[0].startswith("  1x (last at step 3) step 3: ProbabilitiesNotLogProbs: sampler_logprobs")
    assert lines[1].startswith("  2x (last at step 2) step 2 was not recorded: BatchError: shape mismatch: "
                               "trainer_logprobs (3, 4) vs sampler_logprobs (3, 3)")

    from streamlit.testing.v1 import AppTest

    from mismatch_monitor.app.navigation import APP_DIR
    from mismatch_monitor.app.runs import ROOT_ENV

    monkeypatch.setenv(ROOT_ENV, str(run.parent))
    at = AppTest.from_file(str(APP_DIR / "main.py"), default_timeout=60)
    at.query_params.update(run="r")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("3 collector error(s), 2 distinct" in e.value for e in at.error)
    shown = [df for df in (d.value for d in at.dataframe) if "message" in df.columns]
    assert len(shown) == 1 and shown[0]["count"].tolist() == [1, 2]
    assert shown[0]["message"].str.contains("shape mismatch").tolist() == [False, True]


def test_overview_says_when_there_is_no_error(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from mismatch_monitor.app.navigation import APP_DIR
    from mismatch_monitor.app.runs import ROOT_ENV

    run = tmp_path / "runs" / "ok"
    with MismatchCollector(run, flush_every_steps=1) as mc:
        mc.log_step(0, make_batch(0))
    monkeypatch.setenv(ROOT_ENV, str(run.parent))
    at = AppTest.from_file(str(APP_DIR / "main.py"), default_timeout=60)
    at.query_params.update(run="ok")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("counted no error" in s.value for s in at.success)


def test_a_launcher_world_without_a_process_group_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """WORLD_SIZE=2 (torchrun, accelerate) but no process group: the default reducer waits for
    the group instead of letting every rank write the run, and says what to do at the first step."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = tmp_path / "run"
    mc = MismatchCollector(run)
    assert mc.writer is None and not run.exists()          # nothing decided, nothing written yet
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .* torch.distributed is not initialised"):
        mc.log_step(0, make_batch(0))
    mc.close()
    with MismatchCollector(tmp_path / "own", reducer=None, flush_every_steps=1) as own:   # one per process
        assert own.log_step(0, make_batch(0))["mismatch/collector_errors"] == 0
    monkeypatch.delenv("WORLD_SIZE")
    with MismatchCollector(tmp_path / "single") as single:
        assert single.reducer is None and single.writer is not None
