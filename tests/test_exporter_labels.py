"""Exported label values name one slice each (none reads as the fleet series), the label limit
merges the values beyond it exactly, and ``observe`` leaves the work to a background thread.
References are numpy over the log-probs each batch was built from; one test scrapes with a real
Prometheus. Runtime: about 10 s.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mismatch_monitor import exporter as exporter_module
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import MismatchStats, compute_stats
from mismatch_monitor.exporter import MERGED, MismatchExporter
from mismatch_monitor.label_limits import LabelLimit
from mismatch_monitor.report_keys import OTHER_TEXT, label_text

from external_tools import needs

CONFIG = MetricConfig(kernel="torch")   # the exporter does not depend on how the engine ran
# values that used to share a series: "" read as the fleet, None and "unknown" were summed
TRICKY = ["", None, "unknown", "a/b", "a%2Fb", "%null"]


def make_batch(pools: list, tokens: list[int], hardware: list | None = None, seed: int = 0):
    """One sequence per entry; returns (batch, lr of each sequence)."""
    rng = np.random.default_rng(seed)
    T = max(tokens)
    mu = -rng.uniform(8.0, 12.0, size=(len(pools), T))
    lr = rng.normal(0.0, 0.1, size=(len(pools), T)) * (1 + np.arange(len(pools)) % 7)[:, None]
    mask = np.arange(T)[None, :] < np.array(tokens)[:, None]
    labels = {"pool": pools, "hardware": hardware or ["H100"] * len(pools)}
    batch = TokenBatch.from_padded(torch.from_numpy(mu + lr), torch.from_numpy(mu), torch.from_numpy(mask),
                                   labels=labels)
    return batch, [lr[i, :n] for i, n in enumerate(tokens)]


def k3(x: np.ndarray) -> float:
    return float(np.mean(np.expm1(x) - x))


def scrape(exporter: MismatchExporter) -> list:
    """Every sample of the exposition text, as Prometheus' text format parser reads it."""
    text = generate_latest(exporter.registry).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def test_label_values_never_collide_and_never_read_as_the_fleet():
    tokens = [20, 30, 40, 50, 60, 70]
    batch, lrs = make_batch(TRICKY, tokens)
    exporter = MismatchExporter()
    exporter.observe(0, compute_stats(batch, CONFIG))
    samples = scrape(exporter)
    assert all(v != "" for s in samples for v in s.labels.values())      # pool="" would be the fleet
    n_tokens = {s.labels.get("pool"): s.value for s in samples if s.name == "mismatch_n_tokens"
                and "hardware" not in s.labels}
    assert n_tokens == {None: sum(tokens), **{label_text(p): n for p, n in zip(TRICKY, tokens)}}
    reg = exporter.registry
    for pool, x in zip(TRICKY, lrs):
        text = label_text(pool)
        assert reg.get_sample_value("mismatch_k3_kl_nats", {"pool": text}) == pytest.approx(k3(x), rel=1e-9)
        assert reg.get_sample_value("mismatch_tokens_total", {"pool": text, "hardware": "H100"}) == x.size
    exporter.count_resync(label_text(""))
    exporter.count_resync(None)                                           # a fleet-wide alert
    assert reg.get_sample_value("mismatch_resyncs_total", {"pool": "%empty"}) == 1
    assert reg.get_sample_value("mismatch_resyncs_total", {}) == 1


