"""The exporter serves each pool's expected healthy levels, read from expected_levels.csv by the
pool's precision and engine; a pool without a row, or without metadata, has no sample."""

from __future__ import annotations

import csv
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from mismatch_monitor.expected_levels import LEVEL_METRICS, expected_level
from mismatch_monitor.expected_series import EXPECTED_LEVEL
from mismatch_monitor.exporter import MismatchExporter

CSV = Path(__file__).resolve().parent.parent / "mismatch_monitor" / "expected_levels.csv"


def served(exporter: MismatchExporter) -> dict[tuple[str, str], tuple[float, str, str]]:
    text = generate_latest(exporter.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == EXPECTED_LEVEL:
                out[(s.labels["pool"], s.labels["metric"])] = (s.value, s.labels["precision"], s.labels["engine"])
    return out


def test_levels_follow_the_pools_metadata():
    pools = {"int4": {"precision": "int4", "engine": "transformers/sdpa"},
             "fp8": {"precision": "fp8", "engine": "vllm/top_p0.9"},          # family and engine variant
             "tpu": {"precision": "bf16", "engine": "jax"},                   # no row
             "bare": {}}
    exporter = MismatchExporter(pools=pools)
    got = served(exporter)
    want = {}
    for pool, meta in pools.items():
        for key in LEVEL_METRICS:
            level = expected_level(key, meta.get("precision"), meta.get("engine"))
            if level is not None:
                want[(pool, key.removeprefix("mismatch/"))] = (level.healthy, level.precision, level.engine)
    assert got == want
    with CSV.open() as f:                                                 # the CSV's row, as written
        (row,) = [r for r in csv.DictReader(f) if r["metric"] == "mismatch/k3_kl" and r["precision"] == "int4"]
    assert got[("int4", "k3_kl")] == (float(row["healthy"]), "int4", "transformers")
    assert ("fp8", "k3_kl") in got and not any(p in ("tpu", "bare") for p, _ in got)
    exporter.set_pools({})
    assert served(exporter) == {}
    assert served(MismatchExporter()) == {}


def test_a_collector_hands_its_pools_to_the_exporter(tmp_path):
    """As the docs attach them: the collector's pools (run.json's) give the exporter its levels,
    which the alert annotations divide by; without them every note would be missing."""
    from mismatch_monitor.collectors import MismatchCollector

    pools = {"int4": {"precision": "int4", "engine": "transformers/sdpa"}}
    exporter = MismatchExporter()
    collector = MismatchCollector(tmp_path / "run", pools=pools, exporter=exporter, handle_signals=False,
                                  alert_evaluator=None)
    try:
        got = served(exporter)
    finally:
        collector.close()
    assert got and {pool for pool, _ in got} == {"int4"}
    assert got[("int4", "k3_kl")][0] == expected_level("mismatch/k3_kl", "int4", "transformers/sdpa").healthy
