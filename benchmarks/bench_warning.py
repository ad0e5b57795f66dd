"""Early warning on the project's simulator: false firings on clean runs, detection latency of
injected faults, missed faults, and what each resync did.

    OMP_NUM_THREADS=1 python benchmarks/bench_warning.py                      # the full run
    OMP_NUM_THREADS=1 python benchmarks/bench_warning.py --seeds 1 --steps 60 --onsets 2,10 --horizon 12
    OMP_NUM_THREADS=1 python benchmarks/bench_warning.py ... --save DIR   # also keep each run's metrics
    python benchmarks/bench_warning.py --replay DIR        # those runs through today's rules (seconds)

Clean runs: ``stable_fleet`` (MoE policy by default) for each seed, every step through the engine and the in-process
evaluator with the default rules; a resync an alert asks for is performed (as the demo does).
Faults: the stable fleet with one pool's fault switched on at each onset step (the pool the
simulator's ``fault_midrun`` hits for that kind), run until ``horizon`` steps after the onset.
A fault is detected by the first firing on its pool at or after the onset; firings on other
pools, or before the onset, are false firings. One run at a time, one torch thread.
Latency is counted from the onset and, for ``stop_sync`` and ``wrong_weights``, also from the
fault's first effect: the first sync it skipped or spoiled (the async pool lags by design, so a
sync stopped at step 1 or 2 changes nothing until step 3). The pools declare their
``max_staleness`` (their lag), which ``MismatchSyncBehind`` reads.

The simulator offers, for its torch pools: ``stop_sync`` (staleness), ``ignore_temperature``,
``degrade_precision`` and ``wrong_weights``; ``sync_no_reset`` (prefix cache not reset) exists
for vLLM pools only.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from mismatch_monitor.alerts import DEFAULT_RULES, AlertEvaluator
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.metrics import report_by_label
from mismatch_monitor.sim import FaultSpec, Simulation
from mismatch_monitor.sim.scenarios import _FAULT_POOL, stable_fleet

FAULTS = ("stop_sync", "ignore_temperature", "degrade_precision", "wrong_weights")


SAVE: Path | None = None


def save(name: str, by_pool: list[pd.DataFrame], fleet: list[pd.DataFrame]) -> None:
    """Keep one run's per-pool and fleet metrics (``--save``) for :func:`replay`."""
    if SAVE is not None and by_pool:
        SAVE.mkdir(parents=True, exist_ok=True)
        pd.concat(by_pool, ignore_index=True).to_parquet(SAVE / f"{name}.parquet")
        pd.concat(fleet, ignore_index=True).to_parquet(SAVE / f"{name}.fleet.parquet")


def pool_metadata(config) -> dict[str, dict[str, object]]:
    """The pools' run.json metadata (precision, engine), which the expected-level gate reads."""
    return {p.name: p.metadata() for p in config.pools}


def replay(folder: Path) -> None:
    """Each saved run through the current default rules (the simulator's own steps; a resync the
    saved run performed is in its metrics, a rule that would ask for another one cannot)."""
    for path in sorted(folder.glob("*.parquet")):
        if path.name.endswith(".fleet.parquet"):
            continue
        history = pd.read_parquet(path)
        history["pool"] = history["pool"].astype(str)
        fleet = pd.read_parquet(path.with_name(path.name.replace(".parquet", ".fleet.parquet")))
        pools = pool_metadata(stable_fleet())   # the same pools in both variants
        _, events = AlertEvaluator.replay(history, fleet_history=fleet, pools=pools)
        print(f"{path.stem}: {history['step'].max() + 1} steps, firings "
              f"{[(e.step, e.alert, e.pool) for e in events if e.state == 'firing']}")


def run(config, steps: int, name: str = "") -> tuple[list, AlertEvaluator, int, list[dict]]:
    """Events of ``steps`` steps of ``config``, the evaluator, pool-steps and the simulator's sync
    events; resyncs the alerts ask for are performed."""
    sim = Simulation(config)
    evaluator = AlertEvaluator(DEFAULT_RULES, pools=pool_metadata(config))
    events, pool_steps = [], 0
    kept: tuple[list, list] = ([], [])
    try:
        for out in sim.run(steps):
            stats = compute_stats(out.batch, config.thresholds)
            by_pool, fleet = report_by_label(stats, "pool", config.thresholds)
            pool_steps += len(by_pool)
            if SAVE is not None:
                kept[0].append(by_pool.to_frame().assign(step=out.step))
                kept[1].append(fleet.to_frame().assign(step=out.step))
            step_events = evaluator.observe(out.step, time.time(), by_pool, fleet=fleet)
            events += step_events
            for e in step_events + evaluator.repeat_requests():   # a held firing asks again on relapse
                if e.state == "firing" and e.resync:
                    sim.resync(e.pool)
    finally:
        sim.close()
    save(name, *kept)
    return events, evaluator, pool_steps, sim.sync_events


# the sync a fault first changes: until then the faulted pool holds what a healthy one would
FIRST_EFFECT = {"stop_sync": "sync_skipped", "wrong_weights": "sync_wrong_weights"}


