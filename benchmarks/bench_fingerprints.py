"""A pool on the wrong weights, through the collector, with and without weight fingerprints.

    OMP_NUM_THREADS=1 python benchmarks/bench_fingerprints.py                       # onsets 1, 2, 5, 10
    OMP_NUM_THREADS=1 python benchmarks/bench_fingerprints.py --onsets 3 --horizon 5 --variant moe

The ``stable_fleet`` scenario (dense policy by default) with the simulator's ``wrong_weights``
fault on its bf16 pool from each onset (every push from then on sends the warm-start weights
while the pool reports the new version), recorded by ``SimulationRecorder`` into a real
``MismatchCollector`` with the default rules: once with ``fingerprints=True`` (each sync gives
the fingerprint of the weights sent and of the version meant, ``collectors/fingerprints.py``)
and once without (``bench_warning.py`` measures that case for every fault kind, bypassing the
collector). Per run: the steps from the onset to each alert's first firing on the faulty pool,
firings elsewhere or before the onset (false), the largest staleness read, and the counted
errors by kind. One torch thread.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from mismatch_monitor import query
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.collectors.simulation import SimulationRecorder
from mismatch_monitor.sim import FaultSpec, Simulation, scenario

POOL = "bf16"


def run(onset: int, horizon: int, variant: str, fingerprints: bool) -> dict[str, object]:
    """One recorded run: the faulty pool's staleness per step, every firing ``(step, alert, pool)``
    and the counted errors by kind (``tests/test_weight_fingerprints.py`` checks one)."""
    steps = onset + horizon + 1
    base = replace(scenario("stable_fleet", steps=steps, variant=variant), warmstart_steps=10)
    config = replace(base, pools=tuple(replace(p, faults=(FaultSpec("wrong_weights", onset),))
                                       if p.name == POOL else p for p in base.pools))
    sim, fired = Simulation(config), []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        try:
            with MismatchCollector(folder, config=config.thresholds, pools=sim.pool_metadata()) as mc:
                mc.on_alert(lambda e: fired.append((e.step, e.alert, e.pool)) if e.state == "firing" else None)
                recorder = SimulationRecorder(mc, sim, fingerprints=fingerprints)
                for out in sim.run(steps):
                    recorder.record(out)
                errors = dict(mc.errors_by_kind)
        finally:
            sim.close()
        series = query.metric_series(query.connect(), folder, ["pool"], metrics=["mismatch/staleness/max"])
    staleness = series[series["pool"] == POOL].sort_values("step")["mismatch/staleness/max"].tolist()
    return {"staleness": staleness, "fired": fired, "errors": errors}


def latencies(fired: list[tuple[int, str, str]], onset: int) -> tuple[dict[str, int], int]:
    """Steps from the onset to each alert's first firing on the faulty pool; the false firings."""
    latency: dict[str, int] = {}
    for step, alert, pool in fired:
        if pool == POOL and step >= onset:
            latency.setdefault(alert, step - onset)
    return latency, sum(1 for s, _, p in fired if p != POOL or s < onset)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onsets", default="1,2,5,10")
    ap.add_argument("--horizon", type=int, default=9, help="steps run after the onset")
    ap.add_argument("--variant", default="dense", choices=("dense", "moe"))
    args = ap.parse_args()
    onsets = [int(o) for o in args.onsets.split(",")]
    if args.horizon < 1 or any(o < 1 for o in onsets):
        ap.error("--onsets and --horizon must be >= 1")
    torch.set_num_threads(1)
    logging.getLogger("mismatch_monitor").setLevel(logging.CRITICAL)   # the errors are counted and printed
    print(f"wrong_weights on pool {POOL}, {args.variant} stable_fleet, {args.horizon} steps after each onset")
    print("onset fingerprints  first firing (steps after onset)            false  max staleness  errors")
    t0 = time.perf_counter()
    for onset in onsets:
        for fingerprints in (True, False):
            r = run(onset, args.horizon, args.variant, fingerprints)
            latency, false = latencies(r["fired"], onset)
            first = ", ".join(f"{a} +{n}" for a, n in sorted(latency.items(), key=lambda kv: kv[1])) or "none"
            errors = ", ".join(f"{k} {n}" for k, n in sorted(r["errors"].items())) or "-"
            print(f"{onset:5d} {'yes' if fingerprints else 'no':>12}  {first:<44} {false:5d}"
                  f"  {max(r['staleness']):13.0f}  {errors}", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
