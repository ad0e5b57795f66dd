"""The Prometheus exporter against an independent float64 reference, and ``serve`` against it.

Reference values are computed with numpy straight from the log-probs the batch was built from:
per-token ratios, boolean masks, sorted arrays. Runtime: about 8 s (one ``serve`` subprocess).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.cli.serve import load_run
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.exporter import COUNTERS, HISTOGRAM, MismatchExporter

POOLS = ["bf16", "bf16", "fp8", "fp8", "fp8", "int4"]
HARDWARE = ["H100", "MI300", "H100", "H100", "MI300", "L40S"]
NOISE = {"bf16": 0.02, "fp8": 0.3, "int4": 0.9}
# `mismatch-monitor serve ...` through its module (the full CLI imports every command first)
SERVE = ("import argparse, sys; from mismatch_monitor.cli import serve; p = argparse.ArgumentParser(); "
         "serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))")


def make_batch(seed: int, pools=POOLS, hardware=HARDWARE, tokens: int = 200, nan_pool: str | None = None):
    """A batch and its per-token reference data: (batch, lr [B, T] float64, pool and hardware per row)."""
    rng = np.random.default_rng(seed)
    B = len(pools)
    mu = -rng.uniform(3.0, 8.0, size=(B, tokens))
    lr = np.stack([rng.normal(0.0, NOISE[p], tokens) for p in pools])
    pi = mu + lr
    same = rng.random((B, tokens)) < 0.1          # equal log-probs: lr == 0 exactly
    pi[same] = mu[same]
    if nan_pool is not None:
        pi[[i for i, p in enumerate(pools) if p == nan_pool]] = np.nan
    batch = TokenBatch.from_padded(torch.from_numpy(pi), torch.from_numpy(mu), torch.ones(B, tokens),
                                   labels={"pool": list(pools), "hardware": list(hardware)})
    return batch, pi - mu, np.array(pools), np.array(hardware)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_gauges_match_the_reference_per_pool_hardware_and_fleet():
    batch, lr, pools, hardware = make_batch(0)
    exporter = MismatchExporter()
    exporter.observe(7, compute_stats(batch))
    reg = exporter.registry
    alpha = MetricConfig().hist_relative_accuracy
    slices = [({"pool": p}, pools == p) for p in set(POOLS)] + \
             [({"hardware": h}, hardware == h) for h in set(HARDWARE)] + [({}, np.ones(len(POOLS), bool))]
    for labels, rows in slices:
        x = lr[rows].ravel()
        rho = np.exp(x)
        assert value(reg, "mismatch_n_tokens", **labels) == x.size
        assert value(reg, "mismatch_k3_kl_nats", **labels) == pytest.approx(np.mean(rho - 1 - x), rel=1e-9)
        assert value(reg, "mismatch_ess_ratio", **labels) == pytest.approx(
            rho.sum() ** 2 / (x.size * np.sum(rho ** 2)), rel=1e-12)
        assert value(reg, "mismatch_extreme_ratio", **labels) == pytest.approx(np.mean((rho < 0.2) | (rho > 5)))
        assert value(reg, "mismatch_log_ratio_mean", **labels) == pytest.approx(x.mean(), rel=1e-9, abs=1e-15)
        assert value(reg, "mismatch_abs_log_ratio_max", **labels) == pytest.approx(np.abs(x).max(), rel=1e-15)
        order_stat = np.sort(np.abs(x))[math.ceil(0.99 * x.size) - 1]          # nearest rank
        assert value(reg, "mismatch_abs_log_ratio_p99", **labels) == pytest.approx(order_stat, rel=alpha)
        assert value(reg, "mismatch_rho_mean_ratio", **labels) == pytest.approx(rho.mean(), rel=1e-12)
        assert value(reg, "mismatch_exact_agreement_ratio", **labels) == np.mean(x == 0) > 0
        assert value(reg, "mismatch_ppo_clip_ratio", **labels) == pytest.approx(np.mean((rho <= 0.8) | (rho > 1.2)))
        p_t = np.exp(batch.trainer_logprobs.view(len(POOLS), -1).numpy()[rows].ravel())
        p_s = np.exp(batch.sampler_logprobs.view(len(POOLS), -1).numpy()[rows].ravel())
        assert value(reg, "mismatch_abs_prob_diff_mean_ratio", **labels) == pytest.approx(
            np.mean(np.abs(p_t - p_s)), rel=1e-9)
        assert value(reg, "mismatch_abs_prob_diff_max_ratio", **labels) == pytest.approx(
            np.max(np.abs(p_t - p_s)), rel=1e-9)
        assert value(reg, "mismatch_prob_pearson_corr_ratio", **labels) == pytest.approx(
            np.corrcoef(p_t, p_s)[0, 1], abs=1e-10)
        seq_sums = lr[rows].sum(1)                     # one sequence per row
        if len(seq_sums) > 1:                          # one sequence has no variance
            assert value(reg, "mismatch_seq_log_ratio_variance", **labels) == pytest.approx(
                np.var(seq_sums, ddof=1), rel=1e-9)
        w = np.exp(seq_sums - seq_sums.max())           # sequence-IS weights, scaled by the largest
        assert value(reg, "mismatch_seq_is_ess_ratio", **labels) == pytest.approx(
            w.sum() ** 2 / (len(w) * np.sum(w * w)), rel=1e-12)
        assert value(reg, "mismatch_seq_is_chi2_ratio", **labels) == pytest.approx(
            len(w) * np.sum(w * w) / w.sum() ** 2 - 1.0, rel=1e-9, abs=1e-15)
    assert value(reg, "mismatch_last_step") == 7
    assert value(reg, "mismatch_routing_flip_rate_ratio") is None      # no expert ids: no sample, not 0


def test_counters_and_histogram_accumulate_exactly():
    exporter = MismatchExporter()
    lrs, pools, hws = [], [], []
    for seed in (1, 2, 3):
        batch, lr, p, h = make_batch(seed)
        exporter.observe(seed, compute_stats(batch))
        lrs.append(lr), pools.append(p), hws.append(h)
    lr, pool, hw = np.concatenate(lrs), np.concatenate(pools), np.concatenate(hws)
    reg = exporter.registry
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    les = sorted({s.labels["le"] for s in families[HISTOGRAM].samples if "le" in s.labels} - {"+Inf"},
                 key=float)
    assert len(les) == 11
    for cell in sorted(set(zip(pool, hw))):
        rows = (pool == cell[0]) & (hw == cell[1])
        x = lr[rows].ravel()
        labels = {"pool": cell[0], "hardware": cell[1]}
        assert value(reg, "mismatch_tokens_total", **labels) == x.size
        assert value(reg, "mismatch_extreme_tokens_total", **labels) == np.sum((np.exp(x) < 0.2) | (np.exp(x) > 5))
        assert value(reg, "mismatch_clipped_high_tokens_total", **labels) == np.sum(np.exp(x) > 2.0)
        assert value(reg, "mismatch_lr_zero_tokens_total", **labels) == np.sum(x == 0) > 0
        assert value(reg, "mismatch_outside_ppo_clip_tokens_total", **labels) == np.sum(
            (np.exp(x) <= 0.8) | (np.exp(x) > 1.2))
        assert value(reg, f"{HISTOGRAM}_count", **labels) == x.size
        assert value(reg, f"{HISTOGRAM}_sum", **labels) == pytest.approx(np.abs(x).sum(), rel=1e-12)
        for le in les:  # bucket bounds are bin edges: the counts are exact
            assert value(reg, f"{HISTOGRAM}_bucket", le=le, **labels) == np.sum(np.abs(x) <= float(le))
        assert value(reg, f"{HISTOGRAM}_bucket", le="+Inf", **labels) == x.size
    names = {s.name for f in families.values() for s in f.samples}
    for c in COUNTERS:
        assert c.name + "_total" in names
    assert {k for f in families.values() for s in f.samples for k in s.labels} <= {"pool", "hardware", "le", "label"}


def test_histogram_and_counters_sum_across_ranks():
    batch, *_ = make_batch(4)
    whole = MismatchExporter()
    whole.observe(0, compute_stats(batch))
    ranks = [MismatchExporter(), MismatchExporter()]
    for r, exporter in enumerate(ranks):  # each rank holds every other sequence
        rows = list(range(r, len(POOLS), 2))
        part, *_ = make_batch(4)
        lp = part.trainer_logprobs.view(len(POOLS), -1)[rows]
        sp = part.sampler_logprobs.view(len(POOLS), -1)[rows]
        shard = TokenBatch.from_padded(lp, sp, torch.ones_like(lp), labels={
            "pool": [POOLS[i] for i in rows], "hardware": [HARDWARE[i] for i in rows]})
        exporter.observe(0, compute_stats(shard))
    samples = lambda e: {(s.name, tuple(sorted(s.labels.items()))): s.value  # noqa: E731
                         for f in e.registry.collect() if f.type in ("counter", "histogram") for s in f.samples}
    summed: dict = {}
    for e in ranks:
        for k, v in samples(e).items():
            summed[k] = summed.get(k, 0.0) + v
    expected = samples(whole)
    assert summed.keys() == expected.keys()
    for k, v in expected.items():
        assert summed[k] == pytest.approx(v, rel=1e-12), k


def test_empty_slices_have_no_sample_and_unlabelled_rows_are_null():
    batch, lr, *_ = make_batch(5, nan_pool="int4")
    exporter = MismatchExporter()
    exporter.observe(0, compute_stats(batch))
    reg = exporter.registry
    assert value(reg, "mismatch_k3_kl_nats", pool="int4") is None          # null, never 0
    assert value(reg, "mismatch_data_quality_nonfinite_tokens", pool="int4") == 200
    assert value(reg, "mismatch_nonfinite_tokens_total", pool="int4", hardware="L40S") == 200
    assert value(reg, "mismatch_tokens_total", pool="int4", hardware="L40S") == 0
    plain = MismatchExporter()
    b = TokenBatch.from_padded(torch.from_numpy(-np.ones((2, 5))), torch.from_numpy(-np.ones((2, 5)) - 0.1),
                               torch.ones(2, 5))
    plain.observe(0, compute_stats(b))
    assert value(plain.registry, "mismatch_k3_kl_nats", pool="%null") == pytest.approx(math.expm1(0.1) - 0.1)
    assert value(plain.registry, "mismatch_tokens_total", pool="%null", hardware="%null") == 10
    plain.count_resync("fp8")
    plain.count_resync("fp8")
    assert value(plain.registry, "mismatch_resyncs_total", pool="fp8") == 2


def test_http_endpoint_binds_loopback_and_stops():
    exporter = MismatchExporter()
    exporter.observe(1, compute_stats(make_batch(6)[0]))
    port = exporter.start()
    try:
        assert exporter._server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'mismatch_ess_ratio{pool="fp8"}' in body and "mismatch_tokens_total{" in body
    finally:
        exporter.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples
            if not s.name.endswith("timestamp_seconds")}


def test_serve_exports_a_stored_run_like_the_live_exporter(tmp_path):
    run = tmp_path / "run"
    live = MismatchExporter()
    with MismatchCollector(run, exporter=live, alert_evaluator=AlertEvaluator(), flush_every_steps=2) as mc:
        for step in range(5):
            batch, *_ = make_batch(10 + step)
            mc.log_step(step, batch)
    # int4 runs with ESS < 0.5 for the whole run: one firing, one resync counted
    assert value(live.registry, "mismatch_resyncs_total", pool="int4") == 1
    served = MismatchExporter(config=query.run_config(run))
    assert load_run(served, query.connect(), run) == 4
    got, expected = _samples(served.registry), _samples(live.registry)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k

    # the command itself, in its own process, stopped by PID
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(run), "--port", "0", "--poll-seconds", "0.5"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {run} on http://127.0.0.1:"), line
        url = line.split(" on ")[1].split()[0]
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'mismatch_resyncs_total{pool="int4"} 1.0' in body
        assert "mismatch_last_step 4.0" in body
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
