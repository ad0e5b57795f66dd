"""What the docs say against what the code does: generated docs are current, and every figure a
doc quotes is the one measured (or measured again here). Runtime: about 10 s.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from mismatch_monitor import metrics_doc, query

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = ROOT / "sample_data"


def section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_metrics_doc_is_current():
    doc = ROOT / "docs" / "METRICS.md"
    assert doc.read_text() == metrics_doc.render(), "run: python -m mismatch_monitor.metrics_doc > docs/METRICS.md"


def test_chi2_is_not_called_a_variance_and_is_negative_as_often_as_said():
    """chi² = mean(rho²) - 1 is the weights' variance only where mean(rho) = 1; in the sample runs
    it is negative in about a third of the pool-steps (docs/METRICS.md says so)."""
    description = metrics_doc.METRICS[[m.key for m in metrics_doc.METRICS].index("mismatch/chi2")].description
    assert "variance only where mean(rho) = 1" in description
    con = query.connect()
    values = []
    for run in sorted(p for p in SAMPLE_DATA.iterdir() if (p / "run.json").exists()):
        df = query.metric_series(con, run, ["pool"], metrics=["mismatch/chi2", "mismatch/n_tokens"])
        values.append(df.loc[df["mismatch/n_tokens"] > 0, "mismatch/chi2"])
    chi2 = pd.concat(values)
    negative = float((chi2 < 0).mean())
    assert len(chi2) > 100 and 0.25 < negative < 0.45, (len(chi2), negative)
    assert "negative in about a third of the pool-steps" in (ROOT / "docs" / "METRICS.md").read_text()


def _bench_dashboard_table() -> pd.DataFrame:
    text = section(ROOT / "benchmarks" / "README.md", "`bench_dashboard.py`: each page's queries on 10,000 steps x 500 cells")
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    table = pd.DataFrame([[c.strip() for c in r] for r in rows[1:]], columns=[c.strip() for c in rows[0]])
    return table.set_index("page").astype(float)


def test_dashboard_speed_figures_are_the_benchmark_notes():
    """DASHBOARD.md quotes the measured table of benchmarks/README.md (the one place it lives):
    the range of page times, the worst ratio to count(*) and the first paint."""
    table = _bench_dashboard_table()
    speed = section(ROOT / "docs" / "DASHBOARD.md", "Speed")
    low, high = table["queries (s)"].min(), table["queries (s)"].max()
    assert f"{low:.2f}-{high:.2f} s" in speed, (low, high)
    assert f"within {table['x count(*), cell tables'].max():.1f}×" in speed
    notes = (ROOT / "benchmarks" / "README.md").read_text()
    for figure in re.findall(r"(\d+\.\d+) s cold and (\d+\.\d+) s", speed):
        assert f"{figure[0]} s cold, {figure[1]} s" in notes, figure
    assert not re.search(r"\d\.\d{3}", speed), "page timings belong in benchmarks/README.md"


def test_integrations_payload_sizes_are_measured():
    """The pickled shard a rank sends (packed statistics and exemplars of one step), built as
    ``bench_merge.py`` builds it for ranks 0-2, against the ranges INTEGRATIONS.md gives for that
    benchmark's batches (within 25% of either end)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_merge import rank_shard

    text = section(ROOT / "docs" / "INTEGRATIONS.md", "Measured cost")
    claims = re.search(r"About\s+([\d.]+)-([\d.]+) kB at 10,000 tokens per rank,\s+([\d.]+)-([\d.]+) kB at "
                       r"100,000 and ([\d.]+)-([\d.]+) MB at 1,000,000 in `bench_merge.py`'s batches", text)
    assert claims, "INTEGRATIONS.md no longer states the shard sizes"
    bounds = [float(v) for v in claims.groups()]
    bounds[4:] = [v * 1000 for v in bounds[4:]]                        # MB -> kB
    torch.set_num_threads(1)
    for i, tokens in enumerate((10_000, 100_000, 1_000_000)):
        lo, hi = bounds[2 * i: 2 * i + 2]
        for rank in range(3):
            size_kb = len(pickle.dumps(rank_shard(tokens, rank)[2])) / 1000
            assert lo / 1.25 <= size_kb <= hi * 1.25, (tokens, rank, size_kb, (lo, hi))


def test_schema_lists_every_alerts_column():
    """docs/SCHEMA.md's `alerts` section names exactly the columns the collector writes (the
    fields of an AlertEvent's row)."""
    from mismatch_monitor.alerts.evaluator import AlertEvent

    text = section(ROOT / "docs" / "SCHEMA.md", "`alerts`")
    columns = text.split(":", 1)[1]                  # after "One row per alert state change (...):"
    named = list(dict.fromkeys(re.findall(r"`([a-z_]+)`", columns)))    # in order, each once
    assert named == [f.name for f in dataclasses.fields(AlertEvent)]
