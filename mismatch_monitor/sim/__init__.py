"""A small RL system whose samplers and trainer genuinely disagree: a producer of batches.

    from mismatch_monitor.sim import Simulation, scenario
    sim = Simulation(scenario("stable_fleet", variant="moe"))
    for step in sim.run(100, progress=True):
        monitor.log_step(step.step, step.batch)

The policy is a toy-sized transformers Qwen3 / Qwen3-MoE, the sampler pools are real numeric
paths (bf16, fp16, FP8 and INT weights, a low-precision LM head, other kernels and batch
shapes, stale weights, truncated sampling) with faults that switch on at a given step, and the
trainer is an fp32 GRPO loop. See docs/SIMULATOR.md.
"""

from .config import SimConfig
from .policy import PolicyShape
from .pools import FaultSpec, PoolSpec
from .scenarios import SCENARIOS, scenario
from .simulation import Simulation, SimStep
from .task import StringTask

__all__ = ["SimConfig", "PolicyShape", "FaultSpec", "PoolSpec", "SCENARIOS", "scenario", "Simulation",
           "SimStep", "StringTask"]
