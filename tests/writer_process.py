"""A writer process for crash and concurrency tests: logs steps forever (or N), flushing each.

Usage: python writer_process.py RUN_DIR FIRST_STEP [COUNT] [SCALE] [MODE]
MODE "flush" (default): prints "flushed <step>" after each step is durable (an explicit flush).
MODE "background": every step's flush falls due and runs on the writer's background thread;
prints "logged <step>" when log_step returns (the step may still be in flight).
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
    background = len(sys.argv) > 5 and sys.argv[5] == "background"
    torch.set_num_threads(1)
    mc = MismatchCollector(run_dir, flush_every_steps=1, strict=True)
    for step in range(first, first + count):
        mc.log_step(step, make_batch(step, scale=scale, sequences=12, max_len=24))
        if background:
            print(f"logged {step}", flush=True)
            continue
        mc.flush()                      # due flushes run in the background: wait for durability
        print(f"flushed {step}", flush=True)
    mc.close()


if __name__ == "__main__":
    main()
