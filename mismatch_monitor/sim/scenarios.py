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
from .evaluation import Evaluation
from .objective import Objective
from .policy import PolicyShape, Variant
from .pools import FaultKind, FaultSpec, PoolSpec
from .task import StringTask

ScenarioName = Literal["stable_fleet", "fault_midrun", "collapse_no_correction", "vllm_fleet", "collapse_head"]
# the four runs of collapse_head: the fault (a quantised LM head) with no correction, with TIS,
# the same run without the fault, and the fault's fix (a sampler in the trainer's precision)
CollapseArm = Literal["fault_none", "fault_tis", "no_fault", "matched"]
COLLAPSE_ARMS: tuple[str, ...] = ("no_fault", "fault_none", "fault_tis", "matched")
# vLLM's CPU attention needs head_dim >= 32; int4 groups need every linear input divisible by 32
VLLM_POLICY = {"head_dim": 32}
# a shared "system prompt" filling vLLM's first 32-token KV block (with BOS), so the prefix cache
# has something to reuse across steps, as a real fleet's shared instructions do
VLLM_PREAMBLE = "abcdefgh" * 3 + "hgfedcb"


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
_FAULT_POOL: dict[str, str] = {"stop_sync": "async", "ignore_temperature": "fp8", "degrade_precision": "bf16",
                               "wrong_weights": "bf16", "sync_no_reset": "bf16"}


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


def collapse_head(*, steps: int = 300, variant: Variant = "dense", seed: int = 0, arm: CollapseArm = "fault_none",
                  head: str = "int2", epochs: int = 8, ratio: str = "sequence", prompts: int = 8,
                  learning_rate: float = 3e-4, alphabet: str = "abcdefghijklmnopqrst", min_length: int = 6,
                  max_length: int = 16, turns: int = 1, eval_prompts: int = 32, eval_every: int = 10) -> SimConfig:
    """One bf16 sampler pool whose LM head runs in ``head`` (the fault), trained by PPO with
    ``epochs`` epochs per batch and ``ratio``-level ratios; ``arm`` picks the run:

    * ``fault_none``: the engine's log-probs as the old policy, no correction (the shortcut);
    * ``fault_tis``: the trainer's fp32 recompute as the old policy, truncated IS on pi_old / mu;
    * ``no_fault``: as ``fault_none`` with the pool's head in bf16 like the rest of it;
    * ``matched``: as ``fault_none`` with the pool in fp32, the trainer's precision.

    Longer answers over a larger alphabet than the other scenarios; the fixed-prompt fp32
    evaluation reward every ``eval_every`` steps.
    """
    if arm not in COLLAPSE_ARMS:
        raise ValueError(f"expected arm in {COLLAPSE_ARMS}, got {arm!r}")
    precision, lm_head = {"matched": ("fp32", "same"), "no_fault": ("bf16", "same")}.get(arm, ("bf16", head))
    pool = PoolSpec("sampler", precision=precision, lm_head=lm_head, prompts=prompts,  # type: ignore[arg-type]
                    hardware="sim-a100")
    tis = arm == "fault_tis"
    return SimConfig(seed=seed, pools=(pool,), policy=PolicyShape(variant=variant), alphabet=alphabet,
                     task=StringTask(min_length=min_length, max_length=max_length, turns=turns),
                     learning_rate=learning_rate, correction="tis" if tis else "none",
                     objective=Objective(kind="ppo", epochs=epochs, ratio=ratio,  # type: ignore[arg-type]
                                         old_logprobs="trainer" if tis else "sampler"),
                     evaluation=Evaluation(prompts=eval_prompts, every=eval_every))


def vllm_pools(*, kv_fp8: bool = False) -> tuple[PoolSpec, ...]:
    """Real in-process vLLM engines on the host CPU, one format each (``hardware="cpu"``: these
    numbers are measured, not reproduced): an fp32 control, fp16, bf16, online FP8 (W8A8), a bf16
    top-p pool, and with ``kv_fp8`` a bf16 pool with an FP8 KV cache (AVX-512 or AMX only). No int8
    pool: it syncs by restarting its engine (seconds a step). No int4 pool: where the CPU has no W4A16
    kernel (AVX2) it would serve its int4 grid dequantized in a bf16 engine, whose sync is untested."""
    def pool(name: str, precision: str, prompts: int, **extra: object) -> PoolSpec:
        return PoolSpec(name, precision=precision, prompts=prompts, backend="vllm", engine="vllm",
                        hardware="cpu", **extra)  # type: ignore[arg-type]

    pools = (pool("fp32", "fp32", 1), pool("fp16", "fp16", 1), pool("bf16", "bf16", 2),
             pool("fp8", "fp8_e4m3", 2), pool("topp", "bf16", 1, top_p=0.9))
    return pools + ((pool("kv-fp8", "bf16", 1, kv_cache_dtype="fp8_e4m3"),) if kv_fp8 else ())


def vllm_fleet(*, steps: int = 200, variant: Variant = "dense", seed: int = 0,
               fault: FaultKind = "stop_sync", kv_fp8: bool = False) -> SimConfig:
    """The vLLM pools, trained with token TIS; at ``steps // 2`` the bf16 pool develops ``fault``
    (``stop_sync``: its syncs are skipped; ``sync_no_reset``: weights reload without the
    prefix-cache reset; ``wrong_weights``: it is sent the warm-start weights)."""
    if variant != "dense":
        raise ValueError(f"expected variant 'dense' for vllm_fleet (its FP8 pool is not checked on MoE "
                         f"experts; fp32 and bf16 vLLM pools serve a MoE policy with its routing), got {variant!r}")
    spec = FaultSpec(fault, steps // 2)
    pools = tuple(replace(p, faults=(spec,)) if p.name == "bf16" else p for p in vllm_pools(kv_fp8=kv_fp8))
    return SimConfig(seed=seed, pools=pools, policy=PolicyShape(variant=variant, **VLLM_POLICY),
                     task=StringTask(preamble=VLLM_PREAMBLE), correction="tis")


SCENARIOS: Mapping[str, Callable[..., SimConfig]] = MappingProxyType({
    "stable_fleet": stable_fleet,
    "fault_midrun": fault_midrun,
    "collapse_no_correction": collapse_no_correction,
    "vllm_fleet": vllm_fleet,
    "collapse_head": collapse_head,
})


def scenario(name: str, *, steps: int = 200, variant: Variant = "dense", seed: int = 0, **options: object) -> SimConfig:
    """The :class:`SimConfig` of scenario ``name`` for a run of ``steps`` steps."""
    if name not in SCENARIOS:
        raise ValueError(f"expected a scenario in {sorted(SCENARIOS)}, got {name!r}")
    return SCENARIOS[name](steps=steps, variant=variant, seed=seed, **options)
