"""The writer rank's merge of W ranks' statistics, simulated in one process, against one rank's engine.

    python benchmarks/bench_merge.py [--tokens 100000] [--worlds 2 4 8 16 32 64] [--repeat 5]

Each simulated rank holds ``--tokens`` tokens with the engine benchmark's slicing (6 pools x 4
hardware x 8 length x 8 turn buckets, log-uniform lengths, heavy-tailed lr; its own seed), and
sends what ``DistributedReducer`` sends: its statistics and tail exemplars packed
(``collectors.distributed.shard``: ``rank_payload.py``, ``rank_exemplars.py``). Per rank, medians
over ``--repeat``:

- ``engine``: ``compute_stats`` on one rank's batch (the baseline of every ratio);
- ``pack``: packing its statistics and exemplars (the rank's only work besides the collective);
- ``pickle frames``: pickling the statistics' frames, which the shard used to carry instead;
- bytes of both payloads (the pickled shard, exemplars included, as ``gather_object`` sends it).

Per W, on the writer: ``unpickle`` (``gather_object`` does it on the destination), ``merge``
(``merge_parts``: the packed merge and the exemplars' top K) and, for comparison, ``frames``:
``engine.merge`` of the W frames plus the same exemplar merge, the merge the writer used to run.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import CONFIG, make_data  # noqa: E402
from timing import durations  # noqa: E402

from mismatch_monitor.collectors.distributed import merge_parts, shard  # noqa: E402
from mismatch_monitor.engine import compute_stats, merge  # noqa: E402
from mismatch_monitor.exemplars import merge_exemplars, tail_exemplars  # noqa: E402

K = 16


def median(fn, repeat: int) -> float:
    return statistics.median(durations(fn, repeat))


def rank_shard(n_tokens: int, rank: int):
    batch = make_data(n_tokens, seed=rank).batch
    stats = compute_stats(batch, CONFIG)
    tails = tail_exemplars(batch, K, CONFIG)
    frames = tails.frames() if hasattr(tails, "frames") else tails       # what the collector hands the reducer
    return batch, stats, shard(stats, frames, rank), {name: df.assign(rank=rank) for name, df in frames.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = [rank_shard(args.tokens, r) for r in range(max(args.worlds))]
    batch, stats, _, exemplars = ranks[0]
    engine = median(lambda: compute_stats(batch, CONFIG), args.repeat)
    packing = median(lambda: shard(stats, exemplars, 0), args.repeat)
    frames_pickling = median(lambda: pickle.dumps(stats.tables), args.repeat)
    sizes = [len(pickle.dumps(s)) for _, _, s, _ in ranks]
    old_sizes = [len(pickle.dumps(s._replace(tables=st.tables, exemplars=ex))) for _, st, s, ex in ranks]
    print(f"{args.tokens:,} tokens per rank, one thread; medians over {args.repeat}; ratios are to the engine")
    print(f"engine {engine:.4f} s | pack {packing:.4f} s ({packing / engine:.2f}) | pickle frames "
          f"{frames_pickling:.4f} s ({frames_pickling / engine:.2f})")
    print(f"shard bytes per rank: packed {statistics.median(sizes) / 1e3:.0f} kB "
          f"({min(sizes) / 1e3:.0f}-{max(sizes) / 1e3:.0f}), frames {statistics.median(old_sizes) / 1e3:.0f} kB "
          f"({min(old_sizes) / 1e3:.0f}-{max(old_sizes) / 1e3:.0f}); token cells {len(stats['tokens'])}, "
          f"|lr| histogram rows {len(stats['abs_hist'])}")
    print(f"{'W':>3} {'unpickle s':>11} {'merge s':>8} {'ratio':>6} {'unpickle+merge':>15} {'ratio':>6} "
          f"{'frames s':>9} {'ratio':>6}")
    for W in args.worlds:
        blobs = [pickle.dumps(s) for _, _, s, _ in ranks[:W]]
        parts = [pickle.loads(b) for b in blobs]
        unpickle = median(lambda: [pickle.loads(b) for b in blobs], args.repeat)
        merging = median(lambda: merge_parts(parts, K), args.repeat)
        frames = median(lambda: (merge([st for _, st, _, _ in ranks[:W]]),
                                 merge_exemplars([ex for _, _, _, ex in ranks[:W]], K)), max(1, args.repeat // 2))
        print(f"{W:>3} {unpickle:>11.4f} {merging:>8.4f} {merging / engine:>6.2f} {unpickle + merging:>15.4f} "
              f"{(unpickle + merging) / engine:>6.2f} {frames:>9.4f} {frames / engine:>6.2f}")


if __name__ == "__main__":
    main()
