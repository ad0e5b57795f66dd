"""Runs the dashboard tests open, built with the real collector, store and alert evaluator; and
the rules that decide which runs the dashboard may open (only those under its runs root).

The other ``test_app_*`` modules and the browser test import :func:`dashboard_root` from here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.app.runs import RunOutsideRoot, list_runs, resolve_run, run_name, runs_root_from
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.store import RunNotFound
from reference import Case, make_case

POOLS = {"bf16": {"hardware": "h100", "precision": "bf16", "engine": "vllm-0.8"},
         "fp8": {"hardware": "h100", "precision": "fp8", "engine": "vllm-0.8"},
         "int4": {"hardware": "tpu-v5e", "precision": "int4", "engine": "jetstream"}}
FLEET_STEPS = 24
UPGRADE_STEPS = 12
BAD_STEPS = range(8, 18)   # steps at which the fp8 pool's bulk mismatch grows 1.5x per step


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    path: Path
    cases: dict[int, Case]                 # step -> the tokens logged at that step
    events: tuple[dict, ...] = ()          # alert events the evaluator emitted, as rows


def fleet_case(step: int, seed: int, fp8_growth: float) -> Case:
    """One step of a three-pool fleet; fp8's bulk |log ρ| grows by ``fp8_growth`` per bad step."""
    case = make_case(1000 * seed + step, num_sequences=30, max_len=200, base_scale=2e-3)
    lr = case.trainer - case.sampler
    pool_of_token = np.asarray(case.labels["pool"], dtype=object)[case.seq]
    scale = fp8_growth ** (step - BAD_STEPS.start + 1) if step in BAD_STEPS else 1.0
    bulk = (pool_of_token == "fp8") & (np.abs(lr) < 0.5)
    lr = np.where(bulk, lr * scale, lr)
    return dataclasses.replace(case, trainer=case.sampler + lr)


def build_run(path: Path, *, steps: int, seed: int, fp8_growth: float, close: bool = True) -> BuiltRun:
    torch.set_num_threads(1)
    events: list[dict] = []
    cases: dict[int, Case] = {}
    collector = MismatchCollector(path, pools=POOLS, flush_every_steps=6, strict=True,
                                  alert_evaluator=AlertEvaluator())
    collector.on_alert(lambda e: events.append(e.to_row()))
    for step in range(steps):
        cases[step] = fleet_case(step, seed, fp8_growth)
        collector.log_step(step, cases[step].batch())
    if close:
        collector.close()
    else:
        collector.flush()
    return BuiltRun(path, cases, tuple(events))


def write_empty_runs(root: Path) -> dict[str, Path]:
    """'empty': run.json only; 'no-observation': steps with no valid token; 'half-written': data
    files of a flush with no steps index, and stray temporary files; 'half-written-tail': one
    committed flush followed by the orphan data files of a flush cut short."""
    out = {name: root / name for name in ("empty", "no-observation", "half-written", "half-written-tail")}
    MismatchCollector(out["empty"], pools=POOLS).close()
    with MismatchCollector(out["no-observation"], pools=POOLS, strict=True) as mc:
        for step in range(3):
            empty = torch.zeros(2, 4, dtype=torch.float64)
            mc.log_step(step, TokenBatch.from_padded(empty, empty, torch.zeros(2, 4, dtype=torch.bool),
                                                     labels={"pool": ["bf16", "fp8"]}))
    donor = build_run(root / "_donor", steps=4, seed=7, fp8_growth=1.0)
    shutil.copytree(donor.path, out["half-written"])
    shutil.rmtree(out["half-written"] / "steps")
    (out["half-written"] / "tokens" / ".part-00000000000000000001.parquet.123.tmp").write_bytes(b"PAR1 half")
    (out["half-written"] / ".run.json.123.tmp").write_text("{")
    first = build_run(out["half-written-tail"], steps=6, seed=8, fp8_growth=1.0, close=False)
    later = build_run(root / "_later", steps=9, seed=8, fp8_growth=1.0)
    steps_files = {p.name for p in (first.path / "steps").glob("*.parquet")}
    for table_dir in later.path.iterdir():
        if table_dir.is_dir() and table_dir.name != "steps":
            for f in table_dir.glob("*.parquet"):
                if f.name not in steps_files:
                    shutil.copy(f, first.path / table_dir.name / f.name)
    (first.path / "steps" / ".part-99.parquet.1.tmp").write_bytes(b"")
    shutil.rmtree(root / "_donor")
    shutil.rmtree(root / "_later")
    return out


@dataclasses.dataclass(frozen=True)
class DashboardRoot:
    root: Path
    fleet: BuiltRun          # growing fp8 tails from step 8, back to normal at 18; alerts fire and resolve
    upgrade: BuiltRun        # the same fleet "after an engine upgrade": no growth
    empties: dict[str, Path]
    live: MismatchCollector  # an open run (status live) that tests keep logging to


@lru_cache(maxsize=None)
def dashboard_root(base: str) -> DashboardRoot:
    """A runs root under ``base`` with every kind of run the dashboard must open (built once)."""
    root = Path(base) / "runs"
    root.mkdir(parents=True, exist_ok=True)
    fleet = build_run(root / "fleet", steps=FLEET_STEPS, seed=1, fp8_growth=1.5)
    upgrade = build_run(root / "fleet-upgrade", steps=UPGRADE_STEPS, seed=2, fp8_growth=1.0)
    empties = write_empty_runs(root)
    live = MismatchCollector(root / "live", pools=POOLS, flush_every_steps=1000, flush_every_seconds=1e9,
                             strict=True)   # flushed by the tests, when they choose
    for step in range(3):
        live.log_step(step, fleet_case(step, 3, 1.0).batch())
    live.flush()
    return DashboardRoot(root, fleet, upgrade, empties, live)


# --------------------------------------------------------------------------- the runs-root rules


def _run(path: Path) -> Path:
    MismatchCollector(path, pools=POOLS).close()
    return path


def test_runs_under_the_root_resolve_by_name_or_relative_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a, nested = _run(root / "a"), _run(root / "team" / "b")
    assert list_runs(root) == {"a": a.resolve()}
    assert resolve_run(root, "a") == a.resolve()
    assert resolve_run(root, "team/b") == nested.resolve()
    assert resolve_run(root, str(nested)) == nested.resolve()
    assert run_name(root, nested) == os.path.join("team", "b")


@pytest.mark.parametrize("requested", ["..", "../outside", "/etc", "a/../../outside", "link"])
def test_a_path_outside_the_root_is_refused_with_a_clear_message(tmp_path: Path, requested: str) -> None:
    root = tmp_path / "root"
    _run(root / "a")
    _run(tmp_path / "outside")
    (root / "link").symlink_to(tmp_path / "outside")    # a link out of the root is outside too
    with pytest.raises(RunOutsideRoot, match="outside the runs root"):
        resolve_run(root, requested)


def test_a_directory_that_is_not_a_run_is_not_found(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "plain").mkdir(parents=True)
    with pytest.raises(RunNotFound, match="not a run"):
        resolve_run(root, "plain")


def test_runs_root_comes_from_the_script_arguments_then_the_environment(tmp_path: Path) -> None:
    assert runs_root_from(["--runs-root", str(tmp_path)], {}) == tmp_path.resolve()
    assert runs_root_from(["--other", "x"], {"MISMATCH_MONITOR_RUNS_ROOT": str(tmp_path)}) == tmp_path.resolve()
    assert runs_root_from(["--runs-root", str(tmp_path / "a")],
                          {"MISMATCH_MONITOR_RUNS_ROOT": str(tmp_path)}) == (tmp_path / "a").resolve()
