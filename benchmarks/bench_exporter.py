"""What many label values cost the training thread, the exporter and a scrape.

    python benchmarks/bench_exporter.py [--pools 1 100 10000] [--tokens 320000] [--steps 5]

The same batch (``--tokens`` tokens in sequences of 32) with its sequences spread over 1, 100
or 10,000 pools (4 hardware labels), so only the number of label values changes. Per pool
count, in the same run, each as a ratio to ``compute_stats`` on that batch (the engine, timed
alternately with the others):

1. ``MismatchCollector.log_step`` with the exporter and the default alert rules, as the
   training thread sees it (the exporter's merge runs on its background thread);
2. the same collector without an exporter;
3. the exporter's merge of one step (``process_queued``, the work the background thread does);
4. a scrape: ``generate_latest`` time, bytes and samples, with the default label limit.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from prometheus_client import generate_latest

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.exporter import MismatchExporter
from mismatch_monitor.label_limits import DEFAULT_MAX_VALUES
from mismatch_monitor.report_keys import CardinalityWarning

SEQ_LEN = 32


def make_batch(pools: int, tokens: int, seed: int = 0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    B = tokens // SEQ_LEN
    mu = -(1.0 + 6.0 * torch.rand(B, SEQ_LEN, generator=g))
    lr = 0.05 * torch.randn(B, SEQ_LEN, generator=g)
    lr = torch.where(torch.rand(B, SEQ_LEN, generator=g) < 1e-3, 2.0 + lr, lr)
    return TokenBatch.from_padded((mu + lr).clamp(max=0.0), mu, torch.ones(B, SEQ_LEN), labels={
        "pool": [f"pool{i % pools}" for i in range(B)], "hardware": [f"hw{i % 4}" for i in range(B)]})


def measure(pools: int, tokens: int, steps: int, root: Path) -> dict[str, float]:
    batch = make_batch(pools, tokens)
    exporter = MismatchExporter()
    engine, with_exp, without_exp, merge = [], [], [], []
    with MismatchCollector(root / f"exp{pools}", exporter=exporter) as mc, \
            MismatchCollector(root / f"plain{pools}") as plain:
        for step in range(steps + 1):   # step 0 warms up and is not counted
            t0 = time.perf_counter()
            compute_stats(batch)
            t1 = time.perf_counter()
            mc.log_step(step, batch)
            t2 = time.perf_counter()
            exporter.process_queued()   # whatever the background thread has not finished yet
            t3 = time.perf_counter()
            plain.log_step(step, batch)
            t4 = time.perf_counter()
            if step:
                engine.append(t1 - t0), with_exp.append(t2 - t1), without_exp.append(t4 - t3)
        stats = compute_stats(batch)
        for step in range(steps):      # the background thread's work, timed on its own
            exporter.observe(steps + 1 + step, stats)
            t0 = time.perf_counter()
            exporter.process_queued()
            merge.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        body = generate_latest(exporter.registry)
        scrape = time.perf_counter() - t0
    base = statistics.median(engine)
    return {"engine_s": base, "log_step": statistics.median(with_exp) / base,
            "log_step_no_exporter": statistics.median(without_exp) / base,
            "merge": statistics.median(merge) / base, "scrape": scrape / base, "scrape_s": scrape,
            "scrape_bytes": len(body),
            "samples": sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 100, 10_000])
    parser.add_argument("--tokens", type=int, default=320_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore", CardinalityWarning)   # expected here: the report merges pools past the limit
    root = Path(tempfile.mkdtemp(prefix="bench_exporter_"))
    try:
        print(f"{args.tokens:,} tokens per step, label limit {DEFAULT_MAX_VALUES}; ratios to compute_stats "
              "on the same batch (median of %d steps)" % args.steps)
        print(f"{'pools':>7} {'engine s':>9} {'log_step':>9} {'no exporter':>12} {'merge':>7} "
              f"{'scrape':>7} {'scrape s':>9} {'scrape KB':>10} {'samples':>8}")
        for pools in args.pools:
            r = measure(pools, args.tokens, args.steps, root)
            print(f"{pools:>7,} {r['engine_s']:>9.3f} {r['log_step']:>9.2f} {r['log_step_no_exporter']:>12.2f} "
                  f"{r['merge']:>7.2f} {r['scrape']:>7.2f} {r['scrape_s']:>9.3f} {r['scrape_bytes'] / 1e3:>10.1f} "
                  f"{r['samples']:>8,}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
