"""Skips that fail in CI: with ``MISMATCH_MONITOR_FAIL_ON_SKIP=1`` (set by ``.ci/run``) every skip,
module skip and xfail fails, through the project's own ``conftest.py``; without it they stay skips.
And the tests that drive an external tool skip with a one-line reason where it is absent.

Each check runs a real pytest in a subprocess. Runtime: about 20 s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skips_fail import ENV

TESTS = Path(__file__).resolve().parent
TINY = '''
import pytest

def test_passes():
    assert True

def test_skips_inside():
    pytest.skip("the engine is absent")

@pytest.mark.skipif(True, reason="the browser is absent")
def test_skipped_by_mark():
    pass

@pytest.mark.xfail(reason="known to fail")
def test_expected_to_fail():
    assert False
'''
TINY_MODULE_SKIP = '''
import pytest

pytest.importorskip("no_such_engine_module")

def test_never_collected():
    pass
'''


def pytest_run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != ENV}
    base.update(PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", *args],
                          cwd=cwd, env=base, capture_output=True, text=True, timeout=600)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")    # the project's own wiring
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "test_tiny_module.py").write_text(TINY_MODULE_SKIP)
    return tmp_path


def test_skips_stay_skips_by_default(tiny: Path) -> None:
    result = pytest_run([], tiny)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"1 passed, 3 skipped, 1 xfailed", result.stdout), result.stdout


def test_every_skip_fails_in_ci(tiny: Path) -> None:
    result = pytest_run(["test_tiny.py"], tiny, **{ENV: "1"})
    out = result.stdout
    assert result.returncode == 1, out + result.stderr          # pytest's "tests failed"
    assert re.search(r"2 failed, 1 passed, 1 error in", out), out   # a skip at setup is an error
    for reason in ("the engine is absent", "the browser is absent", "known to fail"):
        assert reason in out, reason


def test_a_skipped_module_fails_in_ci(tiny: Path) -> None:
    """A module skipped at import (``importorskip`` of an engine) is a collection error: pytest
    stops with its "interrupted" status, naming the module and the reason; with the options
    ``.ci/run`` passes, the other modules still run and the status is "tests failed"."""
    result = pytest_run(["test_tiny_module.py"], tiny, **{ENV: "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "ERROR test_tiny_module.py" in result.stdout and "no_such_engine_module" in result.stdout
    ci_args = re.search(r'make test PYTEST_ARGS="([^"]*)"', (TESTS.parent / ".ci" / "run").read_text())
    assert ci_args, ".ci/run no longer runs make test with PYTEST_ARGS"
    (tiny / "test_tiny_ok.py").write_text("def test_ok():\n    pass\n")
    result = pytest_run([*ci_args.group(1).split(), "test_tiny_module.py", "test_tiny_ok.py"], tiny, **{ENV: "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"1 passed, 1 error in", result.stdout), result.stdout


def test_tools_absent_means_skipped_with_a_reason(tmp_path: Path) -> None:
    """With nothing on PATH, the tests that drive Prometheus, Alertmanager, promtool, amtool and
    Chromium skip (one line each, naming the tool), and everything else in those modules passes."""
    modules = ["test_prometheus_live.py", "test_prometheus_alertmanager.py", "test_alert_rules_files.py",
               "test_alert_agreement.py", "test_dashboard_browser.py"]
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "MISMATCH_MONITOR_CHROMIUM": ""}
    result = pytest_run([str(TESTS / m) for m in modules], TESTS.parent, **env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for tool in ("prometheus", "alertmanager", "promtool", "amtool", "chromium"):
        assert any(f"{tool} not found" in line for line in skipped), (tool, out)
    assert re.search(r"\b(\d+) passed, (\d+) skipped", out), out
    ci = pytest_run([str(TESTS / "test_prometheus_live.py")], TESTS.parent, **env, **{ENV: "1"})
    assert ci.returncode == 1 and "prometheus not found" in ci.stdout, ci.stdout
