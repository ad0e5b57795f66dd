"""The opt-in exact-agreement gate: fires from step 0, on the engine's own metric, in both
evaluators (promtool over the rendered BITWISE_RULES). Runtime: about 3 s."""

from __future__ import annotations

import pandas as pd
import torch

from mismatch_monitor import metrics
from mismatch_monitor.alerts import AlertEvaluator, render_rules
from mismatch_monitor.alerts.definitions import BITWISE_RULES, DEFAULT_RULES, EXACT_AGREEMENT
from mismatch_monitor.alerts.promtool import render_unit_tests, run_tool
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.engine import compute_stats

from external_tools import needs


def history(steps: int = 6) -> pd.DataFrame:
    gen = torch.Generator().manual_seed(7)
    frames = []
    for step in range(steps):
        mu = -(1.0 + 3.0 * torch.rand(4, 16, generator=gen, dtype=torch.float64))
        pi = mu.clone()
        if step in (0, 1, 4):                    # pool b: one token differs by one ulp-scale amount
            pi[2, 3] += 1e-7
        batch = TokenBatch.from_padded(pi, mu, torch.ones(4, 16, dtype=torch.bool),
                                       labels={"pool": ["a", "a", "b", "b"]})
        frames.append(metrics.report(compute_stats(batch), ["pool"]).assign(step=step, wall_time=float(step)))
    return pd.concat(frames, ignore_index=True)


def test_gate_fires_from_step_zero_for_the_pool_that_differs_only():
    _, events = AlertEvaluator.replay(history(), rules=BITWISE_RULES)
    gate = [(e.step, e.pool, e.state) for e in events if e.alert == EXACT_AGREEMENT.name]
    assert gate == [(0, "b", "firing"), (2, "b", "resolved"), (4, "b", "firing"), (5, "b", "resolved")]
    # opt-in: the default rules never read the metric
    _, default = AlertEvaluator.replay(history(), rules=DEFAULT_RULES)
    assert not any(e.alert == EXACT_AGREEMENT.name for e in default)


@needs("promtool")
def test_prometheus_agrees_on_the_gate(tmp_path):
    (tmp_path / "rules.yml").write_text(render_rules(BITWISE_RULES, step_seconds=60.0))
    (tmp_path / "gate_test.yml").write_text(render_unit_tests(
        history(), rules=BITWISE_RULES, step_seconds=60.0, rule_file="rules.yml", eval_steps="all"))
    result = run_tool("promtool", "test", "rules", "gate_test.yml", cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
