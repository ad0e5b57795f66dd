"""A sampler pool served by a real in-process vLLM engine (``PoolSpec(backend="vllm")``).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the multi-process engine
takes minutes to start on a small CPU), eager, with a small KV cache. It is started from a model
directory written from the trainer's weights in the pool's format (see ``vllm_checkpoint``) and
synced after that the way RL frameworks sync vLLM: ``collective_rpc("reload_weights",
weights_iterator=...)`` followed by ``reset_prefix_cache()``. A sync can skip the reset (a real
fleet fault: prompts whose prefix is cached keep the old weights' KV).

Log-probs are vLLM's ``processed_logprobs`` of each sampled token: after temperature, top-k and
top-p, renormalised over the kept set (what TRL's colocate mode uses); a pool with
``logprobs_mode="raw_logprobs"`` reports vLLM's default instead, the temperature-1 log-probs
of whatever it sampled (the misconfiguration ``MismatchSharperTrainer`` catches). With a MoE policy each
token also carries the experts the engine's routers chose for the position that produced it
(``vllm_routing``; the pool then generates one request at a time). vllm is imported only in
this module, on the first engine.

An int8 pool's checkpoint is smoothed first when ``vllm_smoothquant.ALPHA`` is set (off by
default; ``engine_info["smoothing"]`` records which). An int4 pool whose engine
has no W4A16 kernel on this CPU (the probe token fails on the missing op) runs the same int4
grid dequantized in a bf16 engine, and its ``engine_info`` says so (``INT4_FALLBACK``).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers import PretrainedConfig

from .pools import PoolSpec
from .sampler import Rollout
from .task import Episode
from .tokenizer import CharTokenizer
from .vllm_checkpoint import ENGINE_FORMAT, checkpoint_weights, write_model_dir
from . import vllm_smoothquant
from .vllm_routing import RouterCapture

KV_CACHE_BYTES = 64 << 20
# vLLM caches prompt prefixes in whole KV blocks; the CPU default (128 tokens) is longer than any
# toy prompt, which would leave the prefix cache (and the fault of not resetting it) unused; the
# CPU attention takes multiples of 32
BLOCK_SIZE = 32
# reload_weights of a compressed-tensors W8A8 int8 checkpoint gives NaN log-probs on vLLM 0.32's
# CPU path, or (after other engines ran in the process) finite log-probs that differ from a fresh
# engine's on the same weights, which no probe for NaN sees (both measured; the first load is
# fine), so an int8 pool syncs by starting a fresh engine
RESTART_ON_SYNC = frozenset({"int8"})
# what an int4 pool records when the engine has no W4A16 kernel here and runs the int4 grid in bf16
INT4_FALLBACK = "int4 weights (W4A16 grid) dequantized to bf16: no W4A16 kernel on this CPU"


def _linear_methods(model: torch.nn.Module) -> dict[str, int]:
    """How many layers use each quantization method: what the engine really applied."""
    return dict(Counter(type(m.quant_method).__name__ for m in model.modules()
                        if getattr(m, "quant_method", None) is not None))


_LIVE: set[int] = set()        # id() of this process's live pool engines


def _shutdown(llm: Any) -> None:
    """Stop one in-process engine. vLLM's ``EngineCore.shutdown`` also tears down the process's
    distributed state (its parallel groups), which every in-process engine uses at each forward:
    while another pool's engine is still live (an int8 pool's restart sync, a probe beside a
    running fleet) that teardown is skipped; the last engine's close does it."""
    from vllm.v1.engine import core

    _LIVE.discard(id(llm))
    if not _LIVE:
        llm.llm_engine.engine_core.shutdown()
        return
    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = cleanup


def _vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"a vLLM pool needs vLLM, which is not importable ({exc}); run make install-vllm") from exc
    return vllm


