"""``mismatch-monitor demo``: a live simulated RL run, written to a run directory as it trains.

The one place (with ``sample_data``) that wires simulator -> collector -> alerts: every step's
batch goes through :class:`MismatchCollector` with the default alert rules, and each resync the
alerts ask for is handed back to the simulator, which pushes fresh weights to that pool.

    mismatch-monitor demo                                  # fault_midrun, MoE, 200 steps
    mismatch-monitor demo --scenario stable_fleet --variant dense --steps 100 --dashboard
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..sim import SCENARIOS, SimConfig, Simulation, scenario
from ..sim.pools import FAULT_KINDS


@dataclass
class RunResult:
    """What a simulated run did, for the closing summary and the benchmark."""

    run_dir: Path
    steps: int = 0
    seconds_total: float = 0.0
    seconds_collector: float = 0.0
    seconds_setup: float = 0.0
    rewards: list[float] = field(default_factory=list)
    rewards_by_pool: list[dict[str, float]] = field(default_factory=list)
    firing: list[str] = field(default_factory=list)
    resyncs: list[tuple[int, str]] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="fault_midrun",
                        help="which fleet to simulate (default fault_midrun)")
    parser.add_argument("--fault", choices=FAULT_KINDS, default="stop_sync",
                        help="the fault of fault_midrun / vllm_fleet, switched on at steps // 2 (default "
                             "stop_sync; sync_no_reset needs --engine vllm)")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                        help="torch: simulated pools (default); vllm: the vllm_fleet scenario, every pool a real "
                             "in-process vLLM engine (dense policy; needs make install-vllm)")
    parser.add_argument("--variant", choices=("dense", "moe"), default="moe",
                        help="toy Qwen3 (dense) or Qwen3-MoE with 8 experts, top-2 (default moe)")
    parser.add_argument("--steps", type=int, default=200, help="RL steps (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed; a run is reproducible from it")
    parser.add_argument("--correction", choices=("none", "tis", "mis"), default=None,
                        help="override the scenario's off-policy correction")
    parser.add_argument("--warmstart-steps", type=int, default=None,
                        help="override the supervised warm-start steps (default 200)")
    parser.add_argument("--runs-root", default="runs", help="where run directories go (default ./runs)")
    parser.add_argument("--name", default=None,
                        help="run directory name (default <scenario>-<variant>-<timestamp>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run of that name")
    parser.add_argument("--no-alerts", action="store_true", help="no alert evaluation, no resync loop")
    parser.add_argument("--fingerprints", action="store_true",
                        help="each sync also gives the fingerprints of the weights sent and of the version "
                             "meant, as a pipeline that checks its pushes (a wrong_weights push is found at "
                             "its sync)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="also serve Prometheus /metrics on 127.0.0.1:PORT while running")
    parser.add_argument("--dashboard", action="store_true",
                        help="start the dashboard on the runs root, following the run; Ctrl-C stops it")
    parser.add_argument("--dashboard-port", type=int, default=8501,
                        help="dashboard port (default 8501; 0: any free port, printed); a port in use "
                             "is an error before the run starts")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace) -> SimConfig:
    if getattr(args, "engine", "torch") == "vllm":     # real engines: their own fleet, dense
        args.scenario, args.variant = "vllm_fleet", "dense"
    faulted = args.scenario in ("fault_midrun", "vllm_fleet")
    options: dict[str, Any] = {"fault": args.fault} if faulted else {}
    config = scenario(args.scenario, steps=args.steps, variant=args.variant, seed=args.seed, **options)
    if args.correction is not None:
        config = replace(config, correction=args.correction)
    if args.warmstart_steps is not None:
        config = replace(config, warmstart_steps=args.warmstart_steps)
    return config


def simulate(config: SimConfig, run_dir: Path, *, steps: int, run_id: str, alerts: bool = True,
             progress: bool = True, exporter: Any = None, metadata: dict[str, Any] | None = None,
             echo: bool = True, fingerprints: bool = False) -> RunResult:
    """Run ``config`` for ``steps`` steps through a collector writing ``run_dir`` (``fingerprints``:
    ``SimulationRecorder``'s)."""
    from ..collectors import MismatchCollector
    from ..collectors.simulation import SimulationRecorder

    t0 = time.perf_counter()
    sim = Simulation(config)
    result = RunResult(run_dir=run_dir, seconds_setup=time.perf_counter() - t0)
    evaluator = _alert_evaluator(sim.pool_metadata()) if alerts else None
    # what each vLLM engine really runs (dtype, quantization as applied, versions); torch pools: none
    meta = {"simulator": {"config": asdict(config), "engines": sim.engine_info(), **(metadata or {})}}
    collector = MismatchCollector(run_dir, config=config.thresholds, run_id=run_id,
                                  pools=sim.pool_metadata(), alert_evaluator=evaluator,
                                  exporter=exporter, metadata=meta,
                                  flush_every_seconds=2.0)   # the dashboard follows the run closely

    def on_resync(event: Any) -> None:
        pool = event.pool if event.pool in sim.samplers else None   # fleet-wide: every pool
        sim.resync(pool)
        result.resyncs.append((int(event.step), pool or "*"))

    def on_alert(event: Any) -> None:
        if event.state == "firing":
            line = f"step {event.step}: [{event.severity}] {event.alert} pool={event.pool}: {event.summary}"
            result.firing.append(line)
            if echo:
                _write(line)

    collector.on_resync(on_resync)
    collector.on_alert(on_alert)
    recorder = SimulationRecorder(collector, sim, fingerprints=fingerprints)   # batches, syncs, resyncs, outcomes
    with collector:
        try:
            for out in sim.run(steps, progress=progress):
                t = time.perf_counter()
                recorder.record(out)
                result.seconds_collector += time.perf_counter() - t
                result.rewards.append(out.reward_mean)
                result.rewards_by_pool.append(out.reward_by_pool)
                result.steps += 1
        finally:
            sim.close()
    result.seconds_total = time.perf_counter() - t0
    return result


def _alert_evaluator(pools: dict[str, dict[str, Any]]) -> Any:
    """The project's rules, given the pools' metadata (expected levels, declared max_staleness)."""
    try:
        from ..alerts import AlertEvaluator
    except ImportError as exc:   # alerts are optional for a demo run
        _write(f"alerts unavailable ({exc}); running without alert evaluation")
        return None
    return AlertEvaluator(pools=pools)


def _write(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"expected --steps >= 1, got {args.steps}")
    config = build_config(args)
    name = args.name or f"{args.scenario}-{args.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = Path(args.runs_root)
    run_dir = root / name
    if run_dir.exists():
        if not args.overwrite:
            raise ValueError(f"run directory {run_dir} exists; pass --overwrite or another --name")
        shutil.rmtree(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    exporter = _exporter(args.metrics_port)
    previous = _stop_on_signals() if args.dashboard else {}
    dashboard, finished = None, False
    try:
        if args.dashboard:
            dashboard = _start_dashboard(root, args.dashboard_port)
        print(f"demo: scenario {args.scenario} ({config.policy.variant}, {len(config.pools)} pools, "
              f"correction {config.correction}, seed {config.seed}), {args.steps} steps")
        print(f"demo: writing run {run_dir.resolve()}", flush=True)
        result = simulate(config, run_dir, steps=args.steps, run_id=name, alerts=not args.no_alerts,
                          progress=not args.quiet, exporter=exporter,
                          metadata={"scenario": args.scenario, "steps": args.steps},
                          fingerprints=getattr(args, "fingerprints", False))
        print_summary(result)
        finished = True
        if dashboard is not None:
            print("demo: the dashboard keeps serving the run; Ctrl-C stops it", flush=True)
            if dashboard.wait() != 0:        # it stopped by itself, not by our Ctrl-C
                print(f"demo: the dashboard server exited with status {dashboard.returncode}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        print("demo: stopped" if finished else "demo: interrupted", file=sys.stderr)
    finally:
        if exporter is not None:
            exporter.stop()
        if dashboard is not None and dashboard.poll() is None:
            dashboard.terminate()
            dashboard.wait(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if finished else 130


def print_summary(result: RunResult) -> None:
    from . import summary

    r = result.rewards
    head, tail = r[: max(1, len(r) // 10)], r[-max(1, len(r) // 10):]
    loop = result.seconds_total - result.seconds_setup
    print(f"\ndemo: {result.steps} steps in {result.seconds_total:.1f} s (setup {result.seconds_setup:.1f} s, "
          f"{result.steps / max(loop, 1e-9):.2f} steps/s, collector {result.seconds_collector / max(loop, 1e-9):.0%} "
          f"of the loop)")
    print(f"demo: mean reward {sum(head) / len(head):.3f} over the first tenth of the steps, "
          f"{sum(tail) / len(tail):.3f} over the last")
    print(f"demo: {len(result.firing)} alert firing(s), {len(result.resyncs)} resync(s)"
          + (f": {', '.join(f'{p}@{s}' for s, p in result.resyncs[:8])}" if result.resyncs else ""))
    print(f"demo: run directory {result.run_dir.resolve()}\n")
    summary.run(argparse.Namespace(run_dir=str(result.run_dir), worst=5, window=1))


def _exporter(port: int | None) -> Any:
    if port is None:
        return None
    from ..exporter import MismatchExporter

    exporter = MismatchExporter()
    bound = exporter.start(port, addr="127.0.0.1")
    print(f"demo: Prometheus metrics on http://127.0.0.1:{bound}/metrics")
    return exporter


def _stop_on_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (even where a shell made us ignore SIGINT), so
    the ``finally`` that stops the dashboard's server always runs; returns the previous handlers."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}


def _start_dashboard(root: Path, port: int) -> subprocess.Popen[bytes]:
    """The dashboard's server, answering on 127.0.0.1 before the run starts. A taken port, or a
    server that exits first, is a ValueError saying so (the CLI's error, status 2), never a URL
    that shows nothing."""
    from .dashboard import DashboardError, claim_port, streamlit_command, wait_until_serving

    port = claim_port("127.0.0.1", port)
    child = subprocess.Popen(streamlit_command(root.resolve(), port=port, address="127.0.0.1"),
                             stdout=subprocess.DEVNULL)   # its banner; errors still show
    print(f"demo: dashboard server pid {child.pid}", flush=True)
    try:
        wait_until_serving(child, f"http://127.0.0.1:{port}")
    except BaseException as exc:        # Ctrl-C while waiting too: never leave the server behind
        if child.poll() is None:
            child.terminate()
            child.wait(timeout=10)
        if isinstance(exc, DashboardError):
            raise ValueError(str(exc)) from exc
        raise
    print(f"demo: dashboard on http://127.0.0.1:{port}", flush=True)
    return child
