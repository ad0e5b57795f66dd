"""Shared test settings: single-threaded torch (small ops are faster on one thread, and the
machine is shared), a bounded hypothesis profile, and skips that fail where CI asks for it
(``skips_fail``)."""

import pytest
import torch
from hypothesis import HealthCheck, settings

from skips_fail import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

torch.set_num_threads(1)

settings.register_profile(
    "mismatch", max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("mismatch")


@pytest.fixture(params=["native", "torch"])
def each_kernel(request, monkeypatch):
    """Runs a test once with the compiled per-token loops and once with the torch ops, for
    configs left at kernel="auto". The compiled loops must have been built (pip install with a C
    compiler): a missing build fails here rather than passing on the torch ops alone."""
    from mismatch_monitor.engine import native

    if request.param == "native":
        assert native.available(), "the compiled extension mismatch_monitor.engine._native was not built"
    else:
        monkeypatch.setattr(native, "use_native", lambda config, device, num_tokens=0: False)
    return request.param