class VllmPoolSampler:
    """Same interface as :class:`~mismatch_monitor.sim.sampler.PoolSampler`, on a vLLM engine."""

    def __init__(self, spec: PoolSpec, config: PretrainedConfig, tokenizer: CharTokenizer) -> None:
        if spec.backend != "vllm":
            raise ValueError(f"expected a pool with backend='vllm', got {spec.backend!r}")
        self.spec = spec
        self._config = config
        self._tokenizer = tokenizer
        self._llm: Any = None
        self._routes: RouterCapture | None = None      # a MoE policy's routing, read from the routers
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.precision: str | None = None
        self._form = ""                                # the checkpoint form the engine was given
        self.version = -1
        self.held_state: dict[str, torch.Tensor] = {}
        self.engine_info: dict[str, Any] = {}
        self.sync_seconds: list[float] = []
        self.generate_seconds = 0.0
        self.generated_tokens = 0

    # ------------------------------------------------------------------ weights
    def load(self, state: Mapping[str, torch.Tensor], version: int, precision: str, *,
             reset_prefix_cache: bool = True) -> None:
        """Send the trainer's fp32 ``state`` (weights ``version``) to the engine in ``precision``."""
        if self.precision is not None and precision != self.precision:
            raise ValueError(f"a vLLM pool keeps its format: started in {self.precision}, asked for {precision}")
        if self._llm is None:
            self._start(state, precision)
        elif precision in RESTART_ON_SYNC:
            t0 = time.perf_counter()
            self.close()                  # a fresh engine has an empty prefix cache: nothing to reset
            self._start(state, precision)
            self.sync_seconds.append(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            self._llm.collective_rpc("reload_weights",
                                     kwargs={"weights_iterator": checkpoint_weights(state, self._form)})
            if reset_prefix_cache:
                self._llm.reset_prefix_cache()
            if self._routes is not None:
                self._routes.bind(self._llm)
            self.sync_seconds.append(time.perf_counter() - t0)
            self._probe(precision, after="reload_weights")
        self._llm.llm_engine.set_weight_version(str(version))
        self.held_state = dict(state)
        self.version = version

    def _start(self, state: Mapping[str, torch.Tensor], precision: str) -> None:
        smoothing: dict[str, Any] | str = "none"
        if precision == "int8" and vllm_smoothquant.ALPHA is not None:
            state, smoothing = vllm_smoothquant.smoothquant_state(self._config, state, self._tokenizer,
                                                                  vllm_smoothquant.ALPHA)
        self._form, refused = precision, ""
        try:
            seconds = self._launch(state, precision)
        except RuntimeError as exc:
            # the engine took the W4A16 checkpoint but this CPU build has no kernel to run it
            if precision != "int4" or "wna16" not in str(exc.__cause__):
                raise
            self.close()
            self._form, refused = "int4_dequantized", str(exc.__cause__)
            seconds = self._launch(state, precision)
        engine = self._llm.llm_engine.vllm_config
        methods = self._llm.apply_model(_linear_methods)[0]
        quantized = sum(n for name, n in methods.items() if "Linear" in name and not name.startswith("Unquantized"))
        self.precision = precision
        self.engine_info = {
            "engine": "vllm", "version": _vllm().__version__,
            "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "quantization": engine.model_config.quantization or "none", "linear_methods": methods,
            "quantized_layers": quantized, "kv_cache_dtype": engine.cache_config.cache_dtype,
            "prefix_caching": bool(engine.cache_config.enable_prefix_caching),
            "block_size": engine.cache_config.block_size, "logprobs_mode": engine.model_config.logprobs_mode,
            "load_seconds": round(seconds, 3), "checkpoint": self._form, "smoothing": smoothing,
            "sync": "engine restart" if precision in RESTART_ON_SYNC else "reload_weights + reset_prefix_cache",
        }
        if self._form == "int4_dequantized":
            self.engine_info["quantization"] = INT4_FALLBACK
            self.engine_info["engine_refused"] = refused
        elif precision not in ("fp32", "fp16", "bf16") and quantized == 0:
            raise RuntimeError(f"pool {self.spec.name}: vLLM quantized no layer for {precision} "
                               f"(methods {methods}); refusing a pool labelled {precision} that is not")

    def _launch(self, state: Mapping[str, torch.Tensor], precision: str) -> float:
        """Start the engine on ``state`` in checkpoint form ``self._form``; one probe token."""
        vllm = _vllm()
        dtype, online = ENGINE_FORMAT[self._form]
        self._dir = tempfile.TemporaryDirectory(prefix=f"vllm-pool-{self.spec.name}-")
        model_dir = write_model_dir(Path(self._dir.name), self._config, self._tokenizer, state, self._form)
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        self._llm = vllm.LLM(model=str(model_dir), dtype=dtype, quantization=online,
                             kv_cache_dtype=self.spec.kv_cache_dtype, enforce_eager=True,
                             kv_cache_memory_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE,
                             max_model_len=self._config.max_position_embeddings,
                             logprobs_mode=self.spec.logprobs_mode, seed=0, disable_log_stats=True)
        seconds = time.perf_counter() - t0
        _LIVE.add(id(self._llm))
        moe = getattr(self._config, "model_type", None) == "qwen3_moe"
        self._routes = RouterCapture(self._llm, self._config.num_experts_per_tok) if moe else None
        torch.set_num_threads(threads)       # the CPU worker may bind its own thread count
        self._probe(precision)
        return seconds

    def _probe(self, precision: str, after: str = "start") -> None:
        """Every token id and a few sampled tokens through the engine: a format whose CPU kernel
        this build lacks (int4 W4A16 without AVX-512, for one) or weights a sync broke fail here
        with a clear message, not as a step of NaN log-probs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # prompts covering every token id (a broken weight row shows on its own token), each
        # short enough for the context with a few sampled tokens after it, every log-prob read:
        # a single token from BOS once came out finite from weights whose rollouts were NaN
        sampled = 4
        ids = list(range(int(self._config.vocab_size)))
        width = max(1, int(self._config.max_position_embeddings) - 1 - sampled)
        prompts = [[self._tokenizer.bos_id] + ids[i:i + width] for i in range(0, len(ids), width)]
        try:
            outs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                      SamplingParams(max_tokens=sampled, logprobs=0, prompt_logprobs=0,
                                                     detokenize=False, seed=0), use_tqdm=False)
        except Exception as exc:
            raise RuntimeError(f"pool {self.spec.name}: vLLM cannot run {precision} on this CPU "
                               f"({type(exc).__name__}: {exc})") from exc
        values = []
        for prompt, done in zip(prompts, outs):
            values += [lp[t].logprob for lp, t in zip(done.prompt_logprobs[1:], prompt[1:])]
            values += [lp[t].logprob for lp, t in zip(done.outputs[0].logprobs, done.outputs[0].token_ids)]
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"pool {self.spec.name}: {precision} engine gives {len(bad)} non-finite log-prob(s) "
                               f"of {len(values)} probed (e.g. {bad[0]}) after {after}")

    # ------------------------------------------------------------------ sampling
    def rollout(self, episodes: list[Episode], *, temperature: float, max_new_tokens: int,
                seed: int, ignore_temperature: bool = False) -> list[Rollout]:
        """Generate every turn of ``episodes`` (the engine's per-request seeds derive from ``seed``)."""
        if self._llm is None:
            raise RuntimeError("expected load() before rollout()")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tok, spec = self._tokenizer, self.spec
        temp = 1.0 if ignore_temperature else temperature
        contexts = [[tok.bos_id] + tok.encode(ep.prompt()) for ep in episodes]
        parts: list[list[dict[str, torch.Tensor]]] = [[] for _ in episodes]
        answers: list[list[str]] = [[] for _ in episodes]
        versions: set[str] = set()
        for turn in range(len(episodes[0].ops)):
            if turn > 0:
                for i, ep in enumerate(episodes):
                    contexts[i] = contexts[i] + tok.encode(Episode.follow_up(ep.ops[turn]))
            params = [SamplingParams(temperature=temp, top_p=spec.top_p, top_k=spec.top_k,
                                     max_tokens=max_new_tokens, logprobs=0, detokenize=False,
                                     stop_token_ids=[tok.eos_id],
                                     seed=(seed + 7919 * turn + 104729 * i) % (1 << 31))
                      for i in range(len(episodes))]
            t0 = time.perf_counter()
            outs, experts = self._generate([TokensPrompt(prompt_token_ids=c) for c in contexts], params)
            self.generate_seconds += time.perf_counter() - t0
            for i, out in enumerate(outs):
                done = out.outputs[0]
                new_ids = list(done.token_ids)
                n = len(new_ids)
                self.generated_tokens += n
                logprobs = torch.tensor([step[t].logprob for step, t in zip(done.logprobs, new_ids)],
                                        dtype=torch.float32)
                versions.update(span.version for span in (done.weight_versions or ()))
                fill = torch.nan if spec.truncates else 0.0        # the kept mass is not reported
                parts[i].append({"logprobs": logprobs, "kept_logmass": torch.full((n,), fill),
                                 "positions": torch.arange(len(contexts[i]), len(contexts[i]) + n),
                                 "turns": torch.full((n,), turn, dtype=torch.int64)})
                if experts is not None:
                    parts[i][-1]["experts"] = experts[i]
                answers[i].append(tok.decode(new_ids))
                contexts[i] = contexts[i] + new_ids
        if versions and versions != {str(self.version)}:
            raise RuntimeError(f"pool {spec.name}: engine reports weight versions {sorted(versions)}, "
                               f"expected {self.version}")
        return [self._assemble(contexts[i], parts[i], answers[i]) for i in range(len(episodes))]

    def _generate(self, prompts: list[Any], params: list[Any]) -> tuple[list[Any], list[torch.Tensor] | None]:
        """The engine's outputs, and with a MoE policy each request's ``[n, L, K]`` experts: then
        one request at a time, so that every routed row is that request's (``vllm_routing``)."""
        if self._routes is None:
            return self._llm.generate(prompts, params, use_tqdm=False), None
        outs, experts = [], []
        for prompt, param in zip(prompts, params):
            self._routes.clear()
            (out,) = self._llm.generate([prompt], param, use_tqdm=False)
            outs.append(out)
            experts.append(self._routes.produced(len(out.outputs[0].token_ids)))
        return outs, experts

    def _assemble(self, ids: list[int], parts: list[dict[str, torch.Tensor]], answers: list[str]) -> Rollout:
        cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return Rollout(ids=ids, positions=cat["positions"], turns=cat["turns"],
                       sampler_logprobs=cat["logprobs"], experts=cat.get("experts"), kept=None,
                       kept_logmass=cat["kept_logmass"], answers=answers, policy_version=self.version)

    def close(self) -> None:
        """Stop the engine and drop its model directory."""
        if self._llm is not None:
            _shutdown(self._llm)
        self._llm = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
