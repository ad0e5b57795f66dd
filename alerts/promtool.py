"""promtool unit tests built from a metric history, with the in-process evaluator's verdicts.

One training step becomes one sample ``step_seconds`` apart (NaN or a missing pool becomes a
``stale`` marker, as when a series vanishes from a scrape), and the alerts the in-process
evaluator reports as firing after each step become ``exp_alerts`` at that step's time, with
labels and fully rendered annotations. ``promtool test rules`` then checks that Prometheus,
running the rendered rules, fires the same alerts for the same pools at the same steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import pandas as pd

from mismatch_monitor.expected_series import EXPECTED_LEVEL, expected_level_samples
from mismatch_monitor.pool_bounds import POOL_BOUND, pool_bound_samples
from mismatch_monitor.metrics import prometheus_name
from mismatch_monitor.report_keys import label_text

from .promql import duration
from .definitions import DEFAULT_RULES
from .evaluator import AlertEvaluator, iter_steps
from .rules import AlertRule
from .yaml_text import dump

EvalSteps = Literal["all", "changes"]


def find_tool(name: str) -> str:
    """Path of a Prometheus tool (``promtool``, ``amtool``), or a clear error."""
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found on PATH; install Debian's prometheus and "
                                "prometheus-alertmanager packages (.ci/run does)")
    return path


def run_tool(name: str, *args: str, cwd: str | Path | None = None,
             timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_tool(name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _selector(name: str, pool: str | None) -> str:
    return name if pool is None else f"{name}{{pool={json.dumps(pool)}}}"


def input_series(history: pd.DataFrame, rules: Sequence[AlertRule], steps: list[int],
                 fleet_history: pd.DataFrame | None = None) -> list[dict[str, str]]:
    """One series per (metric a rule reads, pool), one value per step, ``stale`` where missing."""
    out = []
    index = {s: i for i, s in enumerate(steps)}
    for scope, frame in (("pool", history), ("fleet", fleet_history)):
        keys = sorted({k for r in rules if r.scope == scope for k in r.condition.metrics})
        if not keys or frame is None or len(frame) == 0:
            continue
        if scope == "pool":
            labels = frame["pool"].map(lambda p: label_text(None if pd.isna(p) else str(p)))
        else:
            labels = pd.Series([None] * len(frame), index=frame.index, dtype=object)
        for key in keys:
            for pool in sorted(set(labels), key=lambda p: "" if p is None else p):
                rows = frame[labels.to_numpy() == pool] if pool is not None else frame
                values = ["stale"] * len(steps)
                for step, v in zip(rows["step"].astype(int), rows[key].to_numpy(np.float64)):
                    if not np.isnan(v):
                        values[index[step]] = repr(float(v))
                out.append({"series": _selector(prometheus_name(key), pool), "values": " ".join(values)})
    return out


def level_series(pools: Mapping[str, Mapping[str, object]] | None, steps: int) -> list[dict[str, str]]:
    """The pools' ``mismatch_expected_level`` and ``mismatch_pool_bound`` series (constant over the
    ``steps`` steps), as the exporter serves them given the same metadata."""
    out = []
    for name, samples in ((EXPECTED_LEVEL, expected_level_samples(pools)), (POOL_BOUND, pool_bound_samples(pools))):
        for labels, value in samples:
            selector = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
            out.append({"series": f"{name}{{{selector}}}", "values": f"{float(value)!r}+0x{max(steps - 1, 0)}"})
    return out


def _expected(rule: AlertRule, firing: list[Any]) -> list[dict[str, Any]]:
    out = []
    for event in sorted(firing, key=lambda e: "" if e.pool is None else e.pool):
        labels = dict(rule.labels)
        if event.pool is not None:
            labels = {"pool": event.pool, **labels}
        out.append({"exp_labels": labels,
                    "exp_annotations": {"summary": event.summary, "description": event.description,
                                        "runbook": event.runbook}})
    return out


def alert_tests(history: pd.DataFrame, rules: Sequence[AlertRule], steps: list[int], step_seconds: float,
                fleet_history: pd.DataFrame | None = None, eval_steps: EvalSteps = "changes",
                pools: Mapping[str, Mapping[str, object]] | None = None) -> list[dict]:
    """``alert_rule_test`` entries: every rule at every step (``all``), or at each step where the
    set of firing pools changes and at the step before it (``changes``). ``pools``: the pools'
    metadata; summaries then end with the expected-level note."""
    evaluator = AlertEvaluator(tuple(rules), pools=pools)
    per_step: list[dict[str, list[Any]]] = []
    for step, by_pool, fleet in iter_steps(history, fleet_history):
        evaluator.observe(step, float("nan"), by_pool, fleet=fleet)
        firing: dict[str, list[Any]] = {r.name: [] for r in rules}
        for event in evaluator.firing():
            firing[event.alert].append(event)
        per_step.append(firing)
    tests = []
    for rule in rules:
        pools = [frozenset(e.pool for e in f[rule.name]) for f in per_step]
        if eval_steps == "all":
            chosen = set(range(len(steps)))
        else:
            changes = [i for i in range(1, len(steps)) if pools[i] != pools[i - 1]]
            chosen = {j for i in changes for j in (i - 1, i)} | {len(steps) - 1}
        for i in sorted(chosen):
            tests.append({"eval_time": duration(i * step_seconds), "alertname": rule.name,
                          "exp_alerts": _expected(rule, per_step[i][rule.name])})
    return tests


def unit_test_document(history: pd.DataFrame, *, rules: Sequence[AlertRule] = DEFAULT_RULES,
                       step_seconds: float, rule_file: str, fleet_history: pd.DataFrame | None = None,
                       eval_steps: EvalSteps = "changes",
                       promql_tests: Sequence[dict[str, Any]] = (),
                       extra_series: Sequence[dict[str, str]] = (),
                       pools: Mapping[str, Mapping[str, object]] | None = None) -> dict[str, Any]:
    """A promtool test file (as a document for ``yaml_text.dump``) for ``history``; steps must
    be consecutive (a gap would read as stale in Prometheus but not in the evaluator).
    ``pools``: the pools' metadata; their expected-level series are input series too."""
    steps = sorted(set(history["step"].astype(int)) | (
        set(fleet_history["step"].astype(int)) if fleet_history is not None and len(fleet_history) else set()))
    if steps != list(range(steps[0], steps[0] + len(steps))) if steps else False:
        raise ValueError(f"expected consecutive steps, got gaps in {steps[0]}..{steps[-1]}")
    test: dict[str, Any] = {
        "interval": duration(step_seconds),
        "input_series": (input_series(history, rules, steps, fleet_history) + level_series(pools, len(steps))
                         + list(extra_series)),
        "alert_rule_test": alert_tests(history, rules, steps, step_seconds, fleet_history, eval_steps, pools),
    }
    if promql_tests:
        test["promql_expr_test"] = list(promql_tests)
    return {"rule_files": [rule_file], "evaluation_interval": duration(step_seconds), "tests": [test]}


def render_unit_tests(history: pd.DataFrame, **kwargs: Any) -> str:
    header = kwargs.pop("header", "")
    return dump(unit_test_document(history, **kwargs), header)
