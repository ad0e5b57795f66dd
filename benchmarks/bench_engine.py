"""Metric-engine benchmark: one script, one run, every time a ratio against baselines of the same run.

    python benchmarks/bench_engine.py                          # N = 100k, 1M, 8M, 32M; 1 and 2 threads
    python benchmarks/bench_engine.py --sizes 100k,1M --threads 1

Per size N (fp32 log-probs, 6 pools x 4 hardware x 8 length x 8 turn buckets = 1536 token cells):

* floor   - the memory-read floor: one reduction over every tensor the engine reads (trainer and
            sampler log-probs in their own dtype, sequence and turn index), no temporaries;
* engine  - ``compute_stats`` (every table, including the pandas assembly of the output), with the
            compiled per-token loops when they were built; ``torch ops ms`` is the same call with
            ``MetricConfig(kernel="torch")``, the implementation that runs on GPUs;
* naive   - a boolean mask per token cell and per sequence cell in a Python loop, ``torch.quantile``
            for the tails (it raises above 2^24 elements, so larger cells fall back to a sort).
            Above ``--naive-cells`` cells only an evenly spaced subset of the cells is timed and the
            per-cell time is extrapolated to all cells (marked ``~``);
* pandas  - ``groupby`` of the same per-slice statistics (exact quantiles included). Above
            ``--pandas-max`` tokens it is extrapolated linearly from the largest measured size
            (marked ``~``);
* peer    - (``--peers``) verl-style rollout-correction scalars, unsliced, on a padded batch,
            against ours from the same padded tensors (``peers.py``).

``--device cuda`` runs the engine and the same baselines on a GPU instead (``engine_device.py``).

The floor is measured at every thread count and the ratios use the fastest of them (the floor
is a property of the machine). Peak extra memory of the engine is measured in a child process
per size, with glibc returning every freed block above 64 KiB to the system
(``MALLOC_MMAP_THRESHOLD_``), as the largest resident set seen during the first run (sampled
every 2 ms) minus the resident set before it. Routing: ``--routing-tokens`` x 48 layers x top-8
uint8 expert ids, the engine's flip count against one read of both id tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine import native
from mismatch_monitor.engine.routing import routing_counts

POOLS, HARDWARE = 6, 4
CONFIG = MetricConfig(turn_edges=(1, 2, 3, 4, 6, 8, 12))  # 8 turn buckets
TORCH_OPS = dataclasses.replace(CONFIG, kernel="torch")
QS = (0.5, 0.9, 0.99, 0.999)
QUANTILE_LIMIT = 1 << 24


# ----------------------------------------------------------------------------- data

@dataclass
class Data:
    batch: TokenBatch
    cell: torch.Tensor       # [N] int64 token cell (for the baselines)
    seq_cell: torch.Tensor   # [B] int64 sequence cell
    lowprob_edges: torch.Tensor


def make_data(n_tokens: int, seed: int = 0) -> Data:
    """Sequences with log-uniform lengths in [16, 4096) (8 length buckets), sorted tokens, turns
    rising along each sequence, heavy-tailed lr (bulk ~1e-3, a 0.1% tail in [1, 5])."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    total = 0
    while total < n_tokens:
        ln = torch.exp(torch.empty(4096).uniform_(math.log(16), math.log(4096), generator=g)).long()
        lengths.append(ln)
        total += int(ln.sum())
    lengths = torch.cat(lengths)
    csum = lengths.cumsum(0)
    B = int((csum < n_tokens).sum()) + 1
    lengths = lengths[:B].clone()
    lengths[-1] -= int(csum[B - 1]) - n_tokens
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    sampler = torch.empty(n_tokens, dtype=torch.float32).exponential_(0.5, generator=g).neg_()
    lr = torch.empty(n_tokens, dtype=torch.float32).normal_(0.0, 1e-3, generator=g)
    tail = torch.rand(n_tokens, generator=g) < 1e-3
    k = int(tail.sum())
    lr[tail] = torch.empty(k).uniform_(1.0, 5.0, generator=g) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
    trainer = (sampler + lr).clamp_(max=0.0)       # log-probs of a softmax are <= 0
    del lr, tail
    turns_per_seq = torch.randint(1, 17, (B,), generator=g)
    seq = torch.repeat_interleave(torch.arange(B), lengths)
    pos = torch.arange(n_tokens) - offsets[:-1][seq]
    turn = pos * turns_per_seq[seq] // lengths[seq]
    del pos
    pool = torch.randint(0, POOLS, (B,), generator=g)
    hw = torch.randint(0, HARDWARE, (B,), generator=g)
    labels = {"pool": [f"pool{i}" for i in pool.tolist()], "hardware": [f"hw{i}" for i in hw.tolist()]}
    batch = TokenBatch.from_flat(trainer, sampler, seq_offsets=offsets, labels=labels, turn_index=turn,
                                 policy_version=torch.randint(0, 4, (B,), generator=g), trainer_version=4,
                                 advantages=torch.randn(B, generator=g))
    del seq
    # cell ids for the baselines, computed once outside their timings
    length_b = torch.bucketize(lengths, torch.tensor(CONFIG.length_edges), right=True)
    seq_cell = (pool * HARDWARE + hw) * (len(CONFIG.length_edges) + 1) + length_b
    turn_b = torch.bucketize(batch.turn_index, torch.tensor(CONFIG.turn_edges), right=True)
    cell = seq_cell[batch.seq_index] * (len(CONFIG.turn_edges) + 1) + turn_b
    edges = torch.log(torch.tensor(CONFIG.lowprob_edges, dtype=torch.float64))
    return Data(batch, cell, seq_cell, edges)


