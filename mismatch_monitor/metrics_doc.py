"""Renders docs/METRICS.md from the one definition of the metrics (``metrics.METRICS``).

    python -m mismatch_monitor.metrics_doc > docs/METRICS.md

A test fails when the committed file is stale.
"""

from __future__ import annotations

from .metrics import METRICS, prometheus_name

INTRO = """# Metrics

Generated from `mismatch_monitor/metrics.py` by `python -m mismatch_monitor.metrics_doc`; do not
edit by hand.

Every metric is a function of summed statistics (`docs/SCHEMA.md`), so a value over several
pools, steps or ranks means what it means for one cell, and an empty slice is null, never 0.
`lr = log pi - log mu` of a valid token, `rho = exp(lr)`; `mu` is the sampler's distribution (it
drew the tokens), `pi` the trainer's. The same key names the report entry
(`mismatch/pool=fp8/k3_kl`, ...), the Parquet-derived series of `mismatch-monitor export`, the
dashboard's label and the Prometheus gauge (its HELP text is the definition below).

| key | Prometheus name | unit | label | definition |
|---|---|---|---|---|
"""

NOTES = """
Reading chi²: `mean(rho^2) - 1` estimates the chi-square divergence of `pi` from `mu`, which is
the variance of the weights only when their mean is 1. In a finite sample `mean(rho)` is often
below 1 (tokens `pi` favours more than `mu` are rarely drawn), and then chi² can be negative: it
is negative in about a third of the pool-steps of the runs in `sample_data/`. Read it with the
ESS, `(sum rho)^2 / (n sum rho^2)`, which stays in (0, 1].
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    rows = [f"| `{m.key}` | `{prometheus_name(m.key)}` | {m.unit or '-'} | {_cell(m.label)} | {_cell(m.description)} |"
            for m in METRICS]
    return INTRO + "\n".join(rows) + "\n" + NOTES


if __name__ == "__main__":
    print(render(), end="")
