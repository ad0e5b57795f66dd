"""Cost of the multi-rank reduction per step, against the metric computation itself.

    python benchmarks/bench_distributed.py [--tokens 100000 1000000] [--steps 10]

Two ranks (torch.multiprocessing, gloo on 127.0.0.1, one torch thread each). Per step each rank
computes the statistics of its own share (``compute_stats`` + tail exemplars), then the
:class:`DistributedReducer` gathers and merges them on rank 0 (``reduce``) or everywhere
(``all-ranks``). The reduction is also split into its two parts: the collective alone
(``gather_object`` of the pickled tables) and the merge alone (``engine.merge`` plus the
exemplar top K, on rank 0). Times are medians over ``--steps`` steps, taken after a barrier, and
printed as ratios to ``compute_stats`` measured in the same run on the same batch.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def make_batch(n_tokens: int, seed: int):
    from mismatch_monitor.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    B = max(1, n_tokens // 512)
    lengths = torch.full((B,), n_tokens // B)
    lengths[-1] += n_tokens - int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    trainer = -torch.rand(n_tokens, generator=g) * 6
    lr = torch.randn(n_tokens, generator=g) * 1e-3
    lr = torch.where(torch.rand(n_tokens, generator=g) < 1e-3, torch.rand(n_tokens, generator=g) * 4 + 1, lr)
    seq = torch.repeat_interleave(torch.arange(B), lengths)
    return TokenBatch.from_flat(
        trainer.to(torch.bfloat16), (trainer - lr).clamp(max=0).to(torch.bfloat16), seq_offsets=offsets,
        labels={"pool": [f"pool{i % 6}" for i in range(B)], "hardware": [f"hw{i % 4}" for i in range(B)]},
        turn_index=(torch.arange(n_tokens) - offsets[:-1][seq]) // 128)


def timed(fn, steps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _merge_time(parts) -> float:
    from mismatch_monitor.collectors.distributed import merge_parts

    t0 = time.perf_counter()
    merge_parts(parts, 16)
    return time.perf_counter() - t0


def worker(rank: int, port: int, sizes: list[int], steps: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from mismatch_monitor.collectors.distributed import DistributedReducer, Shard
    from mismatch_monitor.engine import compute_stats
    from mismatch_monitor.exemplars import tail_exemplars

    gather, all_gather = DistributedReducer(exemplars_k=16), DistributedReducer(exemplars_k=16, all_ranks=True)
    if rank == 0:
        print(f"2 ranks, gloo on 127.0.0.1, one thread per rank; medians over {steps} steps; "
              "ratios are to the engine time")
        print(f"{'tokens/rank':>12} {'cells':>6} {'engine s':>9} {'exemplars s':>12} {'collective s':>13} "
              f"{'merge s':>8} {'reduce s':>9} {'ratio':>6} {'all-ranks s':>12} {'ratio':>6}")
    for n in sizes:
        batch = make_batch(n, seed=rank)
        engine, stats = timed(lambda: compute_stats(batch), steps)
        ex_time, ex = timed(lambda: tail_exemplars(batch, 16), steps)
        payload = Shard(None, stats.tables, tuple(stats.dims), ex, rank)
        parts = [None] * WORLD if rank == 0 else None
        c_time, _ = timed(lambda: dist.gather_object(payload, parts, dst=0), steps)
        m_time = statistics.median(_merge_time(parts) for _ in range(steps)) if rank == 0 else 0.0
        g_time, _ = timed(lambda: gather(stats, ex), steps)
        a_time, _ = timed(lambda: all_gather(stats, ex), steps)
        if rank == 0:
            print(f"{n:>12,} {len(stats['tokens']):>6} {engine:>9.4f} {ex_time:>12.4f} {c_time:>13.4f} "
                  f"{m_time:>8.4f} {g_time:>9.4f} {g_time / engine:>6.2f} {a_time:>12.4f} {a_time / engine:>6.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.tokens, args.steps), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
