"""Cost of the multi-rank reduction per step, against the metric computation itself.

    python benchmarks/bench_distributed.py [--world 2 4] [--tokens 100000] [--steps 10]

W ranks (torch.multiprocessing, gloo on 127.0.0.1, one torch thread each), each with the engine
benchmark's slicing (6 pools x 4 hardware x 8 length x 8 turn buckets). Per step each rank
computes the statistics of its own share (``compute_stats`` + tail exemplars), then the
:class:`DistributedReducer` packs them, gathers them and merges them on rank 0 (``reduce``) or
everywhere (``all-ranks``). Split out: ``pack`` (statistics and exemplars: a rank's only work
besides the collective), the collective alone (``gather_object`` of the packed shard) and the
merge alone (``merge_parts`` on rank 0); ``others`` is the slowest other rank's ``reduce`` (its
critical path). Times are medians over ``--steps`` steps, taken after a barrier, printed as
ratios to ``compute_stats`` measured in the same run on the same batch. The merge at W up to 64 is ``bench_merge.py``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def make_batch(n_tokens: int, seed: int):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_engine import make_data

    return make_data(n_tokens, seed=seed).batch


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


def worker(rank: int, world: int, port: int, sizes: list[int], steps: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from bench_engine import CONFIG

    from mismatch_monitor.collectors.distributed import DistributedReducer, shard
    from mismatch_monitor.engine import compute_stats
    from mismatch_monitor.exemplars import tail_exemplars

    gather, all_gather = DistributedReducer(exemplars_k=16), DistributedReducer(exemplars_k=16, all_ranks=True)
    if rank == 0:
        print(f"{world} ranks, gloo on 127.0.0.1, one thread per rank; medians over {steps} steps; "
              "ratios are to the engine time")
        print(f"{'tokens/rank':>12} {'kB/rank':>8} {'engine s':>9} {'pack s':>7} {'collective s':>13} "
              f"{'merge s':>8} {'reduce s':>9} {'ratio':>6} {'others s':>9} {'ratio':>6} {'all-ranks s':>12} {'ratio':>6}")
    for n in sizes:
        batch = make_batch(n, seed=rank)
        engine, stats = timed(lambda: compute_stats(batch, CONFIG), steps)
        tails = tail_exemplars(batch, 16, CONFIG)
        ex = tails.frames() if hasattr(tails, "frames") else tails
        p_time, payload = timed(lambda: shard(stats, ex, rank), steps)     # statistics and exemplars packed
        parts = [None] * world if rank == 0 else None
        c_time, _ = timed(lambda: dist.gather_object(payload, parts, dst=0), steps)
        m_time = statistics.median(_merge_time(parts) for _ in range(steps)) if rank == 0 else 0.0
        g_time, _ = timed(lambda: gather(stats, ex), steps)
        a_time, _ = timed(lambda: all_gather(stats, ex), steps)
        reduce_times = [None] * world
        dist.all_gather_object(reduce_times, g_time)
        others = max(reduce_times[1:])
        if rank == 0:
            kb = len(pickle.dumps(payload)) / 1e3
            print(f"{n:>12,} {kb:>8.0f} {engine:>9.4f} {p_time:>7.4f} {c_time:>13.4f} {m_time:>8.4f} {g_time:>9.4f} "
                  f"{g_time / engine:>6.2f} {others:>9.4f} {others / engine:>6.2f} {a_time:>12.4f} {a_time / engine:>6.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[100_000])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    for world in args.world:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(world, port, args.tokens, args.steps), nprocs=world, join=True)


if __name__ == "__main__":
    main()
