"""Expected-level bands as data: the packaged file, its validation, the lookup by a pool's
precision and engine, and the measured rows against the run they were measured from."""

from __future__ import annotations

import csv
import dataclasses
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mismatch_monitor import expected_levels as el
from mismatch_monitor import query
from mismatch_monitor.expected_levels import ExpectedLevel, expected_for_pool, expected_level, times_expected
from mismatch_monitor.measure_levels import main as measure_main
from mismatch_monitor.store.runinfo import read_run_info

ROOT = Path(__file__).resolve().parents[1]
HEADER = "metric,precision,engine,healthy,source\n"


def test_the_packaged_levels_cover_each_shipped_metric_and_name_their_source():
    assert el.LEVELS, "expected_levels.csv has no rows"
    assert {x.metric for x in el.LEVELS} <= set(el.LEVEL_METRICS)
    assert {"mismatch/k3_kl", "mismatch/abs_log_ratio/p99"} <= {x.metric for x in el.LEVELS}
    for x in el.LEVELS:
        assert x.healthy > 0 and math.isfinite(x.healthy), x
        assert x.source.startswith("measured: python -m mismatch_monitor.measure_levels ") or "http" in x.source, x


@pytest.mark.parametrize("row,message", [
    ("mismatch/k9,bf16,vllm,0.1,cited", "line 2: unknown metric 'mismatch/k9'"),
    ("mismatch/k3_kl,bf16,vllm,0,cited", "line 2: expected a finite healthy level > 0"),
    ("mismatch/k3_kl,bf16,vllm,nan,cited", "line 2: expected a finite healthy level > 0"),
    ("mismatch/k3_kl,bf16,vllm,lots,cited", "line 2: expected a number for healthy, got 'lots'"),
    ("mismatch/k3_kl,bf16,vllm,0.1,", "line 2: expected a source"),
    ("mismatch/k3_kl,,vllm,0.1,cited", "line 2: expected a precision and an engine"),
    ("mismatch/k3_kl,bf16,vllm,0.1", "line 2: expected 5 fields, got 4"),
])
def test_a_bad_row_is_an_error_naming_it(row, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        el.parse_levels([HEADER, row + "\n"], "levels.csv")


def test_a_duplicate_row_and_a_wrong_header_are_refused():
    with pytest.raises(ValueError, match=r"line 3: .*has a row already \(line 2\)"):
        el.parse_levels([HEADER, "mismatch/k3_kl,bf16,vllm,0.1,a\n", "mismatch/k3_kl,BFloat16,vLLM 0.11,0.2,b\n"])
    with pytest.raises(ValueError, match="expected the header metric,precision,engine,healthy,source"):
        el.parse_levels(["metric,precision,healthy,source\n"])


def test_the_shipped_file_is_checked_when_the_module_is_imported(tmp_path):
    """A broken packaged file fails the import with the row named (a copy of the package)."""
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "mismatch_monitor", pkg / "mismatch_monitor",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with open(pkg / "mismatch_monitor" / el.DATA_FILE, "a", encoding="utf-8") as fh:
        fh.write("mismatch/k3_kl,int2,vllm,-1,made up\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import mismatch_monitor.expected_levels as e; "
            "assert e.__file__.startswith(sys.argv[1]), e.__file__")
    done = subprocess.run([sys.executable, "-c", code, str(pkg)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    n_lines = len((pkg / "mismatch_monitor" / el.DATA_FILE).read_text(encoding="utf-8").splitlines())
    assert f"expected_levels.csv line {n_lines}: expected a finite healthy level > 0, got '-1'" in done.stderr


def test_lookup_normalises_names_and_never_guesses():
    levels = el.parse_levels([HEADER, "mismatch/k3_kl,bf16,vllm,0.001,a\n", "mismatch/k3_kl,fp8_e4m3,vllm,0.004,b\n",
                              "mismatch/k3_kl,int4,transformers,0.03,c\n"])
    by_key = {(x.metric, x.precision, x.engine): x for x in levels}
    original = el._BY_KEY
    el._BY_KEY = by_key
    try:
        assert expected_level("mismatch/k3_kl", "BFloat16", "vLLM 0.11").healthy == 0.001
        assert expected_level("mismatch/k3_kl", "bf16", "vllm/top_p0.9").healthy == 0.001
        assert expected_level("mismatch/k3_kl", "fp8", "vllm").healthy == 0.004       # its one variant
        assert expected_level("mismatch/k3_kl", "fp8_e5m2", "vllm") is None            # another variant
        assert expected_level("mismatch/k3_kl", "bf16", "sglang") is None
        assert expected_level("mismatch/k3_kl", None, "vllm") is None
        assert expected_level("mismatch/k3_kl", "bf16", None) is None
        assert expected_level("mismatch/abs_log_ratio/p99", "bf16", "vllm") is None
        assert expected_for_pool("mismatch/k3_kl", {"precision": "int4", "engine": "transformers/sdpa",
                                                    "hardware": "L4"}).healthy == 0.03
        assert expected_for_pool("mismatch/k3_kl", {"hardware": "L4"}) is None
        assert expected_for_pool("mismatch/k3_kl", None) is None
    finally:
        el._BY_KEY = original


def test_times_expected():
    level = ExpectedLevel("mismatch/k3_kl", "bf16", "vllm", 0.002, "x")
    assert times_expected(0.01, level) == pytest.approx(5.0)
    assert times_expected(0.0, level) == 0.0
    assert times_expected(None, level) is None
    assert times_expected(float("nan"), level) is None
    assert times_expected(0.01, None) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        level.healthy = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("run", ["vllm_fleet", "stable_fleet"])
def test_measured_rows_are_what_their_command_reads_from_the_run(run, capsys):
    """Every measured row re-measured with the command in its source gives the shipped number
    (to its 4 printed digits), and each sample pool of that precision and engine finds it."""
    rows = [x for x in el.LEVELS if f"sample_data/{run} " in x.source]
    assert rows, f"no row measured from sample_data/{run}"
    command = rows[0].source.split("python -m mismatch_monitor.measure_levels ", 1)[1].split(" (", 1)[0]
    args = command.split()
    args[0] = str(ROOT / args[0])
    assert measure_main(args) == 0
    printed = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    fresh = {(r["metric"], el.normalise_precision(r["precision"]), el.normalise_engine(r["engine"])): float(r["healthy"])
             for r in printed}
    for x in rows:
        assert fresh[(x.metric, x.precision, x.engine)] == pytest.approx(x.healthy, rel=1e-12), x
    # independently of the command: the pool's merged k3 over the same steps, read with the query layer
    info = read_run_info(ROOT / "sample_data" / run)
    steps = (int(args[args.index("--steps") + 1]), int(args[args.index("--steps") + 2])) if "--steps" in args else None
    pools = args[args.index("--pools") + 1].split(",")
    merged = query.metric_series(query.connect(), ROOT / "sample_data" / run, ["pool"], metrics=["mismatch/k3_kl"],
                                 steps=steps, per_step=False).set_index("pool")["mismatch/k3_kl"]
    for pool in pools:
        level = expected_for_pool("mismatch/k3_kl", info["pools"][pool])
        assert level is not None, pool
        assert merged[pool] == pytest.approx(level.healthy, rel=1e-3)
        assert times_expected(merged[pool], level) == pytest.approx(1.0, rel=1e-3)


def test_the_wheel_carries_the_levels(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("building the wheel compiles the engine's loops: no gcc here")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("mismatch_monitor-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert f"mismatch_monitor/{el.DATA_FILE}" in zf.namelist()
