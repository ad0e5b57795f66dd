"""Each pool's expected healthy levels as a Prometheus series, for alert annotations.

``mismatch_expected_level{pool, metric, precision, engine}`` holds the level of
``expected_levels.csv`` that :func:`.expected_levels.expected_for_pool` finds for the pool's
``run.json`` metadata: ``metric`` is the metric key without ``mismatch/`` (``k3_kl``,
``abs_log_ratio/p99``, ``extreme_fraction``), ``precision`` and ``engine`` are the row's (as the
in-process note names them). A pool without a row for a metric has no sample for it (never a
guessed level). The rendered alert rules divide a pool's metric by it to say "x times its
expected healthy level" in their summaries, exactly as the in-process evaluator does.
"""

from __future__ import annotations

from typing import Mapping

from prometheus_client.core import Metric

from .expected_levels import LEVEL_METRICS, expected_for_pool
from .label_text import label_text

EXPECTED_LEVEL = "mismatch_expected_level"


def level_label(metric_key: str) -> str:
    """The ``metric`` label of a level: the key without its ``mismatch/`` prefix."""
    return metric_key.removeprefix("mismatch/")


def expected_level_samples(pools: Mapping[str, Mapping[str, object]] | None
                           ) -> list[tuple[dict[str, str], float]]:
    """(labels, healthy level) of every pool and metric that has a level, sorted by pool."""
    out = []
    for pool in sorted(pools or {}):
        for key in LEVEL_METRICS:
            level = expected_for_pool(key, (pools or {})[pool])
            if level is not None:
                out.append(({"pool": label_text(str(pool)), "metric": level_label(key),
                             "precision": level.precision, "engine": level.engine}, float(level.healthy)))
    return out


def gauge_family(name: str, documentation: str, samples: list[tuple[dict[str, str], float]]) -> Metric:
    """A gauge family of (labels, value) samples, as the exporter serves per-pool constants."""
    family = Metric(name, documentation, "gauge")
    for labels, value in samples:
        family.add_sample(name, labels, value)
    return family


def expected_level_family(pools: Mapping[str, Mapping[str, object]] | None) -> Metric:
    return gauge_family(EXPECTED_LEVEL, "a pool's expected healthy level of a metric (expected_levels.csv, by the "
                        "pool's precision and engine)", expected_level_samples(pools))
