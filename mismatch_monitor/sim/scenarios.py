"""Named runs: the fleets the demo and ``sample_data/`` are made of.

Every pool runs on the host CPU; ``hardware`` is the label of the kind of machine whose number
format the pool reproduces (``sim-h100`` runs FP8 weights, ``sim-l4`` INT4, ...), prefixed with
``sim-`` so that nobody mistakes it for a measurement on that hardware.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Literal, Mapping

from .config import SimConfig
from .policy import PolicyShape, Variant
from .pools import FaultKind, FaultSpec, PoolSpec

ScenarioName = Literal["stable_fleet", "fault_midrun", "collapse_no_correction"]


def mixed_fleet() -> tuple[PoolSpec, ...]:
    """Five pools, nine prompts per step: bf16, FP8, a small INT4 pool, an async pool two
    updates behind, and a top-p pool that ships its kept sets."""
    return (
        PoolSpec("bf16", precision="bf16", prompts=3, hardware="sim-a100"),
        PoolSpec("fp8", precision="fp8_e4m3", prompts=2, hardware="sim-h100"),
        PoolSpec("int4", precision="int4", prompts=1, hardware="sim-l4"),
        PoolSpec("async", precision="bf16", lag=2, prompts=2, hardware="sim-a100"),
        PoolSpec("topp", precision="bf16", top_p=0.9, ship_kept_set=True, prompts=1, hardware="sim-tpu-v5e"),
    )


def stable_fleet(*, steps: int = 200, variant: Variant = "dense", seed: int = 0) -> SimConfig:
    """The mixed fleet, healthy, trained with token TIS."""
    return SimConfig(seed=seed, pools=mixed_fleet(), policy=PolicyShape(variant=variant), correction="tis")


# which pool of the mixed fleet each fault hits
_FAULT_POOL: dict[str, str] = {"stop_sync": "async", "ignore_temperature": "fp8", "degrade_precision": "bf16"}


def fault_midrun(*, steps: int = 200, variant: Variant = "dense", seed: int = 0,
                 fault: FaultKind = "stop_sync") -> SimConfig:
    """The stable fleet; at ``steps // 2`` one pool develops ``fault``.

    ``stop_sync`` hits the async pool (its staleness climbs until a resync, then climbs again),
    ``ignore_temperature`` the FP8 pool (a signed drift), ``degrade_precision`` the bf16 pool
    (its weights fall to INT3).
    """
    start = steps // 2
    spec = FaultSpec(fault, start, "int3" if fault == "degrade_precision" else None)
    pools = tuple(replace(p, faults=(spec,)) if p.name == _FAULT_POOL[fault] else p for p in mixed_fleet())
    return replace(stable_fleet(steps=steps, variant=variant, seed=seed), pools=pools)


def collapse_no_correction(*, steps: int = 200, variant: Variant = "dense", seed: int = 0) -> SimConfig:
    """No correction, three quarters of the rollouts from an FP8 pool whose precision degrades
    step by step (INT4 at 1/4 of the run, INT3 at 1/2, INT2 at 3/4), a bf16 pool beside it."""
    ladder = tuple(FaultSpec("degrade_precision", (steps * k) // 4, fmt)
                   for k, fmt in ((1, "int4"), (2, "int3"), (3, "int2")))
    pools = (
        PoolSpec("bf16", precision="bf16", prompts=2, hardware="sim-a100"),
        PoolSpec("fp8", precision="fp8_e4m3", prompts=6, hardware="sim-h100", faults=ladder),
    )
    return SimConfig(seed=seed, pools=pools, policy=PolicyShape(variant=variant), correction="none")


SCENARIOS: Mapping[str, Callable[..., SimConfig]] = MappingProxyType({
    "stable_fleet": stable_fleet,
    "fault_midrun": fault_midrun,
    "collapse_no_correction": collapse_no_correction,
})


def scenario(name: str, *, steps: int = 200, variant: Variant = "dense", seed: int = 0, **options: object) -> SimConfig:
    """The :class:`SimConfig` of scenario ``name`` for a run of ``steps`` steps."""
    if name not in SCENARIOS:
        raise ValueError(f"expected a scenario in {sorted(SCENARIOS)}, got {name!r}")
    return SCENARIOS[name](steps=steps, variant=variant, seed=seed, **options)
