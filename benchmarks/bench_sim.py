"""Simulator speed: steps per second, where a step's time goes, and the 200-step demo.

    python benchmarks/bench_sim.py [--steps 30] [--demo-steps 200] [--skip-demo]

1. Steps per second of the ``stable_fleet`` scenario (five pools, 72 sequences a step) for the
   dense and the MoE variant, wall and CPU time (the CPU time shows what a shared machine hides),
   with the shares of the step spent generating (all pools) and in the trainer.
2. The collector's share of the loop: the same run written through ``MismatchCollector`` with the
   default alert rules, time inside ``log_step`` over the whole loop, measured in the same run.
3. ``mismatch-monitor demo --steps 200`` end to end in a subprocess (imports, warm start, 200
   steps through collector and alerts, the closing summary) against the 3-minute budget.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from mismatch_monitor.cli.demo import simulate
from mismatch_monitor.sim import Simulation, scenario

DEMO_BUDGET_S = 180.0


def bench_steps(variant: str, steps: int, warmup: int = 3) -> dict[str, float]:
    sim = Simulation(replace(scenario("stable_fleet", variant=variant), warmstart_steps=20))
    for _ in sim.run(warmup):
        pass
    wall0, cpu0 = time.perf_counter(), time.process_time()
    outs = list(sim.run(steps))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    step_s = sum(o.seconds for o in outs)
    return {"steps_per_s": steps / wall, "cpu_s_per_step": cpu / steps,
            "sampling_share": sum(o.seconds_sampling for o in outs) / step_s,
            "tokens_per_step": sum(o.batch.num_tokens for o in outs) / steps}


def bench_collector(variant: str, steps: int) -> dict[str, float]:
    config = replace(scenario("stable_fleet", variant=variant), warmstart_steps=20)
    with tempfile.TemporaryDirectory() as tmp:
        result = simulate(config, Path(tmp) / "run", steps=steps, run_id="bench", progress=False, echo=False)
    loop = result.seconds_total - result.seconds_setup
    return {"collector_share": result.seconds_collector / loop, "collector_s_per_step": result.seconds_collector / steps}


def bench_demo(steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of the demo command, end to end."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", "import sys; from mismatch_monitor.cli import main; sys.exit(main())",
               "demo", "--steps", str(steps),
               "--runs-root", tmp, "--name", "bench", "--quiet"]
        t0 = time.perf_counter()
        before = os.times()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = os.times()
        return time.perf_counter() - t0, (after.children_user - before.children_user
                                          + after.children_system - before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--demo-steps", type=int, default=200, help="steps of the timed demo run")
    parser.add_argument("--skip-demo", action="store_true", help="skip the end-to-end demo timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, one torch thread")
    print(f"{'variant':8} {'steps/s':>8} {'CPU s/step':>10} {'tokens/step':>11} {'generate':>9} "
          f"{'collector':>9} {'collector s/step':>16}")
    for variant in ("dense", "moe"):
        s = bench_steps(variant, args.steps)
        c = bench_collector(variant, args.steps)
        print(f"{variant:8} {s['steps_per_s']:8.2f} {s['cpu_s_per_step']:10.3f} {s['tokens_per_step']:11.0f} "
              f"{s['sampling_share']:9.0%} {c['collector_share']:9.0%} {c['collector_s_per_step']:16.3f}")
    print("generate: share of the simulator step spent syncing pools and generating; "
          "collector: share of the loop spent in MismatchCollector.log_step (engine, store, alerts)")
    if not args.skip_demo:
        wall, cpu = bench_demo(args.demo_steps)
        verdict = "within" if wall < DEMO_BUDGET_S else "OVER"
        print(f"demo --steps {args.demo_steps} (fault_midrun, moe, warm start included): {wall:.0f} s wall, "
              f"{cpu:.0f} s CPU; {verdict} the {DEMO_BUDGET_S:.0f} s budget ({wall / DEMO_BUDGET_S:.2f}x)")


if __name__ == "__main__":
    main()
