"""The programs outside Python that some tests drive, and the mark that skips a test where one is
absent, with a one-line reason. ``.ci/run`` installs them all and turns every skip into a failure
(see ``skips_fail``), so a skip here never hides a test in CI.

Programs are found on PATH; Chromium's path may also come from ``MISMATCH_MONITOR_CHROMIUM``.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_ENV = "MISMATCH_MONITOR_CHROMIUM"
# tool -> (names to look for on PATH, what provides it)
TOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "promtool": (("promtool",), "Debian's prometheus package"),
    "prometheus": (("prometheus",), "Debian's prometheus package"),
    "amtool": (("amtool",), "Debian's prometheus-alertmanager package"),
    "alertmanager": (("prometheus-alertmanager", "alertmanager"), "Debian's prometheus-alertmanager package"),
    "chromium": (("chromium", "chromium-browser"), f"Debian's chromium package, or set {CHROMIUM_ENV}"),
}


def find(tool: str) -> str | None:
    """The path of ``tool``, or None where it is absent. An explicit ``MISMATCH_MONITOR_CHROMIUM``
    is taken as it is: a wrong path then fails the test instead of skipping it."""
    if tool == "chromium" and os.environ.get(CHROMIUM_ENV):
        return os.environ[CHROMIUM_ENV]
    names, _ = TOOLS[tool]
    return next((path for path in map(shutil.which, names) if path), None)


def needs(*tools: str) -> pytest.MarkDecorator:
    """``@needs("promtool")``: skip, saying what is missing and where it comes from."""
    missing = [t for t in tools if find(t) is None]
    reason = "; ".join(f"{t} not found ({' or '.join(TOOLS[t][0])} on PATH; install {TOOLS[t][1]})"
                       for t in missing)
    return pytest.mark.skipif(bool(missing), reason=reason or "all tools found")
