"""Collector overhead, bytes on disk, and query times on a long run.

    python benchmarks/bench_collector.py [--sizes 100000 1000000 8000000] [--steps 10000]

1. Cost of ``MismatchCollector.log_step`` on the raw tensors per step (validation, engine, exemplars, reports,
   alert evaluation, bookkeeping and the Parquet flushes at the default interval, plus the
   final ``close()``) as a ratio to ``compute_stats`` alone, timed alternately step by step in
   the same run on the same batch; wall-clock and process-CPU ratios.
2. Bytes on disk per step per 1,000 cells.
3. The padded layout verl and OpenRLHF pass (``--padded B T``, default 2048 x 4096 slots):
   ``TokenBatch.from_padded`` plus ``compute_stats`` as a ratio to ``compute_stats`` on the same
   tokens given flat, timed alternately in the same run; and the same with the compiled mask
   scan switched off (``padded_native``: the numpy path a build without it takes).
4. ``summary`` and a by-pool series query on a run of ``--steps`` steps (the same step's
   statistics written ``--steps`` times through the real writer, flushed every 100 steps), as
   absolute times and as ratios to a bare ``count(*)`` over the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mismatch_monitor import padded_native, query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.cli import main as cli_main
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.store import RunWriter
from timing import durations


def make_fields(n_tokens: int, seq_len: int = 512, seed: int = 0) -> dict:
    """Flat tensors as a trainer hands them over: 6 pools x 4 hardware labels, turns 0..15,
    heavy-tailed log ratios."""
    g = torch.Generator().manual_seed(seed)
    B = max(1, n_tokens // seq_len)
    lengths = torch.randint(seq_len // 8, 2 * seq_len, (B,), generator=g)
    lengths = (lengths.double() * n_tokens / lengths.sum()).long().clamp(min=1)
    lengths[-1] += n_tokens - int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    trainer = -torch.rand(n_tokens, generator=g) * 6.0
    lr = torch.randn(n_tokens, generator=g) * 1e-3
    tail = torch.rand(n_tokens, generator=g) < 1e-3
    lr = torch.where(tail, torch.rand(n_tokens, generator=g) * 4 + 1, lr)
    sampler = (trainer - lr).clamp(max=0)
    seq = torch.repeat_interleave(torch.arange(B), lengths)
    turn = (torch.arange(n_tokens) - offsets[:-1][seq]) // 128
    return dict(
        trainer_logprobs=trainer.to(torch.bfloat16), sampler_logprobs=sampler.to(torch.bfloat16),
        seq_offsets=offsets,
        labels={"pool": [f"pool{i % 6}" for i in range(B)], "hardware": [f"hw{i % 4}" for i in range(B)]},
        turn_index=turn)


def make_batch(n_tokens: int, seq_len: int = 512, seed: int = 0) -> TokenBatch:
    return TokenBatch.from_flat(**make_fields(n_tokens, seq_len, seed))


def best_of(fn, repeat: int) -> float:
    return min(durations(fn, repeat))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def steps_for(n_tokens: int) -> int:
    """Enough steps for several default flushes (every 100 steps or 10 s) at every size."""
    return 600 if n_tokens <= 200_000 else 300 if n_tokens <= 2_000_000 else 60


def bench_overhead(sizes: list[int], tmp: Path) -> None:
    print("collector cost per step vs the metric engine alone (same batch, same run)")
    print("  each step times compute_stats on a built batch, then log_step on the raw tensors (so it")
    print("  validates them; default flushing: every 100 steps or 10 s);")
    print("  the collector total includes close(), which writes what is still buffered")
    print(f"{'tokens':>10} {'steps':>6} {'engine s':>10} {'collector s':>12} {'ratio':>7} {'cpu ratio':>10} "
          f"{'cells':>6} {'bytes/step/1k cells':>20}")
    for n in sizes:
        fields = make_fields(n)
        batch = TokenBatch.from_flat(**fields)
        steps = steps_for(n)
        run = tmp / f"overhead-{n}"
        engine = collector = engine_cpu = collector_cpu = 0.0
        with MismatchCollector(run) as mc:
            mc.log_step(0, **fields)                    # warm-up: run.json, first files, caches
            mc.flush()
            compute_stats(batch)
            for step in range(1, steps + 1):            # interleaved: both see the same machine state
                t0, c0 = time.perf_counter(), time.process_time()
                compute_stats(batch)
                t1, c1 = time.perf_counter(), time.process_time()
                mc.log_step(step, **fields)
                t2, c2 = time.perf_counter(), time.process_time()
                engine += t1 - t0
                collector += t2 - t1
                engine_cpu += c1 - c0
                collector_cpu += c2 - c1
            t0, c0 = time.perf_counter(), time.process_time()
            mc.close()
            collector += time.perf_counter() - t0
            collector_cpu += time.process_time() - c0
        cells = len(compute_stats(batch)["tokens"])
        per_step = dir_bytes(run) / (steps + 1)
        print(f"{n:>10} {steps:>6} {engine / steps:>10.4f} {collector / steps:>12.4f} {collector / engine:>7.3f} "
              f"{collector_cpu / engine_cpu:>10.3f} {cells:>6} {per_step / cells * 1000:>20,.0f}")


def make_padded(B: int, T: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """``[B, T]`` tensors as verl hands them over: a left-padded prompt of 64..1023 slots, then a
    response of 16..T-1024 tokens, then right padding; the response mask is 1 on the response."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(64, 1024, (B,), generator=g)
    response = torch.randint(16, T - 1024, (B,), generator=g)
    slot = torch.arange(T)
    mask = (slot >= prompt[:, None]) & (slot < (prompt + response)[:, None])
    trainer = -torch.rand(B, T, generator=g) * 6.0
    sampler = (trainer - torch.randn(B, T, generator=g) * 1e-3).clamp(max=0)
    fields = dict(trainer_logprobs=trainer.to(torch.bfloat16), sampler_logprobs=sampler.to(torch.bfloat16),
                  labels={"pool": [f"pool{i % 6}" for i in range(B)]})
    return fields, mask.to(torch.int64)        # verl's attention-style masks are integers


