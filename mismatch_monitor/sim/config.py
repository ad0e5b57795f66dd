"""The simulator's one typed, validated configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import MetricConfig
from .evaluation import Evaluation
from .objective import Objective
from .policy import PolicyShape
from .pools import PoolSpec
from .task import StringTask
from .tokenizer import CharTokenizer
from .trainer import CORRECTIONS, Correction


def _default_pools() -> tuple[PoolSpec, ...]:
    return (PoolSpec("bf16", precision="bf16"),)


@dataclass(frozen=True)
class SimConfig:
    """A whole simulated RL run.

    Attributes:
        seed: everything random (initial weights, prompts, sampling) derives from it; on the CPU
            with one torch thread a run is bitwise reproducible from its config.
        pools: the sampler fleet (unique names); each step every pool samples
            ``pool.prompts`` prompts x ``group_size`` answers.
        policy: shape and variant (dense / MoE) of the toy policy.
        task: the toy task (single- or multi-turn).
        alphabet: letters of the task and the tokenizer.
        group_size: GRPO group: answers per prompt, advantages normalised within it.
        temperature: sampling temperature the trainer scores at (and every healthy pool samples
            at); below 1 so that a pool that ignores it samples from a different distribution.
        learning_rate, grad_clip: AdamW step size and gradient-norm clip of the RL trainer.
        correction: off-policy correction in the loss: ``none``, ``tis`` or ``mis``.
        thresholds: the cap and band the correction uses (shared with the monitor).
        warmstart_steps, warmstart_batch, warmstart_learning_rate: supervised warm start.
        torch_threads: torch intra-op threads set when the simulation starts (None = leave as
            is). One thread is fastest for a model this small and makes runs bitwise repeatable.
        objective: the RL objective (default: one policy-gradient step per batch; or PPO epochs,
            token or sequence ratios, the trainer's or the sampler's log-probs as the old policy).
        evaluation: the fixed-prompt fp32 evaluation reward (default: off).
    """

    seed: int = 0
    pools: tuple[PoolSpec, ...] = field(default_factory=_default_pools)
    policy: PolicyShape = field(default_factory=PolicyShape)
    task: StringTask = field(default_factory=StringTask)
    alphabet: str = "abcdefgh"
    group_size: int = 8
    temperature: float = 0.9
    learning_rate: float = 1e-4
    grad_clip: float = 1.0
    correction: Correction = "tis"
    thresholds: MetricConfig = field(default_factory=MetricConfig)
    warmstart_steps: int = 200
    warmstart_batch: int = 64
    warmstart_learning_rate: float = 5e-3
    torch_threads: int | None = 1
    objective: Objective = field(default_factory=Objective)
    evaluation: Evaluation = field(default_factory=Evaluation)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"expected integer seed >= 0, got {self.seed!r}")
        if not self.pools:
            raise ValueError("expected at least one pool, got none")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"expected unique pool names, got {names}")
        CharTokenizer(self.alphabet).encode(self.task.preamble)  # raises on a bad alphabet or preamble
        if not (isinstance(self.group_size, int) and self.group_size >= 2):
            raise ValueError(f"expected integer group_size >= 2, got {self.group_size!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"expected temperature > 0, got {self.temperature}")
        for name in ("learning_rate", "grad_clip", "warmstart_learning_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"expected {name} > 0, got {value}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"expected correction in {CORRECTIONS}, got {self.correction!r}")
        for name in ("warmstart_steps", "warmstart_batch"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ValueError(f"expected integer {name} >= 0, got {getattr(self, name)!r}")
        if self.torch_threads is not None and not (isinstance(self.torch_threads, int) and self.torch_threads >= 1):
            raise ValueError(f"expected torch_threads None or an integer >= 1, got {self.torch_threads!r}")
        for name, kind in (("objective", Objective), ("evaluation", Evaluation)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"expected an {kind.__name__} {name}, got {type(getattr(self, name)).__name__}")
        if self.objective.old_logprobs == "sampler" and self.correction != "none":
            raise ValueError(f"expected correction 'none' with old_logprobs='sampler' (the ratio pi/mu then "
                             f"carries the whole mismatch; nothing is left to weight), got {self.correction!r}")
        vllm = [p.name for p in self.pools if p.backend == "vllm"]
        if vllm and self.policy.head_dim < 32:
            raise ValueError(f"expected policy.head_dim >= 32 with vLLM pools {vllm} (vLLM's CPU attention), "
                             f"got {self.policy.head_dim}")
        longest = 1 + len(self.task.preamble) + (self.task.max_length + 2) * (1 + self.task.turns) + 3 * self.task.turns
        if longest > self.policy.max_positions:
            raise ValueError(f"expected policy.max_positions >= {longest} for this task, got {self.policy.max_positions}")
