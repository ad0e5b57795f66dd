"""A writer process for crash and concurrency tests: logs steps forever (or N), flushing each.

Usage: python writer_process.py RUN_DIR FIRST_STEP [COUNT] [SCALE]
Prints "flushed <step>" after each step is durable (flush_every_steps=1).
"""

from __future__ import annotations

import sys

import torch

from mismatch_monitor.collectors import MismatchCollector
from synthetic import make_batch


def main() -> None:
    run_dir, first = sys.argv[1], int(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 10**9
    scale = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-2
    torch.set_num_threads(1)
    mc = MismatchCollector(run_dir, flush_every_steps=1, strict=True)
    for step in range(first, first + count):
        mc.log_step(step, make_batch(step, scale=scale, sequences=12, max_len=24))
        mc.flush()                      # automatic flushes run in the background: wait for durability
        print(f"flushed {step}", flush=True)
    mc.close()


if __name__ == "__main__":
    main()