# ----------------------------------------------------------------------------- timing tools

class PeakRSS:
    """Largest resident set seen while the block runs, minus the resident set before it."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time in seconds of ``repeat`` runs (memory is measured apart, in a child
    process: a sampling thread here would take CPU from the timed threads)."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------- baselines

def read_floor(d: Data) -> None:
    b = d.batch
    for t in (b.trainer_logprobs, b.sampler_logprobs, b.seq_index, b.turn_index):
        t.sum()


def _cell_stats(t: torch.Tensor, s: torch.Tensor, edges: torch.Tensor) -> list[torch.Tensor]:
    t, s = t.double(), s.double()
    lr = t - s
    valid = torch.isfinite(lr) & (t <= CONFIG.positive_logprob_tol) & (s <= CONFIG.positive_logprob_tol)
    lr, s = lr[valid], s[valid]
    rho = torch.exp(lr)
    rc = rho.clamp(max=CONFIG.tis_cap)
    a = lr.abs()
    out = [lr.sum(), (lr * lr).sum(), a.sum(), (torch.expm1(lr) - lr).sum(), torch.exp(a).sum(),
           rho.sum(), (rho * rho).sum(), rc.sum(), (rc * rc).sum(),
           (rho > CONFIG.tis_cap).sum(), (rho <= 1 / CONFIG.tis_cap).sum(),
           ((rho <= 0.5) | (rho > 5)).sum(), ((rho <= 0.2) | (rho > 5)).sum()]
    if lr.numel():
        out += [lr.min(), lr.max(), a.max()]
        qs = torch.tensor(QS, dtype=torch.float64, device=a.device)
        if a.numel() <= QUANTILE_LIMIT:
            out.append(torch.quantile(a, qs))
        else:  # torch.quantile raises above 2^24 elements
            srt = a.sort().values
            out.append(srt[(qs * (srt.numel() - 1)).long()])
        bucket = torch.bucketize(s, edges, right=True)
        for j in range(len(edges) + 1):
            m = bucket == j
            out += [m.sum(), a[m].sum(), (torch.expm1(lr[m]) - lr[m]).sum()]
    return out


def naive(d: Data, max_cells: int) -> tuple[float, int, int]:
    """Time per-cell masks; returns (estimated seconds for all cells, cells timed, cells total)."""
    b = d.batch
    token_cells = torch.unique(d.cell)
    seq_cells = torch.unique(d.seq_cell)
    t0 = time.perf_counter()
    seq_len = torch.bincount(b.seq_index, minlength=b.num_sequences)
    fixed = time.perf_counter() - t0

    def pick(cells: torch.Tensor) -> torch.Tensor:
        if cells.numel() <= max_cells:
            return cells
        return cells[torch.linspace(0, cells.numel() - 1, max_cells, device=cells.device).long()]

    tok_sample, seq_sample = pick(token_cells), pick(seq_cells)
    first = d.cell == int(tok_sample[0])        # warm-up: first calls pay one-time setup costs
    _cell_stats(b.trainer_logprobs[first], b.sampler_logprobs[first], d.lowprob_edges)
    t0 = time.perf_counter()
    for c in tok_sample.tolist():
        m = d.cell == c
        _cell_stats(b.trainer_logprobs[m], b.sampler_logprobs[m], d.lowprob_edges)
    tok_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c in seq_sample.tolist():
        in_cell = d.seq_cell == c
        m = in_cell[b.seq_index]
        lr = b.trainer_logprobs[m].double() - b.sampler_logprobs[m].double()
        seqs = b.seq_index[m]
        n = torch.bincount(seqs, minlength=b.num_sequences).clamp(min=1)
        sum_lr = torch.bincount(seqs, weights=lr, minlength=b.num_sequences)
        exp_abs = torch.bincount(seqs, weights=torch.exp(lr.abs()), minlength=b.num_sequences)
        mx = torch.zeros(b.num_sequences, dtype=torch.float64, device=lr.device).scatter_reduce_(
            0, seqs, lr.abs(), "amax")
        keep = in_cell & (seq_len > 0)
        mean = sum_lr / n
        for x in (sum_lr[keep], mean[keep], mx[keep], (exp_abs / n)[keep]):
            x.sum(), x.min(), x.max()
        ((sum_lr[keep] < math.log(0.5)) | (sum_lr[keep] > math.log(2))).sum()
    seq_time = time.perf_counter() - t0
    est = fixed + tok_time * token_cells.numel() / tok_sample.numel() + seq_time * seq_cells.numel() / seq_sample.numel()
    return est, tok_sample.numel() + seq_sample.numel(), token_cells.numel() + seq_cells.numel()


def pandas_groupby(d: Data) -> None:
    b = d.batch
    t = b.trainer_logprobs.double().numpy()
    s = b.sampler_logprobs.double().numpy()
    lr = t - s
    df = pd.DataFrame({"cell": d.cell.numpy(), "seq": b.seq_index.numpy(), "lr": lr})
    df["valid"] = np.isfinite(lr) & (t <= CONFIG.positive_logprob_tol) & (s <= CONFIG.positive_logprob_tol)
    df = df[df["valid"]]
    lr = df["lr"].to_numpy()
    rho = np.exp(lr)
    rc = np.minimum(rho, CONFIG.tis_cap)
    df = df.assign(lr2=lr * lr, abs_lr=np.abs(lr), k3=np.expm1(lr) - lr, exp_abs=np.exp(np.abs(lr)),
                   rho=rho, rho2=rho * rho, rc=rc, rc2=rc * rc, clip_high=rho > CONFIG.tis_cap,
                   clip_low=rho <= 1 / CONFIG.tis_cap, icepop=(rho <= 0.5) | (rho > 5),
                   extreme=(rho <= 0.2) | (rho > 5),
                   lp=np.searchsorted(d.lowprob_edges.numpy(), s[df.index.to_numpy()], side="right"))
    sums = ["lr", "lr2", "abs_lr", "k3", "exp_abs", "rho", "rho2", "rc", "rc2", "clip_high", "clip_low",
            "icepop", "extreme"]
    g = df.groupby("cell")
    g[sums].sum()
    g["lr"].agg(["min", "max", "count"])
    g["abs_lr"].max()
    g["abs_lr"].quantile(list(QS))
    df.groupby(["cell", "lp"])[["abs_lr", "k3"]].agg(["sum", "count"])
    per_seq = df.groupby("seq").agg(n=("lr", "size"), sum_lr=("lr", "sum"), max_abs=("abs_lr", "max"),
                                    exp_abs=("exp_abs", "sum"))
    per_seq["mean_lr"] = per_seq["sum_lr"] / per_seq["n"]
    per_seq["cell"] = d.seq_cell.numpy()[per_seq.index.to_numpy()]
    per_seq.groupby("cell").agg(["sum", "min", "max"])


# ----------------------------------------------------------------------------- routing

def routing_bench(n_tokens: int, layers: int = 48, k: int = 8, experts: int = 128) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, experts, (n_tokens, layers, 1), generator=g, dtype=torch.int16)
    te = ((start + torch.arange(k, dtype=torch.int16)) % experts).to(torch.uint8)  # [N, L, K] distinct ids
    se = te.clone()
    flat_s = se.view(-1, k)
    flip = torch.rand(n_tokens * layers, generator=g) < 0.10       # ~10% of decisions differ
    rows = flip.nonzero().squeeze(1)
    col = torch.randint(0, k, (rows.numel(),), generator=g)
    outside = (start.view(-1)[rows] + k + torch.randint(0, experts - k, (rows.numel(),), generator=g)) % experts
    flat_s[rows, col] = outside.to(torch.uint8)
    perm = (torch.rand(n_tokens * layers, generator=g) < 0.05).nonzero().squeeze(1)
    flat_s[perm] = flat_s[perm].flip(-1)                            # same set, other order
    del start, flip, rows, col, outside, perm
    cell = torch.randint(0, 1536, (n_tokens,), generator=g)

    def floor() -> None:
        te.view(torch.int64).sum()
        se.view(torch.int64).sum()

    floor_t = timed(floor, 3)
    compiled = native.available()
    eng_t = timed(lambda: routing_counts(te, se, cell, 1536, CONFIG.chunk_tokens, compiled=compiled), 3)
    # sorting every row along K, the obvious set comparison, on 2% of the tokens
    sub = max(1, n_tokens // 50)
    sort_t = timed(lambda: (te[:sub].sort(-1).values != se[:sub].sort(-1).values).any(-1), 1)
    return dict(floor=floor_t, engine=eng_t, sort_all=sort_t * n_tokens / sub,
                gb=2 * te.numel() / 1e9)


# ----------------------------------------------------------------------------- side by side with a peer

def peer_table(slot_counts: list[int]) -> None:
    """verl-style unsliced scalars against our full sliced suite, both from the same padded
    tensors, one thread (peers.py); and our engine alone on the same tokens given flat."""
    import peers

    torch.set_num_threads(1)
    print(f"\nside by side, padded [B, 4096] fp32, 1 thread: peer = verl-style unsliced scalars (eager torch); "
          f"ours = TokenBatch.from_padded + compute_stats (every table)")
    print(f"{'slots':>6} {'tokens':>7} {'peer ms':>8} {'ours ms':>8} {'ours/peer':>9} {'ours w=2':>8} "
          f"{'w=2/peer':>8} {'flat eng':>8} {'flat/peer':>9} {'max rel diff':>12}")
    for n in slot_counts:
        p = peers.make_padded(n)
        flat = p.batch()
        peer_t = timed(lambda: peers.verl_style_metrics(p.trainer, p.sampler, p.mask), 5)
        ours_t = timed(lambda: compute_stats(p.batch(), CONFIG), 5)
        ours2_t = timed(lambda: compute_stats(p.batch(), CONFIG, workers=2), 5)
        flat_t = timed(lambda: compute_stats(flat, CONFIG), 5)
        diff = peers.check_against_ours(p, compute_stats(flat, CONFIG))
        print(f"{fmt_size(n):>6} {fmt_size(p.tokens):>7} {peer_t * 1e3:8.1f} {ours_t * 1e3:8.1f} "
              f"{ours_t / peer_t:9.2f} {ours2_t * 1e3:8.1f} {ours2_t / peer_t:8.2f} {flat_t * 1e3:8.1f} "
              f"{flat_t / peer_t:9.2f} {diff:12.1e}", flush=True)
        del p, flat
        gc.collect()


# ----------------------------------------------------------------------------- main

def parse_size(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "km" else text) * mult)


def fmt_size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}k"


def memory_child(n: int) -> None:
    """Print the engine's peak extra MiB on a fresh process (see the module docstring)."""
    torch.set_num_threads(1)
    d = make_data(n)
    with PeakRSS() as mem:
        compute_stats(d.batch, CONFIG)
    print(f"{mem.extra_mb:.1f}")


