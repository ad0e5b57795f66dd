"""verl's metrics dict as the run's training outcomes, beside the batch the verl adapter reads:
the keys verl logs (``critic/score/mean``, ``actor/pg_loss``, ``actor/grad_norm``,
``actor/entropy``, ``val-core/<data_source>/reward/mean@<n>``) stored per step and read back
from Parquet by DuckDB; a gradient norm that blew up is a counted error, not a stored number.
"""

from __future__ import annotations

import math

import numpy as np

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.collectors.adapters import verl_batch, verl_outcomes
from mismatch_monitor.query.events import run_outcomes

from test_adapters import SAMPLES, verl_layout


def metrics(step: int) -> dict[str, object]:
    """One step's metrics as verl's trainer logs them (numpy scalars from its reductions)."""
    return {"critic/score/mean": np.float64(0.25 * step), "critic/score/max": 1.0, "critic/rewards/mean": -1.0,
            "actor/pg_loss": np.float32(0.5 - 0.125 * step), "actor/grad_norm": 2.0 + step,
            "actor/entropy": np.float64(1.5), "actor/lr": 1e-6, "response_length/mean": 37.0,
            "timing_s/gen": 3.2, "training/global_step": step,
            "val-core/openai/gsm8k/reward/mean@4": 0.625, "val-aux/openai/gsm8k/reward/std@4": 0.1,
            "note": "text is not a number"}


def test_verl_metric_keys_as_outcomes():
    assert verl_outcomes(metrics(2)) == {"reward": 0.5, "loss": 0.25, "grad_norm": 4.0, "entropy": 1.5,
                                         "eval_reward/openai/gsm8k@4": 0.625}


def test_verl_outcomes_are_stored_per_step_beside_the_batch(tmp_path):
    run = tmp_path / "run"
    data = verl_layout(SAMPLES)
    with MismatchCollector(run, alert_evaluator=None) as mc:
        for step in (1, 2, 3):                          # verl counts global_steps from 1
            mc.log_step(step, verl_batch(data, labels={"pool": "vllm-bf16"}))
            values = metrics(step)
            if step == 3:
                values["actor/grad_norm"] = math.inf
            mc.log_outcomes(step, verl_outcomes(values))
        assert mc.error_count == 1 and "'grad_norm' at step 3 is inf" in mc.last_error
    con = query.connect()
    outcomes = run_outcomes(con, run)
    loss = outcomes[outcomes["name"] == "loss"]
    assert loss[["step", "value"]].values.tolist() == [[1, 0.375], [2, 0.25], [3, 0.125]]
    grad = outcomes[outcomes["name"] == "grad_norm"]
    assert grad[["step", "value"]].values.tolist() == [[1, 3.0], [2, 4.0]]
    assert sorted(set(outcomes["step"])) == query.steps_index(con, run)["step"].tolist()
