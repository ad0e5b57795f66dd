"""Exporter scrape latency and memory (6 pools x 4 hardware); alert evaluation cost per step.

    python benchmarks/bench_alerts.py [--steps 10000] [--scrapes 200]

1. Scrape: median latency of ``GET /metrics`` on the exporter's own HTTP server, as a ratio to a
   baseline measured here: a registry of plain ``prometheus_client`` Gauges holding the same
   number of samples, served the same way. Also the time of ``exporter.observe`` plus the merge
   its background thread does (``process_queued``) for one step.
2. Memory: bytes held by the exporter after a step (tracemalloc), against the baseline registry.
3. Evaluation: ``AlertEvaluator.observe`` per step with every default rule over a ``--steps``
   history of 6 pools (growth rules read 50-step windows), as a ratio to
   ``metrics.report(stats, by=["pool"])`` on the 6 x 4 batch, the per-step work the collector
   already does. First and last 1,000 steps are timed apart: the cost must not grow with history.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
import urllib.request

import numpy as np
import pandas as pd
import torch
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from mismatch_monitor import metrics
from mismatch_monitor.alerts import DEFAULT_RULES, AlertEvaluator
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.exporter import MismatchExporter

POOLS, HARDWARE = 6, 4


def make_batch(tokens_per_cell: int = 1024, seq_len: int = 256, seed: int = 0) -> TokenBatch:
    """6 pools x 4 hardware, every cell with routing decisions, staleness and heavy tails."""
    g = torch.Generator().manual_seed(seed)
    per_cell = tokens_per_cell // seq_len
    B = POOLS * HARDWARE * per_cell
    mu = -(1.0 + 6.0 * torch.rand(B, seq_len, generator=g, dtype=torch.float64))
    lr = 0.05 * torch.randn(B, seq_len, generator=g, dtype=torch.float64)
    lr = torch.where(torch.rand(B, seq_len, generator=g) < 1e-3, 2.0 + lr, lr)
    experts = torch.randint(0, 64, (B, seq_len, 4, 2), generator=g)
    flipped = torch.where(torch.rand(B, seq_len, 4, 1, generator=g) < 0.05, (experts + 1) % 64, experts)
    cells = [(p, h) for p in range(POOLS) for h in range(HARDWARE) for _ in range(per_cell)]
    return TokenBatch.from_padded(
        mu + lr, mu, torch.ones(B, seq_len), trainer_experts=experts, sampler_experts=flipped,
        labels={"pool": [f"pool{p}" for p, _ in cells], "hardware": [f"hw{h}" for _, h in cells]},
        policy_version=torch.randint(0, 3, (B,), generator=g), trainer_version=3)


def scrape_ms(port: int, n: int) -> float:
    url = f"http://127.0.0.1:{port}/metrics"
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        urllib.request.urlopen(url, timeout=10).read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def baseline_registry(samples: int) -> CollectorRegistry:
    """Plain labelled Gauges holding ``samples`` samples (24 label sets per gauge)."""
    reg = CollectorRegistry()
    n_gauges = max(1, samples // (POOLS * HARDWARE))
    for i in range(n_gauges):
        g = Gauge(f"baseline_metric_{i}", "baseline", ["pool", "hardware"], registry=reg)
        for p in range(POOLS):
            for h in range(HARDWARE):
                g.labels(f"pool{p}", f"hw{h}").set(p + h * 0.5 + i)
    return reg


def held_bytes(build) -> tuple[object, int]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return obj, after - before


def bench_exporter(scrapes: int) -> None:
    stats = compute_stats(make_batch())
    exporter, exporter_bytes = held_bytes(lambda: _observed(stats))
    samples = sum(len(f.samples) for f in exporter.collect())
    t0 = time.perf_counter()
    reps = 20
    for step in range(reps):
        exporter.observe(step, stats)
        exporter.process_queued()   # observe only queues: time the merge its thread does too
    observe_ms = (time.perf_counter() - t0) / reps * 1e3
    base, base_bytes = held_bytes(lambda: baseline_registry(samples))
    port = exporter.start()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=base)
    try:
        scrape_ms(port, 5), scrape_ms(server.server_port, 5)     # warm up
        ours, theirs = scrape_ms(port, scrapes), scrape_ms(server.server_port, scrapes)
    finally:
        exporter.stop()
        server.shutdown()
        server.server_close()
    base_samples = sum(len(f.samples) for f in base.collect())
    print(f"exporter, {POOLS} pools x {HARDWARE} hardware: {samples} samples exposed")
    print(f"  observe + merge a step  {observe_ms:8.2f} ms")
    print(f"  scrape (median of {scrapes})  {ours:8.2f} ms   baseline {theirs:.2f} ms "
          f"({base_samples} plain Gauge samples)   ratio {ours / theirs:.2f}")
    print(f"  memory held             {exporter_bytes / 1024:8.0f} KiB  baseline {base_bytes / 1024:.0f} KiB"
          f"   ratio {exporter_bytes / base_bytes:.2f}   ({exporter_bytes / samples:.0f} B/sample)")


def _observed(stats) -> MismatchExporter:
    exporter = MismatchExporter()
    exporter.observe(0, stats)
    exporter.process_queued()
    return exporter


def synthetic_history(steps: int, seed: int = 0) -> pd.DataFrame:
    """``steps`` x 6 pools of every metric the default rules read, with occasional incidents."""
    rng = np.random.default_rng(seed)
    keys = sorted({k for r in DEFAULT_RULES for k in r.condition.metrics})
    n = steps * POOLS
    frame = pd.DataFrame({"step": np.repeat(np.arange(steps), POOLS),
                          "pool": np.tile([f"pool{p}" for p in range(POOLS)], steps)})
    for key in keys:
        frame[key] = rng.lognormal(-5, 0.3, n)
    frame["mismatch/ess"] = np.where(rng.random(n) < 0.01, 0.3, 0.97)
    frame["mismatch/log_ratio/mean"] = rng.normal(0, 1e-3, n)
    frame["mismatch/staleness/max"] = rng.integers(0, 6, n).astype(float)
    frame["mismatch/data_quality/nonfinite_tokens"] = (rng.random(n) < 1e-3).astype(float)
    frame["mismatch/k3_kl"] *= np.where(rng.random(n) < 0.01, 20.0, 1.0)
    return frame


def bench_evaluator(steps: int) -> None:
    history = synthetic_history(steps)
    frames = [f for _, f in history.groupby("step", sort=True)]
    evaluator = AlertEvaluator()
    times = np.empty(steps)
    events = 0
    for step, frame in enumerate(frames):
        t0 = time.perf_counter()
        events += len(evaluator.observe(step, 0.0, frame))
        times[step] = time.perf_counter() - t0
    stats = compute_stats(make_batch())
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        metrics.report(stats, ["pool"])
    report_ms = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    AlertEvaluator.replay(history)
    replay_s = time.perf_counter() - t0
    per_step = times.mean() * 1e3
    print(f"alert evaluation, {len(DEFAULT_RULES)} rules, {POOLS} pools, {steps} steps ({events} events)")
    print(f"  observe per step        {per_step:8.3f} ms   baseline report(by=pool) {report_ms:.2f} ms"
          f"   ratio {per_step / report_ms:.3f}")
    print(f"  first / last 1000 steps {times[:1000].mean() * 1e3:8.3f} / {times[-1000:].mean() * 1e3:.3f} ms")
    print(f"  replay of the history   {replay_s:8.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_exporter(args.scrapes)
    bench_evaluator(args.steps)


if __name__ == "__main__":
    main()
