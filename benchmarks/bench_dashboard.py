"""The dashboard's queries on a long run, against a bare scan of the same files; first paint.

    python benchmarks/bench_dashboard.py                       # 10,000 steps x 500 token cells
    python benchmarks/bench_dashboard.py --steps 2000 --no-browser   # a quick look

A run of ``--steps`` steps is generated with the real store: 16 batches of 5 pools x 4 envs x 5
response lengths x 5 turn buckets (500 token cells, 5,600 tokens each) go through the real
engine once, and their statistics are logged round-robin, one per step, by ``RunWriter``
(flushed every ``--flush-every`` steps), with alert rows every 250 steps. For each page, the
page's loader (``app/loaders.py``: every query the page runs) is timed cold, on a fresh DuckDB
connection with nothing kept from earlier reads (``query.forget_files``), against baselines over
the same files measured in the same run: ``SELECT count(*)``, which DuckDB answers from the
Parquet footers without reading data, over every file of the tables the loader reads (their
step-block rollups included), and over the cell tables alone (the stricter ratio); and one pass
reading every column (``max`` of each). The generation time includes the writer's rollups. The
Overview's first paint is timed in Debian's Chromium: from navigation to the page fully drawn,
the dashboard started by ``mismatch-monitor dashboard``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from mismatch_monitor import query
from mismatch_monitor.app import loaders
from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.store import rollup
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.exemplars import tail_exemplars
from mismatch_monitor.store import RunWriter
from timing import durations

POOLS = ("bf16", "fp8", "int4", "mxfp4", "tpu")
ENVS = ("math", "code", "search", "chat")
LENGTHS = (10, 20, 40, 70, 140)          # one per length bucket <16, 16-31, 32-63, 64-127, 128-255
TURNS = 9                                # turn indices 0..8: buckets 0, 1, 2-3, 4-7, 8-15
# tables each page's loader reads (the baseline scans every file of these)
TABLES = {
    "overview": ("steps", "tokens", "sequences", "abs_hist", "alerts"),
    "pools": ("steps", "tokens", "sequences", "abs_hist"),
    "tails": ("steps", "tokens", "sequences", "abs_hist"),
    "lowprob": ("steps", "lowprob"),
    "length_turn": ("steps", "tokens", "sequences", "abs_hist"),
    "routing": ("steps", "tokens", "routing_layers"),
    "corrections": ("steps", "tokens", "sequences"),
    "alerts": ("steps", "alerts", "tokens", "abs_hist"),     # the p99 series
    "compare": ("steps", "tokens", "sequences", "abs_hist"),
    "exemplars": ("steps", "exemplar_tokens", "exemplar_sequences"),
    "run_series": ("steps", "tokens", "sequences"),          # one run of the Several runs page (k3)
}


def template_batch(seed: int) -> TokenBatch:
    """100 sequences, one per (pool, env, length): 500 token cells with the turn buckets."""
    rng = np.random.default_rng(seed)
    seqs = [(p, e, n) for p in POOLS for e in ENVS for n in LENGTHS]
    lengths = np.array([n for _, _, n in seqs])
    seq = np.repeat(np.arange(len(seqs)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    turn = pos * TURNS // lengths[seq]
    sampler = -rng.exponential(2.0, seq.size)
    lr = rng.normal(0.0, 1e-3 * (1 + np.array([POOLS.index(p) for p, _, _ in seqs]))[seq])
    tail = rng.random(seq.size) < 2e-3
    lr[tail] = rng.uniform(1, 4, tail.sum()) * rng.choice([-1, 1], tail.sum())
    L, K, E = 8, 2, 16
    te = np.argsort(rng.random((seq.size * L, E)), axis=1)[:, :K].reshape(seq.size, L, K)
    se = te.copy()
    flip = rng.random((seq.size, L)) < 0.05
    se[flip, 0] = (se[flip, 0] + 1 + rng.integers(0, E - 2, flip.sum())) % E
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return TokenBatch.from_flat(
        torch.from_numpy(sampler + lr), torch.from_numpy(sampler), seq_offsets=torch.from_numpy(offsets),
        labels={"pool": [p for p, _, _ in seqs], "env": [e for _, e, _ in seqs]},
        turn_index=torch.from_numpy(turn), trainer_experts=torch.from_numpy(te.astype(np.uint8)),
        sampler_experts=torch.from_numpy(se.astype(np.uint8)), advantages=torch.from_numpy(rng.normal(size=len(seqs))),
        policy_version=torch.from_numpy(rng.integers(0, 4, len(seqs))), trainer_version=4)


def generate(run_dir: Path, steps: int, flush_every: int) -> dict[str, int]:
    torch.set_num_threads(1)
    config = MetricConfig()
    templates = []
    for seed in range(16):
        batch = template_batch(seed)
        templates.append((compute_stats(batch, config), tail_exemplars(batch, 16, config)))
    cells = len(templates[0][0].tables["tokens"])
    writer = RunWriter(run_dir, config=config, flush_every_steps=flush_every, flush_every_seconds=1e9,
                       pools={p: {"precision": p} for p in POOLS})
    t0 = time.time() - steps
    for step in range(steps):
        stats, exemplars = templates[step % len(templates)]
        if step % 250 == 249:
            writer.append_alerts([{"step": step, "wall_time": t0 + step, "alert": "MismatchTailGrowth",
                                   "severity": "warning", "pool": "fp8", "state": "firing" if step % 500 else
                                   "resolved", "value": 2.5, "threshold": 2.0, "summary": "p99 grew",
                                   "runbook": "", "resync": False}])
        writer.append_step(step, stats, exemplars, wall_time=t0 + step)
    writer.close()
    rows = {}
    con = query.connect()
    for table in TABLES["overview"] + ("lowprob", "routing_layers", "exemplar_tokens"):
        files = query.table_files(run_dir, table)
        rows[table] = con.execute("SELECT count(*) FROM read_parquet($f)", {"f": files}).fetchone()[0] if files else 0
    rows["token_cells_per_step"] = cells
    return rows


def timed(fn, repeat: int) -> float:
    return statistics.median(durations(fn, repeat))


def with_rollups(tables: tuple[str, ...]) -> tuple[str, ...]:
    """The tables and the rollups of those a page reads binned (``store/rollup.py``)."""
    return tables + tuple(rollup.rollup_name(t) for t in tables if t in rollup.ROLLUP_TABLES)


def count_scan(run_dir: Path, tables: tuple[str, ...]) -> None:
    """``count(*)`` over every file of the tables (DuckDB answers it from the Parquet footers)."""
    con = query.connect()
    for table in tables:
        files = query.table_files(run_dir, table)
        if files:
            con.execute("SELECT count(*) FROM read_parquet($f, union_by_name=true)", {"f": files}).fetchone()
    con.close()


def full_scan(run_dir: Path, tables: tuple[str, ...]) -> None:
    """One pass reading every column of every file of the tables (max of each column)."""
    con = query.connect()
    for table in tables:
        files = query.table_files(run_dir, table)
        if files:
            cols = [r[0] for r in con.execute("DESCRIBE SELECT * FROM read_parquet($f, union_by_name=true)",
                                              {"f": files}).fetchall()]
            select = ", ".join(f'max("{c}")' for c in cols)   # column names from the files themselves
            con.execute(f"SELECT {select} FROM read_parquet($f, union_by_name=true)", {"f": files}).fetchone()
    con.close()


def page_queries(run_dir: Path, other: Path, loader: str) -> None:
    query.forget_files()          # cold: nothing kept from an earlier run of the page
    con = query.connect()
    params: dict[str, object] = {"window": None, "max_points": 600}
    if loader == "compare":
        params["other"] = str(other)
    if loader == "exemplars":
        params["step"] = 9_000
    if loader == "alerts":
        params["metric"] = "mismatch/abs_log_ratio/p99"
    getattr(loaders, loader)(con, run_dir, **params)
    con.close()


def first_paint(root: Path, run: str) -> tuple[float, float]:
    """Seconds from navigation to the Overview fully drawn: cold (first visit) and warm."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_dashboard_browser import CHROMIUM, LAUNCH_ARGS, READY, cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([cli(), "dashboard", str(root), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(300):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.2)
        out = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            for _ in range(2):
                page = browser.new_page(viewport={"width": 1400, "height": 2400})
                t = time.perf_counter()
                page.goto(f"http://127.0.0.1:{port}/?run={run}")
                page.wait_for_function(READY, arg="Overview", timeout=300_000)
                out.append(time.perf_counter() - t)
                page.close()
            browser.close()
        return out[0], out[1]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--flush-every", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="keep the generated runs here")
    ap.add_argument("--no-browser", action="store_true")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench_dashboard_"))
    root = base / "runs"
    run, other = root / "long", root / "long-b"
    if not (run / "steps").exists():
        t = time.perf_counter()
        rows = generate(run, args.steps, args.flush_every)
        generate(other, args.steps // 10, args.flush_every)
        print(f"generated {args.steps} steps in {time.perf_counter() - t:.0f} s: "
              + ", ".join(f"{k}={v:,}" for k, v in rows.items()))
    print(f"{os.cpu_count()} CPUs; times are medians of {args.repeat} cold runs (fresh DuckDB connection)")
    print("count(*) and scan: over every file the page reads (cells and rollups); 'cells': over its "
          "cell tables only")
    print(f"{'page':<24}{'queries s':>10}{'count(*) s':>11}{'x count':>8}{'cells s':>8}{'x cells':>8}"
          f"{'scan s':>8}{'x scan':>7}")
    for spec in PAGES:
        tables = TABLES[spec.loader]
        count_s = timed(lambda: count_scan(run, with_rollups(tables)), args.repeat)
        cells_s = timed(lambda: count_scan(run, tables), args.repeat)
        scan_s = timed(lambda: full_scan(run, with_rollups(tables)), args.repeat)
        page_s = timed(lambda: page_queries(run, other, spec.loader), args.repeat)
        print(f"{spec.title:<24}{page_s:>10.3f}{count_s:>11.3f}{page_s / count_s:>8.1f}{cells_s:>8.3f}"
              f"{page_s / cells_s:>8.1f}{scan_s:>8.3f}{page_s / scan_s:>7.1f}")
    if not args.no_browser:
        cold, warm = first_paint(root, run.name)
        print(f"Overview first paint in Chromium: {cold:.2f} s cold (new server, empty caches), "
              f"{warm:.2f} s on a second visit (cached queries)")


if __name__ == "__main__":
    main()