def first_effect(kind: str, pool: str, onset: int, syncs: list[dict]) -> int:
    """The first step at or after ``onset`` at which the fault changed what ``pool`` holds: its
    first skipped or wrong sync (a pool that lags by design holds the warm start's weights for
    its first steps whether or not its syncs work), the onset for the other faults."""
    wanted = FIRST_EFFECT.get(kind)
    if wanted is None:
        return onset
    steps = [e["step"] for e in syncs if e["pool"] == pool and e["kind"] == wanted and e["step"] >= onset]
    return min(steps, default=onset)


def clean(seeds: int, steps: int, variant: str) -> None:
    firing: Counter[str] = Counter()
    total = 0
    for seed in range(seeds):
        config = stable_fleet(steps=steps, seed=seed, variant=variant)  # type: ignore[arg-type]
        events, _, pool_steps, _ = run(config, steps, f"clean_{variant}_{seed}")
        total += pool_steps
        firing.update(e.alert for e in events if e.state == "firing")
        print(f"clean seed {seed}: {pool_steps} pool-steps, firings: "
              f"{sorted((e.step, e.alert, e.pool) for e in events if e.state == 'firing')}")
    print(f"\n| rule | false firings | per 1,000 clean pool-steps ({total} pool-steps, {seeds} x {steps} steps) |")
    print("|---|---|---|")
    for rule in DEFAULT_RULES:
        print(f"| `{rule.name}` | {firing[rule.name]} | {1000 * firing[rule.name] / total:.2f} |")


def faults(onsets: list[int], horizon: int, seed: int, kinds: tuple[str, ...], variant: str) -> None:
    rows = []
    for kind in kinds:
        for onset in onsets:
            base = stable_fleet(seed=seed, variant=variant)  # type: ignore[arg-type]
            spec = FaultSpec(kind, onset, "int3" if kind == "degrade_precision" else None)   # type: ignore[arg-type]
            pool = _FAULT_POOL[kind]
            config = replace(base, pools=tuple(replace(p, faults=(spec,)) if p.name == pool else p
                                               for p in base.pools))
            events, evaluator, _, syncs = run(config, onset + horizon + 1, f"{kind}_{variant}_{onset}")
            effect = first_effect(kind, pool, onset, syncs)
            on_pool = [e for e in events if e.state == "firing" and e.pool == pool and e.step >= onset]
            false = [e for e in events if e.state == "firing" and (e.pool != pool or e.step < onset)]
            first = on_pool[0] if on_pool else None
            outcomes = [o for o in evaluator.resync_outcomes() if o.pool == pool]
            rows.append((kind, pool, onset, None if first is None else first.step - onset,
                         None if first is None else first.step - effect, effect,
                         "" if first is None else first.alert, len(false),
                         ", ".join(f"{o.requested_step}:{'no effect' if not o.helped else 'helped' if o.relapsed_step is None else f'helped, relapsed at {o.relapsed_step}'}"
                                   for o in outcomes)))
            print(f"fault {kind} on {pool} from step {onset}: {sorted({(e.step, e.alert) for e in on_pool})[:6]} "
                  f"false: {[(e.step, e.alert, e.pool) for e in false]}")
    print("\n| fault | pool | onset | latency (steps) | first effect | latency after it | first alert | "
          "false firings | resyncs (step: effect) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, pool, onset, latency, after, effect, alert, false, resyncs in rows:
        shown = "missed" if latency is None else str(latency)
        print(f"| {kind} | {pool} | {onset} | {shown} | {effect} | {'' if after is None else after} | "
              f"{alert and f'`{alert}`'} | {false} | {resyncs} |")
    missed = sum(r[3] is None for r in rows)
    print(f"\nmissed: {missed} of {len(rows)} injected faults (horizon {horizon} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="clean runs (seeds 0..N-1; 0: faults only)")
    parser.add_argument("--steps", type=int, default=200, help="steps of each clean run")
    parser.add_argument("--onsets", default="1,2,5,10,50,100", help="fault onset steps, comma-separated")
    parser.add_argument("--horizon", type=int, default=30, help="steps watched after each onset")
    parser.add_argument("--faults", default=",".join(FAULTS), help="fault kinds, comma-separated")
    parser.add_argument("--fault-seed", type=int, default=0)
    parser.add_argument("--variant", choices=("moe", "dense"), default="moe",
                        help="policy variant (moe: the routing-flip rule has flips to judge)")
    parser.add_argument("--save", type=Path, help="keep each run's metrics here (parquet)")
    parser.add_argument("--replay", type=Path, help="only replay the runs saved here through today's rules")
    args = parser.parse_args()
    if args.replay is not None:
        replay(args.replay)
        return
    global SAVE
    SAVE = args.save
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.seeds > 0:
        clean(args.seeds, args.steps, args.variant)
    faults([int(s) for s in args.onsets.split(",")], args.horizon, args.fault_seed,
           tuple(k for k in args.faults.split(",") if k), args.variant)
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
