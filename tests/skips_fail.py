"""Where ``MISMATCH_MONITOR_FAIL_ON_SKIP=1`` (``.ci/run`` sets it), every skipped test, skipped
module and expected failure (xfail) is reported as a failure with its reason: CI installs every
external tool and engine, so a skip there means a test that did not run. Wired in by
``conftest.py``, so it covers every test, present and future, without a mark.
"""

from __future__ import annotations

import os
from typing import Any, Generator

import pytest

ENV = "MISMATCH_MONITOR_FAIL_ON_SKIP"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _reason(report: Any) -> str:
    if hasattr(report, "wasxfail"):
        return f"expected failure (xfail): {report.wasxfail or 'no reason given'}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:   # (path, line, "Skipped: why")
        return str(longrepr[2])
    return str(longrepr)


def _fail_if_skipped(report: Any) -> None:
    if enabled() and report.skipped:
        reason = _reason(report)
        report.outcome = "failed"
        report.longrepr = f"{reason}\n[{ENV}=1: a skip is a failure here, as in .ci/run]"
        if hasattr(report, "wasxfail"):
            del report.wasxfail


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    _fail_if_skipped(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_if_skipped(outcome.get_result())
