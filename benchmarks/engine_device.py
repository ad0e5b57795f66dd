"""``bench_engine.py --device cuda``: the engine where a trainer's tensors live, with the same
baselines measured on the same device in the same run.

Per size N (the batch of ``bench_engine.make_data``, moved to the device):

* floor   - one reduction over every tensor the engine reads, on the device;
* engine  - ``compute_stats`` on the device tensors (the torch ops; the finished statistics
            come to the host in one copy), and how many times one call waits for the device
            (``torch.cuda.set_sync_debug_mode``: each wait is a warning);
* naive   - the same per-cell Python loop of masks as on the CPU, on the device;
* peers   - verl-style unsliced scalars on a padded batch of N slots (``peers.py``), against
            ours from the same padded tensors (``from_padded`` + ``compute_stats``).

Every timing synchronises the device before it starts and before it stops.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable

import torch

from mismatch_monitor.engine import compute_stats

import peers


def _on(device: torch.device, batch):
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def timed_on(device: torch.device, fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    fn()                                     # warm-up: kernels load, caches allocate
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def waits_per_call(fn: Callable[[], object]) -> int:
    """How many times ``fn`` waits for the device (CUDA's sync debug mode warns at each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(sizes: list[int], device_name: str, naive_cells: int, config, make_data, read_floor, naive,
        fmt_size: Callable[[int], str]) -> None:
    device = torch.device(device_name)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"--device {device_name}: no CUDA device here (torch {torch.__version__}, "
                         f"cuda available: {torch.cuda.is_available()})")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}; times are the best of 5 after a "
          "warm-up, each between two device synchronisations")
    print(f"{'N':>6} {'floor ms':>9} {'GB/s':>7} {'engine ms':>10} {'x floor':>8} {'waits':>6} "
          f"{'naive s':>9} {'naive/eng':>9} {'peer ms':>8} {'ours padded ms':>14} {'ours/peer':>9}")
    for n in sizes:
        d = make_data(n)
        d = dataclasses.replace(d, batch=_on(device, d.batch), cell=d.cell.to(device),
                                seq_cell=d.seq_cell.to(device), lowprob_edges=d.lowprob_edges.to(device))
        b = d.batch
        nbytes = sum(t.numel() * t.element_size() for t in
                     (b.trainer_logprobs, b.sampler_logprobs, b.seq_index, b.turn_index))
        floor_t = timed_on(device, lambda: read_floor(d), 5)
        eng_t = timed_on(device, lambda: compute_stats(b, config), 5)
        waits = waits_per_call(lambda: compute_stats(b, config))
        naive_s, _, _ = naive(d, naive_cells)
        p = peers.make_padded(n, device=device)
        peer_t = timed_on(device, lambda: peers.verl_style_metrics(p.trainer, p.sampler, p.mask), 5)
        ours_t = timed_on(device, lambda: compute_stats(p.batch(), config), 5)
        print(f"{fmt_size(n):>6} {floor_t * 1e3:9.2f} {nbytes / floor_t / 1e9:7.0f} {eng_t * 1e3:10.1f} "
              f"{eng_t / floor_t:8.1f} {waits:6d} {naive_s:9.2f} {naive_s / eng_t:9.0f} {peer_t * 1e3:8.1f} "
              f"{ours_t * 1e3:14.1f} {ours_t / peer_t:9.2f}", flush=True)
        del d, b, p
        torch.cuda.empty_cache()
