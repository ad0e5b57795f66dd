"""``mismatch-monitor sample-data``: regenerate the three runs in ``sample_data/``.

Each run is a real simulated RL run (see docs/SIMULATOR.md) written through the collector with
the default alert rules and the resync loop, exactly as ``mismatch-monitor demo`` writes one.
The statistics are a deterministic function of the seed (one torch thread, CPU); wall-clock
columns are real and differ between regenerations.

    mismatch-monitor sample-data                     # all three, into ./sample_data
    mismatch-monitor sample-data --only fault_midrun --out /tmp/sd
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path

from ..sim import scenario
from ..store import compact_run
from .demo import RunResult, simulate

# run name -> scenario options (the run name is the scenario's name)
RUNS: tuple[tuple[str, dict[str, str]], ...] = (
    ("stable_fleet", {}),
    ("fault_midrun", {"fault": "stop_sync"}),
    ("collapse_no_correction", {}),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="sample_data", help="output directory (default ./sample_data)")
    parser.add_argument("--steps", type=int, default=120, help="steps per run (default 120)")
    parser.add_argument("--variant", choices=("dense", "moe"), default="moe", help="policy variant (default moe)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    parser.add_argument("--warmstart-steps", type=int, default=None,
                        help="override the supervised warm-start steps (default 200)")
    parser.add_argument("--only", choices=[name for name, _ in RUNS], action="append", default=None,
                        help="regenerate only this run (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def reward_table(result: RunResult, windows: int = 6) -> str:
    """Mean reward per window of steps, fleet and per pool (for sample_data/README.md)."""
    r, n = result.rewards, max(1, len(result.rewards) // windows)
    pools = list(result.rewards_by_pool[0]) if result.rewards_by_pool else []
    lines = ["| steps | fleet | " + " | ".join(pools) + " |", "|---" * (2 + len(pools)) + "|"]
    for i in range(0, len(r), n):
        part = result.rewards_by_pool[i:i + n]
        cells = [f"{sum(r[i:i + n]) / len(r[i:i + n]):.3f}"]
        cells += [f"{sum(p[name] for p in part) / len(part):.3f}" for name in pools]
        lines.append(f"| {i}-{min(i + n, len(r)) - 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"expected --steps >= 1, got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, options in RUNS:
        if args.only and name not in args.only:
            continue
        config = scenario(name, steps=args.steps, variant=args.variant, seed=args.seed, **options)
        if args.warmstart_steps is not None:
            config = replace(config, warmstart_steps=args.warmstart_steps)
        run_dir = out / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        print(f"sample-data: {name} ({args.variant}, {args.steps} steps, seed {args.seed}) -> {run_dir}")
        result = simulate(config, run_dir, steps=args.steps, run_id=name, progress=not args.quiet,
                          metadata={"scenario": name, "steps": args.steps, **options}, echo=False)
        compact_run(run_dir)   # one file per table: small to commit, quick to open
        size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
        print(f"sample-data: {name}: {result.steps} steps in {result.seconds_total:.0f} s, "
              f"{size / 1e6:.2f} MB, {len(result.firing)} alert firing(s), {len(result.resyncs)} resync(s)")
        print(f"sample-data: {name}: mean reward by steps\n{reward_table(result)}")
    return 0