def test_values_beyond_the_limit_are_merged_exactly_and_admission_is_sticky(caplog):
    exporter = MismatchExporter(limit=LabelLimit(2))
    pools = ["a", "b", "c", "d", None]
    first, lr1 = make_batch(pools, [50, 40, 30, 20, 10], hardware=["H1", "H2", "H3", "H1", "H2"], seed=1)
    with caplog.at_level(logging.WARNING, "mismatch_monitor"):
        exporter.observe(0, compute_stats(first, CONFIG))
        exporter.process_queued()
        second, lr2 = make_batch(["e", "a"], [90, 5], hardware=["H1", "H1"], seed=2)   # e: most tokens, too late
        exporter.observe(1, compute_stats(second, CONFIG))
        exporter.process_queued()
    assert sum("merged as %other" in r.getMessage() for r in caplog.records) == 1     # warned once
    reg = exporter.registry
    value = lambda name, **labels: reg.get_sample_value(name, labels)  # noqa: E731
    # gauges: the latest step; "e" is not admitted, so it is the whole of %other
    assert value("mismatch_k3_kl_nats", pool="a") == pytest.approx(k3(lr2[1]), rel=1e-9)
    assert value("mismatch_k3_kl_nats", pool=OTHER_TEXT) == pytest.approx(k3(lr2[0]), rel=1e-9)
    assert value("mismatch_k3_kl_nats", pool="e") is None
    assert value(MERGED, label="pool") == 1 and value(MERGED, label="hardware") == 0
    assert value("mismatch_n_tokens") == 95
    # counters: both steps; a, b admitted at step 0 (most tokens), everything else merged by cell
    assert value("mismatch_tokens_total", pool="a", hardware="H1") == 55
    assert value("mismatch_tokens_total", pool="b", hardware="H2") == 40
    assert value("mismatch_tokens_total", pool=OTHER_TEXT, hardware="H1") == 20 + 90   # d and e
    assert value("mismatch_tokens_total", pool=OTHER_TEXT, hardware="H2") == 10        # the unlabelled pool
    assert value("mismatch_tokens_total", pool=OTHER_TEXT, hardware=OTHER_TEXT) == 30  # c on H3 (H1, H2 admitted)
    rest = np.concatenate([lr1[3], lr2[0]])
    assert value("mismatch_token_abs_log_ratio_sum", pool=OTHER_TEXT, hardware="H1") == pytest.approx(
        np.abs(rest).sum(), rel=1e-12)
    pools_seen = {s.labels["pool"] for s in scrape(exporter) if "pool" in s.labels}
    assert pools_seen == {"a", "b", OTHER_TEXT}


def test_a_fleet_of_ten_thousand_pools_scrapes_in_bounded_size():
    P = 10_000
    batch, lrs = make_batch([f"p{i}" for i in range(P)], [4 + i % 5 for i in range(P)],
                            hardware=[f"hw{i % 4}" for i in range(P)])
    exporter = MismatchExporter(limit=LabelLimit(50))
    exporter.observe(0, compute_stats(batch, CONFIG))
    samples = scrape(exporter)
    assert len({s.labels["pool"] for s in samples if "pool" in s.labels}) == 51
    assert exporter.registry.get_sample_value(MERGED, {"label": "pool"}) == P - 50
    every = np.concatenate(lrs)
    assert exporter.registry.get_sample_value("mismatch_k3_kl_nats", {}) == pytest.approx(k3(every), rel=1e-9)
    total = sum(s.value for s in samples if s.name == "mismatch_tokens_total")
    assert total == every.size


def test_observe_hands_the_work_to_a_background_thread(monkeypatch):
    gate, entered, threads = threading.Event(), threading.Event(), []
    real = exporter_module.cells_of

    def held(stats, admission):
        threads.append(threading.current_thread())
        entered.set()
        assert gate.wait(30)
        return real(stats, admission)

    monkeypatch.setattr(exporter_module, "cells_of", held)
    exporter = MismatchExporter()
    steps = [make_batch(["a", "b"], [10, 20], seed=s) for s in range(4)]
    for s, (batch, _) in enumerate(steps):
        exporter.observe(s, compute_stats(batch, CONFIG))   # returns while the merge waits on the gate
    assert entered.wait(30)                          # the merge started, on another thread
    assert all(t is not threading.main_thread() for t in threads)
    gate.set()
    reg = exporter.registry
    assert reg.get_sample_value("mismatch_last_step", {}) == 3         # the scrape took in every step
    assert reg.get_sample_value("mismatch_tokens_total", {"pool": "a", "hardware": "H100"}) == 40
    assert reg.get_sample_value("mismatch_k3_kl_nats", {"pool": "b"}) == pytest.approx(k3(steps[3][1][1]), rel=1e-9)


def test_observe_waits_instead_of_queueing_without_bound(monkeypatch):
    gate = threading.Event()
    real = exporter_module.cells_of

    def held(stats, admission):
        assert gate.wait(30)
        return real(stats, admission)

    monkeypatch.setattr(exporter_module, "cells_of", held)
    exporter = MismatchExporter()
    stats = compute_stats(make_batch(["a"], [10])[0], CONFIG)
    done = threading.Event()

    def train() -> None:
        for step in range(exporter_module.QUEUE_LIMIT + 2):   # the first is taken by the thread at once
            exporter.observe(step, stats)
        done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    assert not done.wait(1.0)                # past the limit, observe waits for the merge
    assert len(exporter._queue) <= exporter_module.QUEUE_LIMIT + 1
    gate.set()
    trainer.join(30)
    assert done.is_set()
    assert exporter.registry.get_sample_value("mismatch_tokens_total", {"pool": "a", "hardware": "H100"}) == \
        10 * (exporter_module.QUEUE_LIMIT + 2)            # nothing dropped