def engine_memory(n: int) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, __file__, "--memory-child", str(n)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100k,1M,8M,32M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--naive-cells", type=int, default=48, help="cells timed per size before extrapolating")
    ap.add_argument("--pandas-max", default="8M", help="largest N run through pandas; larger N extrapolated")
    ap.add_argument("--routing-tokens", default="1M", help="0 to skip the routing benchmark")
    ap.add_argument("--peers", default="8M", help="padded slots per peer comparison (verl-style scalars, "
                    "peers.py), comma-separated; 0 to skip")
    ap.add_argument("--device", default="cpu", help="cuda (or cuda:N): run on that device instead (engine_device.py)")
    ap.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child)
    if args.naive_cells < 1:
        ap.error(f"--naive-cells must be at least 1 (got {args.naive_cells}): the naive baseline times that many cells")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.device != "cpu":
        import engine_device

        return engine_device.run(sizes, args.device, args.naive_cells, CONFIG, make_data, read_floor, naive, fmt_size)
    threads = [int(t) for t in args.threads.split(",")]
    pandas_max = parse_size(args.pandas_max)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, chunk_tokens={CONFIG.chunk_tokens}, "
          f"per-token loops: {'compiled (engine/_native.c)' if native.use_native(CONFIG, torch.device('cpu')) else 'torch ops'}; "
          f"times are the best of the repeats; x floor = time / the fastest read floor of that N")
    header = (f"{'N':>6} {'thr':>3} {'floor ms':>9} {'GB/s':>6} {'engine ms':>10} {'x floor':>8} "
              f"{'eng w=2 ms':>10} {'x floor':>8} {'naive s':>9} {'naive/eng':>9} {'pandas s':>9} "
              f"{'pandas/eng':>10} {'eng MiB':>8} {'torch ops ms':>12}")
    rows = []
    print(header)
    pandas_rate = None
    for n in sizes:
        d = make_data(n)
        nbytes = sum(t.numel() * t.element_size() for t in
                     (d.batch.trainer_logprobs, d.batch.sampler_logprobs, d.batch.seq_index, d.batch.turn_index))
        repeat = 5 if n <= 8_000_000 else 3
        naive_s = naive_note = pandas_s = pandas_note = None
        floors = {}
        for th in threads:
            torch.set_num_threads(th)
            floors[th] = timed(lambda: read_floor(d), 5)
        best_floor = min(floors.values())
        eng_mem = engine_memory(n)
        for th in threads:
            torch.set_num_threads(th)
            floor_t = floors[th]
            eng_t = timed(lambda: compute_stats(d.batch, CONFIG), repeat)
            eng2_t = torch_t = None
            if th == 1:  # two Python threads, each running single-threaded ops
                eng2_t = timed(lambda: compute_stats(d.batch, CONFIG, workers=2), repeat)
                # the torch implementation of the same pass (GPUs, installs without a compiler)
                torch_t = timed(lambda: compute_stats(d.batch, TORCH_OPS), repeat)
            if naive_s is None:
                est, timed_cells, all_cells = naive(d, args.naive_cells)
                naive_s = est
                naive_note = "~" if timed_cells < all_cells else " "
                if n <= pandas_max:
                    pandas_s = timed(lambda: pandas_groupby(d), 1)
                    pandas_rate = pandas_s / n
                    pandas_note = " "
                elif pandas_rate is not None:
                    pandas_s, pandas_note = pandas_rate * n, "~"
            best = min(eng_t, eng2_t or math.inf)
            rows.append(
                f"{fmt_size(n):>6} {th:>3} {floor_t * 1e3:9.1f} {nbytes / floor_t / 1e9:6.1f} {eng_t * 1e3:10.1f} "
                f"{eng_t / best_floor:8.1f} "
                + (f"{eng2_t * 1e3:10.1f} {eng2_t / best_floor:8.1f} " if eng2_t else f"{'-':>10} {'-':>8} ")
                + f"{naive_note}{naive_s:8.2f} {naive_s / best:9.0f} "
                + (f"{pandas_note}{pandas_s:8.2f} {pandas_s / best:10.0f} " if pandas_s else f"{'-':>9} {'-':>10} ")
                + f"{eng_mem:8.0f} " + (f"{torch_t * 1e3:12.1f}" if torch_t else f"{'-':>12}"))
            print(rows[-1], flush=True)
        del d
        gc.collect()
    print("~ = extrapolated: naive from an evenly spaced subset of cells, pandas linearly from the largest run")
    print("naive/eng and pandas/eng use the faster engine time of the row (workers=1 or 2)")
    if args.peers != "0":
        peer_table([parse_size(x) for x in args.peers.split(",")])
    routing_n = parse_size(args.routing_tokens) if args.routing_tokens != "0" else 0
    if routing_n:
        torch.set_num_threads(1)
        r = routing_bench(routing_n)
        print(f"\nrouting {fmt_size(routing_n)} tokens x 48 layers x top-8 uint8 ({r['gb']:.2f} GB of ids), 1 thread:")
        print(f"  read floor {r['floor'] * 1e3:.1f} ms ({r['gb'] / r['floor']:.1f} GB/s); engine "
              f"{r['engine'] * 1e3:.1f} ms = {r['engine'] / r['floor']:.1f}x floor; "
              f"sorting every row along K ~{r['sort_all']:.1f} s (2% of rows, extrapolated)")


if __name__ == "__main__":
    main()