def bench_padded(B: int, T: int, repeat: int = 5) -> None:
    fields, mask = make_padded(B, T)
    padded = TokenBatch.from_padded(response_mask=mask, **fields)
    flat = TokenBatch.from_flat(padded.trainer_logprobs, padded.sampler_logprobs,
                                seq_offsets=padded.seq_offsets, labels=fields["labels"])
    compute_stats(flat)                                 # warm-up
    compiled = padded_native.library

    def numpy_rows() -> None:                           # the same with the mask scan not built
        padded_native.library = lambda: None
        try:
            compute_stats(TokenBatch.from_padded(response_mask=mask, **fields))
        finally:
            padded_native.library = compiled

    engine = build = both = plain = float("inf")
    for _ in range(repeat):                             # interleaved: the same machine state
        engine = min(engine, best_of(lambda: compute_stats(flat), 1))
        build = min(build, best_of(lambda: TokenBatch.from_padded(response_mask=mask, **fields), 1))
        both = min(both, best_of(lambda: compute_stats(TokenBatch.from_padded(response_mask=mask, **fields)), 1))
        plain = min(plain, best_of(numpy_rows, 1))
    print(f"\npadded input [{B}, {T}] ({padded.num_tokens:,} response tokens), best of {repeat}; "
          f"compiled mask scan {'built' if compiled() is not None else 'NOT built'}")
    print(f"{'engine on flat s':>17} {'from_padded s':>14} {'padded->stats s':>16} {'x engine':>9} "
          f"{'numpy rows s':>13} {'x engine':>9}")
    print(f"{engine:>17.4f} {build:>14.4f} {both:>16.4f} {both / engine:>9.2f} {plain:>13.4f} {plain / engine:>9.2f}")


def bench_queries(steps: int, tmp: Path) -> None:
    run = tmp / "long"
    stats = compute_stats(make_batch(100_000, seed=1))
    cells = len(stats["tokens"])
    writer = RunWriter(run, config=MetricConfig(), flush_every_steps=100, flush_every_seconds=1e9)
    t0 = time.perf_counter()
    for s in range(steps):
        writer.append_step(s, stats, wall_time=1.7e9 + s)
    writer.close()
    write_s = time.perf_counter() - t0
    size = dir_bytes(run)
    print(f"\nrun of {steps} steps x {cells} cells: written in {write_s:.1f} s, {size / 1e6:.1f} MB "
          f"({size / steps / cells * 1000:,.0f} bytes per step per 1k cells)")
    con = query.connect()
    files = query.table_files(run, "tokens")

    def count_scan() -> None:
        con.execute("SELECT count(*) FROM read_parquet($f)", {"f": files}).fetchall()

    def summary() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            cli_main(["summary", str(run)])

    def series() -> None:
        query.metric_series(con, run, ["pool"], metrics=["mismatch/k3_kl", "mismatch/ess"])

    def series_p99() -> None:
        query.metric_series(con, run, ["pool"], metrics=["mismatch/abs_log_ratio/p99"])

    base = best_of(count_scan, 5)
    print(f"{'query':<34} {'seconds':>8} {'x count(*)':>11}")
    print(f"{'count(*) over tokens files':<34} {base:>8.3f} {1.0:>11.1f}")
    for name, fn in (("summary (CLI)", summary), ("by-pool series k3, ESS", series),
                     ("by-pool series p99 (histograms)", series_p99)):
        t = best_of(fn, 3)
        print(f"{name:<34} {t:>8.3f} {t / base:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 8_000_000])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--padded", type=int, nargs=2, default=[2048, 4096], metavar=("B", "T"))
    parser.add_argument("--only-padded", action="store_true", help="run only the padded-input part")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="mm-bench-"))
    try:
        if not args.only_padded:
            bench_overhead(args.sizes, tmp)
        bench_padded(*args.padded)
        if not args.only_padded:
            bench_queries(args.steps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
