"""Sampler pools: each one a real numeric path over the trainer's weights, and its faults.

A pool is described by a frozen :class:`PoolSpec`; the runtime object that holds its weights
and generates is :class:`~mismatch_monitor.sim.sampler.PoolSampler`. Faults are silent, as in
a real fleet: a pool's labels (hardware, precision, engine) stay what the spec says while its
numbers change; finding the fault from the numbers is the monitor's job.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from .numerics import PRECISIONS, Dtype, Precision
from .policy import Attention

FaultKind = Literal["ignore_temperature", "stop_sync", "degrade_precision", "sync_no_reset", "wrong_weights"]
FAULT_KINDS: tuple[str, ...] = ("ignore_temperature", "stop_sync", "degrade_precision", "sync_no_reset",
                                "wrong_weights")
Backend = Literal["torch", "vllm"]
# formats a vLLM pool runs in on the CPU (see vllm_checkpoint.ENGINE_FORMAT)
VLLM_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4")
VLLM_FAULTS: tuple[str, ...] = ("ignore_temperature", "stop_sync", "sync_no_reset", "wrong_weights")
LM_HEADS: tuple[str, ...] = ("same", "fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4", "int3", "int2")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class FaultSpec:
    """A fault that switches on at ``start_step`` and stays on.

    Attributes:
        kind: ``ignore_temperature`` (the pool samples at temperature 1 whatever it is asked and
            reports the log-probs of what it sampled from); ``stop_sync`` (the pool stops
            receiving weight updates; a resync reloads it once, after which it is stuck again);
            ``degrade_precision`` (the pool's weights are rounded to ``precision`` from then on);
            ``sync_no_reset`` (vLLM pools: weights are reloaded but the prefix cache is not reset,
            so cached prompt prefixes keep the old weights' KV); ``wrong_weights`` (every sync
            sends the warm-start weights, version 0, while the pool reports the version it was
            meant to get). A resync performs one correct sync in every case.
        start_step: first step the fault is active.
        precision: the format a ``degrade_precision`` fault degrades to.
    """

    kind: FaultKind
    start_step: int
    precision: Precision | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"expected a fault kind in {FAULT_KINDS}, got {self.kind!r}")
        if not (isinstance(self.start_step, int) and self.start_step >= 0):
            raise ValueError(f"expected integer start_step >= 0, got {self.start_step!r}")
        if (self.kind == "degrade_precision") != (self.precision is not None):
            raise ValueError(f"expected precision exactly for degrade_precision, got kind={self.kind!r}, "
                             f"precision={self.precision!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"expected a precision in {PRECISIONS}, got {self.precision!r}")


@dataclass(frozen=True)
class PoolSpec:
    """One sampler pool.

    Attributes:
        name: the ``pool`` label (letters, digits, ``_.-``).
        precision: format of the pool's weights (``numerics.PRECISIONS``).
        lm_head: format of the LM head, ``same`` = the compute dtype of ``precision``; a dtype
            (``fp32``/``fp16``/``bf16``) runs the head in it, a weight format (``fp8_e4m3``,
            ``int8``, ``int4``, ``int3``, ``int2``) rounds the head's weights to it (one scale per row,
            groups of 32 for INT) with bf16 arithmetic: its logit error grows with the logits.
        attention: attention kernel of the pool's engine (``sdpa`` or ``eager``).
        decode_batch: sequences per ``generate`` call (a different batch shape and padding than
            the trainer's); None = the whole pool in one call.
        lag: the pool samples with weights ``lag`` updates old (asynchronous pipeline).
        top_p, top_k: truncated sampling (1.0 / 0 = off).
        ship_kept_set: the pool ships the kept set of every token, and the trainer re-normalises
            over it (top-p replay); without it the trainer scores the full distribution.
        prompts: prompts this pool samples per step (each a group of ``SimConfig.group_size``).
        hardware, engine: metadata labels written to the batch and to ``run.json``.
        faults: faults of this pool.
        backend: ``torch`` (a transformers model copy, ``sampler.PoolSampler``) or ``vllm`` (a
            real in-process vLLM engine, ``vllm_pool.VllmPoolSampler``; precisions
            ``VLLM_PRECISIONS``, the policy's head_dim must be >= 32 for vLLM's CPU attention).
        kv_cache_dtype: vLLM's KV-cache format (``auto`` = the compute dtype; ``fp8_e4m3`` /
            ``fp8_e5m2`` need AVX-512 or AMX on the CPU).
        logprobs_mode: what the vLLM engine reports as a token's log-prob: ``processed_logprobs``
            (of the distribution it sampled, after temperature and truncation) or vLLM's own
            default ``raw_logprobs`` (of the model's temperature-1 distribution, whatever it
            sampled at: a misconfiguration the sharpness metrics catch).
    """

    name: str
    precision: Precision = "bf16"
    lm_head: Literal["same", "fp8_e4m3", "int8", "int4", "int3", "int2"] | Dtype = "same"
    attention: Attention = "sdpa"
    decode_batch: int | None = None
    lag: int = 0
    top_p: float = 1.0
    top_k: int = 0
    ship_kept_set: bool = False
    prompts: int = 2
    hardware: str = "cpu"
    engine: str = "transformers"
    faults: tuple[FaultSpec, ...] = ()
    backend: Backend = "torch"
    kv_cache_dtype: str = "auto"
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))
        if not (isinstance(self.name, str) and _NAME.match(self.name)):
            raise ValueError(f"expected a pool name of letters, digits and _.-, got {self.name!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"expected a precision in {PRECISIONS}, got {self.precision!r}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"expected lm_head in {LM_HEADS}, got {self.lm_head!r}")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"expected attention 'sdpa' or 'eager', got {self.attention!r}")
        if self.decode_batch is not None and not (isinstance(self.decode_batch, int) and self.decode_batch >= 1):
            raise ValueError(f"expected decode_batch None or an integer >= 1, got {self.decode_batch!r}")
        if not (isinstance(self.lag, int) and self.lag >= 0):
            raise ValueError(f"expected integer lag >= 0, got {self.lag!r}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"expected 0 < top_p <= 1, got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"expected integer top_k >= 0, got {self.top_k!r}")
        if self.ship_kept_set and not self.truncates:
            raise ValueError("expected top_p < 1 or top_k > 0 with ship_kept_set, got no truncation")
        if not (isinstance(self.prompts, int) and self.prompts >= 1):
            raise ValueError(f"expected integer prompts >= 1, got {self.prompts!r}")
        for name in ("hardware", "engine"):
            if not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ValueError(f"expected a non-empty {name} label, got {getattr(self, name)!r}")
        for fault in self.faults:
            if not isinstance(fault, FaultSpec):
                raise ValueError(f"expected FaultSpec faults, got {type(fault).__name__}")
        if self.backend not in ("torch", "vllm"):
            raise ValueError(f"expected backend 'torch' or 'vllm', got {self.backend!r}")
        if self.backend == "vllm":
            self._check_vllm()
        elif (self.kv_cache_dtype != "auto" or self.logprobs_mode != "processed_logprobs"
              or any(f.kind == "sync_no_reset" for f in self.faults)):
            raise ValueError(f"pool {self.name}: kv_cache_dtype, logprobs_mode and sync_no_reset need backend='vllm'")

    def _check_vllm(self) -> None:
        if self.precision not in VLLM_PRECISIONS:
            raise ValueError(f"expected a vLLM pool precision in {VLLM_PRECISIONS}, got {self.precision!r}")
        if self.lm_head != "same" or self.decode_batch is not None or self.ship_kept_set:
            raise ValueError(f"pool {self.name}: lm_head, decode_batch and ship_kept_set are torch-pool options")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"expected kv_cache_dtype in ('auto', 'fp8_e4m3', 'fp8_e5m2'), got {self.kv_cache_dtype!r}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"expected logprobs_mode 'processed_logprobs' or 'raw_logprobs', got {self.logprobs_mode!r}")
        if self.precision == "int8" and any(f.kind == "sync_no_reset" for f in self.faults):
            raise ValueError(f"pool {self.name}: an int8 vLLM pool syncs by restarting its engine (a fresh, "
                             "empty prefix cache), so sync_no_reset cannot happen to it")
        bad = [f.kind for f in self.faults if f.kind not in VLLM_FAULTS]
        if bad:
            raise ValueError(f"expected vLLM pool faults in {VLLM_FAULTS}, got {bad}")

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    def _active(self, kind: str, step: int) -> list[FaultSpec]:
        return sorted((f for f in self.faults if f.kind == kind and f.start_step <= step),
                      key=lambda f: f.start_step)

    def precision_at(self, step: int) -> str:
        """The weight format in effect at ``step`` (the latest active degradation wins)."""
        active = self._active("degrade_precision", step)
        return active[-1].precision if active else self.precision  # type: ignore[return-value]

    def ignores_temperature_at(self, step: int) -> bool:
        return bool(self._active("ignore_temperature", step))

    def sync_stopped_at(self, step: int) -> bool:
        return bool(self._active("stop_sync", step))

    def skips_cache_reset_at(self, step: int) -> bool:
        return bool(self._active("sync_no_reset", step))

    def wrong_weights_at(self, step: int) -> bool:
        return bool(self._active("wrong_weights", step))

    @property
    def renormalises_over_trainer_set(self) -> bool:
        """A vLLM truncating pool reports log-probs renormalised over its kept set, which it does
        not ship: the trainer renormalises over its own top-k/top-p set of the token's position."""
        return self.backend == "vllm" and self.truncates

    def precision_label(self) -> str:
        return self.precision if self.lm_head == "same" else f"{self.precision}+{self.lm_head}-head"

    def engine_label(self) -> str:
        parts = [self.engine] + ([self.attention] if self.backend == "torch" else [])
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv-{self.kv_cache_dtype}")
        if self.logprobs_mode != "processed_logprobs":
            parts.append(self.logprobs_mode.replace("_", "-"))
        if self.decode_batch is not None:
            parts.append(f"bs{self.decode_batch}")
        if self.top_p < 1.0:
            parts.append(f"top_p{self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"top_k{self.top_k}")
        if self.ship_kept_set:
            parts.append("kept-set")
        if self.lag:
            parts.append(f"lag{self.lag}")
        return "/".join(parts)

    def metadata(self) -> dict[str, str | int]:
        """``run.json``'s pool metadata: the batch's labels (hardware, precision, engine) and the most
        updates the pool's weights lag by design, ``max_staleness`` (its ``lag``; ``pool_bounds.py``)."""
        return {"hardware": self.hardware, "precision": self.precision_label(), "engine": self.engine_label(),
                "max_staleness": self.lag}
