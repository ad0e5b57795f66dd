"""Shared test settings: single-threaded torch (small ops are faster on one thread, and the
machine is shared) and a bounded hypothesis profile."""

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile(
    "mismatch", max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("mismatch")
