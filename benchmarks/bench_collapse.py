"""Does the training-inference mismatch itself make training fail? The ``collapse_head`` search.

    OMP_NUM_THREADS=1 python benchmarks/bench_collapse.py --seeds 0 1 --steps 61 \\
        [--arms no_fault fault_none fault_tis matched] [--head int2] [--epochs 8] [--ratio sequence] \\
        [--lr 3e-4] [--prompts 8] [--eval-prompts 32] [--eval-every 10] [--json out.json]

Runs every arm of the ``collapse_head`` scenario (one at a time, one torch thread) for each
seed and prints, per run, the fixed-prompt fp32 evaluation reward at step 0, its final value
(mean of the last three evaluations) and its minimum, the final value's ratio to the same
seed's ``no_fault`` run, the mean |log rho| (sampler vs trainer) of the first and last tenth of
the steps, the largest gradient norm and the run's seconds. ``--json`` keeps every curve
(evaluation reward, training reward, mean |lr|, gradient norm per step) for docs/COLLAPSE.md.
A run "collapses" when its final evaluation reward is below half of the no-fault run's. Every
step also goes through the engine and the default alert rules (in-process, no resync performed):
per run its first alert and number of firings, and for a faulty arm the lead time from that
alert to the first evaluation whose reward is below half of the no-fault run's at the same step.
Runs go arm by arm (every seed's no-fault run first); the arms of one seed share one warm start
(run once, its weights reloaded: the same bits as running it again).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mismatch_monitor.alerts import DEFAULT_RULES, AlertEvaluator
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.metrics import report_by_label
from mismatch_monitor.sim import Simulation, scenario
from mismatch_monitor.sim import simulation as sim_module
from mismatch_monitor.sim.scenarios import COLLAPSE_ARMS

_warm_started: dict[tuple, tuple[dict[str, torch.Tensor], float]] = {}
_warm_start = sim_module.warm_start


def cached_warm_start(model, task, tokenizer, *, steps, batch_size, learning_rate, generator) -> float:
    """The arms of one seed share their warm start (same seed, task and policy): it runs once
    per seed and the others load its weights, bitwise the same as running it again."""
    key = (task, tokenizer.alphabet, steps, batch_size, learning_rate, generator.initial_seed(),
           model.config.to_json_string(), tuple(float(p.detach().double().sum()) for p in model.parameters()))
    if key not in _warm_started:
        loss = _warm_start(model, task, tokenizer, steps=steps, batch_size=batch_size,
                           learning_rate=learning_rate, generator=generator)
        _warm_started[key] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, loss)
    else:
        model.load_state_dict(_warm_started[key][0])
        model.eval()
    return _warm_started[key][1]


sim_module.warm_start = cached_warm_start


def run_arm(arm: str, seed: int, steps: int, options: dict[str, object]) -> dict[str, object]:
    t0 = time.perf_counter()
    config = scenario("collapse_head", steps=steps, seed=seed, arm=arm, **options)
    sim = Simulation(config)
    # the default rules watch the run as the collector would (no resync performed: the fault is
    # the sampler's head, which a weight resync does not change)
    evaluator = AlertEvaluator(DEFAULT_RULES, pools={p.name: p.metadata() for p in config.pools})
    curve: dict[str, list] = {"eval_step": [], "eval_reward": [], "reward": [], "abs_lr": [], "grad_norm": [],
                              "firings": []}
    for out in sim.run(steps):
        by_pool, fleet = report_by_label(compute_stats(out.batch, config.thresholds), "pool", config.thresholds)
        curve["firings"] += [(out.step, e.alert, e.pool) for e in evaluator.observe(out.step, time.time(), by_pool,
                                                                                   fleet=fleet)
                             if e.state == "firing"]
        if out.eval_reward is not None:
            curve["eval_step"].append(out.step)
            curve["eval_reward"].append(out.eval_reward)
            print(f"    {arm} seed {seed} step {out.step}: eval {out.eval_reward:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        b = out.batch
        lr = (b.trainer_logprobs.double() - b.sampler_logprobs.double()).abs()
        curve["reward"].append(out.reward_mean)
        curve["abs_lr"].append(float(lr[torch.isfinite(lr)].mean()))
        curve["grad_norm"].append(out.grad_norm)
    sim.close()
    return {"arm": arm, "seed": seed, "seconds": time.perf_counter() - t0, **curve}


def summary(run: dict, baseline: dict | None) -> dict[str, float]:
    ev, tenth = run["eval_reward"], max(1, len(run["abs_lr"]) // 10)
    final = sum(ev[-3:]) / len(ev[-3:])
    base = None if baseline is None else sum(baseline["eval_reward"][-3:]) / len(baseline["eval_reward"][-3:])
    return {"eval0": ev[0], "final": final, "min": min(ev), "vs_no_fault": final / base if base else float("nan"),
            "lr_first": sum(run["abs_lr"][:tenth]) / tenth, "lr_last": sum(run["abs_lr"][-tenth:]) / tenth,
            "max_grad": max(run["grad_norm"]), "seconds": run["seconds"]}


def lead_time(run: dict, baseline: dict | None) -> tuple[int | None, int | None]:
    """(step of the run's first alert, first evaluation step whose reward is below half of the
    no-fault run's at the same step); None where there is none."""
    first = run["firings"][0][0] if run["firings"] else None
    halved = None
    if baseline is not None:
        base = dict(zip(baseline["eval_step"], baseline["eval_reward"]))
        halved = next((s for s, r in zip(run["eval_step"], run["eval_reward"]) if s in base and r < base[s] / 2), None)
    return first, halved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=61)
    ap.add_argument("--arms", nargs="+", default=list(COLLAPSE_ARMS), choices=COLLAPSE_ARMS)
    ap.add_argument("--head", default="int2")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--ratio", default="sequence", choices=("token", "sequence"))
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=16)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--json", help="write every curve here")
    args = ap.parse_args()
    options = dict(head=args.head, epochs=args.epochs, ratio=args.ratio, learning_rate=args.lr,
                   prompts=args.prompts, max_length=args.max_length, turns=args.turns,
                   eval_prompts=args.eval_prompts, eval_every=args.eval_every)
    print(f"collapse_head, {args.steps} steps, {options}")
    runs = []
    for arm in args.arms:          # arm by arm: the no-fault and no-correction runs of every seed first
        for seed in args.seeds:
            runs.append(run_arm(arm, seed, args.steps, options))
            print(f"  seed {seed} {arm}: {runs[-1]['seconds']:.0f} s, eval {[round(x, 3) for x in runs[-1]['eval_reward']]}",
                  flush=True)
    print(f"\n| seed | arm | eval @0 | eval final | eval min | final / no_fault | mean abs lr first->last tenth "
          f"| max grad norm | s |\n|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        base = next((r for r in runs if r["seed"] == run["seed"] and r["arm"] == "no_fault"), None)
        s = summary(run, base)
        print(f"| {run['seed']} | {run['arm']} | {s['eval0']:.3f} | {s['final']:.3f} | {s['min']:.3f} | "
              f"{s['vs_no_fault']:.2f} | {s['lr_first']:.2e} -> {s['lr_last']:.2e} | {s['max_grad']:.2f} | "
              f"{s['seconds']:.0f} |")
    print("\n| seed | arm | first alert (step: rule, pool) | firings | eval reward below half of no_fault's from step "
          "| lead (steps) |\n|---|---|---|---|---|---|")
    for run in runs:
        base = next((r for r in runs if r["seed"] == run["seed"] and r["arm"] == "no_fault"), None)
        first, halved = lead_time(run, base if run["arm"] != "no_fault" else None)
        shown = f"{run['firings'][0][0]}: `{run['firings'][0][1]}`, {run['firings'][0][2]}" if run["firings"] else "none"
        lead = halved - first if first is not None and halved is not None else None
        print(f"| {run['seed']} | {run['arm']} | {shown} | {len(run['firings'])} | "
              f"{'never' if halved is None else halved} | {'' if lead is None else lead} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "options": options, "runs": runs}, f)


if __name__ == "__main__":
    main()
