"""Real vLLM pools: engine start, tokens/s, per-step cost, sync time, and each format's mismatch.

    python benchmarks/bench_vllm_pools.py [--steps 8] [--episodes 64] [--variant moe]

1. The ``vllm_fleet`` scenario (five in-process engines: fp32, bf16, fp8, int8, bf16 top-p)
   for ``--steps`` steps: each engine's start time, its generation tokens/s, the seconds of a
   step spent in its generate calls, and the weight-sync times (reload_weights +
   reset_prefix_cache), against the trainer's share of the step measured in the same run.
2. Every format on the same ``--episodes`` prompts (``Simulation.probe``) against the fp32
   trainer's recompute, through the collector: k3, p99 |log ratio| and the extreme share. int4
   W4A16 and an FP8 KV cache are tried too and reported as unavailable where this CPU's vLLM
   build lacks their kernels. An FP8 KV cache needs AVX-512 or AMX; int4 W4A16 without its
   kernel runs as the int4 grid dequantized in a bf16 engine (the format column says so).

``--smoothquant A`` adds an int8 pool whose checkpoint is smoothed with alpha ``A``
(``sim/vllm_smoothquant.py``), probed on the same prompts in a call of its own.

``--variant moe`` runs both on a Qwen3-MoE policy: the fleet without its FP8 pool (``vllm_fleet``
is dense only; its FP8 pool was not checked on MoE experts), every format still tried in 2. A
MoE pool generates one request at a time (its routing is read from the routers).

Needs vLLM (``make install-vllm``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from mismatch_monitor.collectors import MismatchCollector  # noqa: E402
from mismatch_monitor.sim import PoolSpec, Simulation, scenario, vllm_smoothquant  # noqa: E402
from mismatch_monitor.sim.policy import PolicyShape  # noqa: E402
from mismatch_monitor.sim.scenarios import VLLM_POLICY  # noqa: E402

FORMATS = (("fp32", "fp32", {}), ("fp16", "fp16", {}), ("bf16", "bf16", {}), ("int8", "int8", {}),
           ("fp8", "fp8_e4m3", {}), ("int4", "int4", {}), ("kv-fp8", "bf16", {"kv_cache_dtype": "fp8_e4m3"}),
           ("topp0.9", "bf16", {"top_p": 0.9}))


def bench_fleet(steps: int, warmstart: int, variant: str) -> Simulation:
    config = replace(scenario("vllm_fleet", steps=10 * steps), warmstart_steps=warmstart)
    if variant == "moe":
        config = replace(config, policy=PolicyShape(variant="moe", **VLLM_POLICY),
                         pools=tuple(p for p in config.pools if p.precision != "fp8_e4m3"))
    t0 = time.perf_counter()
    sim = Simulation(config)
    print(f"setup (warm start {warmstart} steps + {len(config.pools)} engine starts): {time.perf_counter() - t0:.1f} s")
    outs = list(sim.run(steps))
    step_s = statistics.median(o.seconds for o in outs[1:])
    sampling_s = statistics.median(o.seconds_sampling for o in outs[1:])
    print(f"median step {step_s:.2f} s, of which sampling (syncs + every pool's generate) {sampling_s:.2f} s\n")
    print(f"{'pool':8} {'format':24} {'start s':>8} {'tokens/s':>9} {'gen s/step':>10} {'sync ms (median)':>17}")
    for name, sampler in sim.samplers.items():
        info = sampler.engine_info  # type: ignore[attr-defined]
        fmt = f"{info['dtype']}/{info['quantization']}"[:24]
        tps = sampler.generated_tokens / max(sampler.generate_seconds, 1e-9)  # type: ignore[attr-defined]
        syncs = sampler.sync_seconds  # type: ignore[attr-defined]
        sync_ms = 1e3 * statistics.median(syncs) if syncs else float("nan")
        print(f"{name:8} {fmt:24} {info['load_seconds']:8.2f} {tps:9.0f} "
              f"{sampler.generate_seconds / steps:10.3f} {sync_ms:17.1f}")  # type: ignore[attr-defined]
    return sim


def probe_report(sim: Simulation, pools: list[PoolSpec], prompts: list, run_dir: Path) -> dict[str, float]:
    batch = sim.probe(pools, prompts, seed=3)
    with MismatchCollector(run_dir, pools={p.name: p.metadata() for p in pools}) as collector:
        return collector.log_step(0, batch)


def bench_formats(sim: Simulation, episodes: int, run_dir: Path, smoothquant: float | None) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = sim.config.task.sample(episodes, gen, sim.config.alphabet)
    pools, missing = [], []
    for name, precision, extra in FORMATS:
        spec = PoolSpec(name, precision=precision, backend="vllm", engine="vllm", **extra)  # type: ignore[arg-type]
        try:                                   # one engine alone first: is the format available here?
            sim.probe([spec], prompts[:1])
            pools.append(spec)
        except (RuntimeError, ValueError) as exc:       # refused at start (ValueError) or at the probe token
            lines = [line for line in str(exc).splitlines() if line.strip()]
            missing.append(f"{name}: {' / '.join(lines)[:300]}")
    report = probe_report(sim, pools, prompts, run_dir)
    if smoothquant is not None:
        vllm_smoothquant.ALPHA = smoothquant
        try:
            smoothed = PoolSpec("int8-sq", precision="int8", backend="vllm", engine="vllm")
            report.update(probe_report(sim, [smoothed], prompts, run_dir.with_name("smoothed")))
            pools.append(smoothed)
        finally:
            vllm_smoothquant.ALPHA = None
    print(f"\nagainst the fp32 trainer's recompute, {episodes} prompts per format (same prompts):")
    print(f"{'pool':8} {'tokens':>7} {'k3':>10} {'p99 |lr|':>10} {'extreme share':>14} {'routing flips':>14}  applied")
    for spec in pools:
        key = f"mismatch/pool={spec.name}/"
        flips = report.get(key + "routing/flip_rate", float("nan"))
        info = sim.probe_engine_info[spec.name]
        smoothing = info.get("smoothing", "none")
        applied = info["quantization"] + (f", SmoothQuant alpha {smoothing['alpha']}" if smoothing != "none" else "")
        print(f"{spec.name:8} {report[key + 'n_tokens']:7.0f} {report[key + 'k3_kl']:10.2e} "
              f"{report[key + 'abs_log_ratio/p99']:10.2e} {report[key + 'extreme_fraction']:14.2e} "
              f"{flips:14.2e}  {applied}")
    for line in missing:
        print(f"unavailable here: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--warmstart", type=int, default=200)
    parser.add_argument("--variant", choices=("dense", "moe"), default="dense", help="the policy's kind")
    parser.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                        help="also probe an int8 pool smoothed with this alpha")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sim = bench_fleet(args.steps, args.warmstart, args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        bench_formats(sim, args.episodes, Path(tmp) / "run", args.smoothquant)
    sim.close()


if __name__ == "__main__":
    main()
