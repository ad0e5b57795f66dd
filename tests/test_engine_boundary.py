"""What crosses into the compiled loops (engine/boundary.py): every array checked by name, the
call's layout versioned, a warning when kernel="auto" falls back to the torch ops, and the same
statistics from every compiler's build of _native.c (GCC, clang, the portable build that arm64
gets)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import boundary, compute_stats, native
from mismatch_monitor.engine.histogram import LogBins
from mismatch_monitor.engine.ranges import sequence_ranges
from mismatch_monitor.engine.regions import JointCoder
from mismatch_monitor.engine.routing import routing_counts
from mismatch_monitor.engine.token_pass import TokenAccumulators
from reference import make_case

NATIVE = MetricConfig(kernel="native")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _built():
    assert native.available(), "the compiled extension mismatch_monitor.engine._native was not built"


def test_an_int32_seq_index_is_refused_naming_the_array():
    # dataclasses.replace skips TokenBatch's constructors; the loop reads 8 bytes per id, so an
    # int32 index would be read as 8N bytes of a 4N buffer
    batch = make_case(2, num_sequences=6).batch("seq_ids")          # ids read token by token
    bad = dataclasses.replace(batch, seq_ids=batch.seq_index.to(torch.int32))
    with pytest.raises(TypeError, match=r"seq_index as a contiguous CPU torch.int64 .*got torch.int32"):
        compute_stats(bad, NATIVE)
    too_short = dataclasses.replace(batch, turn_index=batch.turn_index[:-1])
    with pytest.raises(ValueError, match=r"turn_index .* shape \(%d,\).*got .* shape \(%d,\)"
                       % (batch.num_tokens, batch.num_tokens - 1)):
        compute_stats(too_short, NATIVE)


def _kernel_and_accumulators(batch):
    coder = JointCoder.build(NATIVE, torch.device("cpu"))
    bins = LogBins.from_config(NATIVE)
    kernel = native.TokenKernel.build(NATIVE, coder, bins, 1, 0, batch.num_sequences, 1)
    J = 2 * (len(NATIVE.lowprob_edges) + 1) * coder.R          # (1 cell + the dump) x lowprob x regions
    return kernel, lambda: TokenAccumulators.zeros(1, batch.num_sequences, J, bins.num_bins, torch.device("cpu"),
                                                   torch.int32)


def _strided(a: torch.Tensor) -> torch.Tensor:
    return torch.zeros(2 * a.numel(), dtype=a.dtype)[::2]


@pytest.mark.parametrize("name, change, error", [
    ("abs_hist", lambda a: a.to(torch.int64), TypeError),           # the loop adds int32 counts
    ("joint_n", lambda a: a[:-1], ValueError),                      # one bin short
    ("seq_max_abs", _strided, ValueError),                          # a view with strides
    ("min_lr", lambda a: a.to(torch.float32), TypeError),
    ("joint_sums", lambda a: a[:, :-1], ValueError),
    ("seq_invalid", lambda a: torch.zeros(a.numel() + 5, dtype=a.dtype), ValueError),
])
def test_accumulators_the_loop_cannot_add_into_are_refused(name, change, error):
    batch = make_case(2, num_sequences=5).batch("seq_ids")
    kernel, fresh = _kernel_and_accumulators(batch)
    ranges = sequence_ranges(0, batch.num_tokens, None, np.zeros(batch.num_sequences, dtype=np.int64))
    seq_cell = torch.zeros(batch.num_sequences, dtype=torch.int64)
    good = fresh()
    kernel.run(ranges, batch.trainer_logprobs, batch.sampler_logprobs, batch.seq_index, None, seq_cell, None, good)
    acc = fresh()
    setattr(acc, name, change(getattr(acc, name)))
    with pytest.raises(error, match=f"acc.{name}"):
        kernel.run(ranges, batch.trainer_logprobs, batch.sampler_logprobs, batch.seq_index, None, seq_cell, None, acc)
    with pytest.raises(IndexError, match="seq_cell"):               # a cell past the accumulators
        kernel.run(ranges, batch.trainer_logprobs, batch.sampler_logprobs, batch.seq_index, None,
                   seq_cell + 1, None, fresh())
    with pytest.raises(TypeError, match="trainer_logprobs"):        # integers are not log-probs
        kernel.run(ranges, batch.trainer_logprobs.to(torch.int64), batch.sampler_logprobs, batch.seq_index,
                   None, seq_cell, None, fresh())


def test_routing_arrays_are_checked_and_cells_bounded():
    case = make_case(4, num_sequences=10, routing=(3, 8))
    t = torch.from_numpy(case.trainer_experts)
    s = torch.from_numpy(case.sampler_experts)
    cell = torch.zeros(t.shape[0], dtype=torch.int64)
    with pytest.raises(TypeError, match="sampler_experts .*got torch.int16"):
        routing_counts(t, s.to(torch.int16), cell, 2, 1 << 16, compiled=True)
    with pytest.raises(TypeError, match="token_cell .*got torch.int32"):
        routing_counts(t, s, cell.to(torch.int32), 2, 1 << 16, compiled=True)
    s = s.clone()
    s[:, :, 0] = s[:, :, 0] + 1                   # every row a flip: the loop reads every cell
    with pytest.raises(IndexError, match=r"token cells in \[0, 2\)"):
        routing_counts(t, s, cell + 2, 2, 1 << 16, compiled=True)


def test_the_call_carries_its_layout_version(monkeypatch):
    # the C side refuses a call of another layout; the loader refuses a build of another one
    call = boundary.TokenPass(version=boundary.ABI_VERSION + 1)
    assert native.library().mm_token_pass(ctypes.byref(call)) == -4
    monkeypatch.setattr(native, "abi_version", lambda lib: boundary.ABI_VERSION - 1)
    native._load.cache_clear()
    try:
        assert not native.available()
        with pytest.raises(RuntimeError, match=f"layout version {boundary.ABI_VERSION - 1}.*reinstall"):
            compute_stats(make_case(1, num_sequences=3).batch("offsets"), NATIVE)
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
    assert native.available()


def test_auto_warns_once_when_it_falls_back_to_the_torch_ops(monkeypatch):
    batch = make_case(1, num_sequences=3).batch("offsets")
    monkeypatch.setattr(native, "library", lambda: None)
    native._warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compute_stats(batch, MetricConfig())
        compute_stats(batch, MetricConfig())
        compute_stats(batch, MetricConfig(kernel="torch"))           # chosen: no warning
        assert not native.use_native(MetricConfig(), torch.device("meta"))   # other devices: by design
    fallbacks = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "4x slower" in str(fallbacks[0].message) and "not built" in str(fallbacks[0].message)
    native._warn_fallback.cache_clear()


# ------------------------------------------------------------------ builds by other compilers

def _build(tmp: Path, name: str, env: dict[str, str]) -> ctypes.CDLL:
    """_native.c built by setup.py (the flags of a real install) with ``env`` into ``tmp``."""
    out = tmp / name
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(out / "lib"),
                           "--build-temp", str(out / "tmp")], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (so,) = (out / "lib").rglob("_native*.so")
    lib = ctypes.CDLL(str(so))
    assert boundary.abi_version(lib) == boundary.ABI_VERSION
    return boundary.bind(lib)


def _everything(lib: ctypes.CDLL, monkeypatch) -> list[pd.DataFrame]:
    """Every table of rich batches (invalid tokens, tails, turns, top-8 uint8 and top-3 int16
    routing, every log-prob dtype, both layouts, two workers) with ``lib`` as the extension."""
    monkeypatch.setattr(native, "_load", lambda: (lib, ""))
    frames = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for routing, ids in (((4, 8), np.uint8), ((3, 3), np.int16)):
            case = make_case(5, num_sequences=80, dtype=dtype, tail_fraction=5e-3, bad_fraction=0.01,
                             routing=routing, id_dtype=ids)
            for layout in ("offsets", "seq_ids"):
                stats = compute_stats(case.batch(layout), NATIVE, workers=2)
                frames += [stats[name] for name in stats.tables]
    monkeypatch.undo()
    return frames


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (CI installs it)")
def test_clang_and_portable_builds_give_bit_identical_statistics(tmp_path, monkeypatch):
    # clang (as on macOS), and the build without per-ISA clones or GCC's vector shuffle that
    # arm64 compiles, against the installed GCC build: the same bits in every table
    want = _everything(native.library(), monkeypatch)
    builds = {"clang": {"CC": "clang", "LDSHARED": "clang -shared"},
              "gcc-portable": {"CFLAGS": "-DMM_PORTABLE"},
              "clang-portable": {"CC": "clang", "LDSHARED": "clang -shared", "CFLAGS": "-DMM_PORTABLE"}}
    for name, env in builds.items():
        got = _everything(_build(tmp_path, name, env), monkeypatch)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            pd.testing.assert_frame_equal(g, w, check_exact=True, obj=name)