def test_a_step_that_fails_to_export_is_counted_and_logged(caplog):
    exporter = MismatchExporter()
    good, _ = make_batch(["a"], [10])
    stats = compute_stats(good, CONFIG)
    broken = MismatchStats({t: df for t, df in stats.tables.items() if t != "abs_hist"}, stats.dims)
    with caplog.at_level(logging.ERROR, "mismatch_monitor"):
        exporter.observe(0, broken)
        exporter.process_queued()
    assert exporter.errors == 1 and "KeyError" in exporter.last_error
    assert any("could not be exported" in r.getMessage() for r in caplog.records)
    exporter.observe(1, stats)
    assert exporter.registry.get_sample_value("mismatch_exporter_errors_total", {}) == 1
    assert exporter.registry.get_sample_value("mismatch_last_step", {}) == 1


@needs("prometheus")
def test_prometheus_keeps_every_pool_apart_from_the_fleet(tmp_path):
    from test_prometheus_live import instant, prometheus

    tokens = [20, 30, 40, 50, 60, 70]
    batch, _ = make_batch(TRICKY, tokens)
    exporter = MismatchExporter()
    exporter.observe(0, compute_stats(batch, CONFIG))
    port = exporter.start()
    try:
        with prometheus(tmp_path, port, "groups: []\n") as url:
            for _ in range(100):
                series = instant(url, "mismatch_n_tokens")
                if series:
                    break
                time.sleep(0.2)
            got = {s["metric"].get("pool"): float(s["value"][1]) for s in series if "hardware" not in s["metric"]}
            assert got == {None: sum(tokens), **{label_text(p): n for p, n in zip(TRICKY, tokens)}}
            fleet = instant(url, 'mismatch_n_tokens{pool="",hardware=""}')      # the alert rules' fleet selector
            assert [float(s["value"][1]) for s in fleet] == [sum(tokens)]
            assert instant(url, "up")[0]["value"][1] == "1"
    finally:
        exporter.stop()


def test_fleet_wide_resyncs_have_no_pool_label_live_and_served(tmp_path):
    from mismatch_monitor import query
    from mismatch_monitor.alerts import AlertEvaluator, AlertRule, Compare
    from mismatch_monitor.cli.serve import load_run
    from mismatch_monitor.collectors import MismatchCollector

    rules = (AlertRule(name="FleetTokens", condition=Compare("mismatch/n_tokens", ">", 0.0), scope="fleet",
                       severity="critical", summary="s", description="d", runbook="r", fix="resync", resync=True),
             AlertRule(name="PoolTokens", condition=Compare("mismatch/n_tokens", ">", 0.0), scope="pool",
                       severity="critical", summary="s", description="d", runbook="r", fix="resync", resync=True))
    live = MismatchExporter(config=CONFIG)
    with MismatchCollector(tmp_path / "run", config=CONFIG, exporter=live, alert_evaluator=AlertEvaluator(rules)) as mc:
        for step in range(3):
            mc.log_step(step, make_batch([None, "unknown"], [10, 10], seed=step)[0])
    served = MismatchExporter(config=CONFIG)
    load_run(served, query.connect(), tmp_path / "run")
    for exporter in (live, served):
        resyncs = {tuple(sorted(s.labels.items())): s.value for s in scrape(exporter)
                   if s.name == "mismatch_resyncs_total"}
        assert resyncs == {(): 1.0, (("pool", "%null"),): 1.0, (("pool", "unknown"),): 1.0}


def test_serve_takes_the_label_limit_and_refuses_a_bad_one(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from mismatch_monitor.collectors import MismatchCollector

    with MismatchCollector(tmp_path / "run", config=CONFIG, alert_evaluator=None) as mc:
        mc.log_step(0, make_batch(["big", "small", "tiny"], [30, 20, 10])[0])
    serve = ("import argparse, sys; from mismatch_monitor.cli import serve; p = argparse.ArgumentParser(); "
             "serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))")
    bad = subprocess.run([sys.executable, "-c", serve, str(tmp_path / "run"), "--max-label-values", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "expected LabelLimit.max_values to be an integer >= 1, got 0" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-c", serve, str(tmp_path / "run"), "--port", "0",
                             "--max-label-values", "1"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(" on ")[1].split()[0]
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'mismatch_n_tokens{pool="big"} 30.0' in body and 'mismatch_n_tokens{pool="%other"} 30.0' in body
        assert 'pool="small"' not in body and 'mismatch_label_values_merged{label="pool"} 2.0' in body
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
