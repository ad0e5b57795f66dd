"""The simulated RL system: a fleet of sampler pools, an fp32 trainer and a GRPO loop.

    sim = Simulation(SimConfig(pools=(PoolSpec("bf16"), PoolSpec("fp8", precision="fp8_e4m3"))))
    for step in sim.run(100):
        step.batch          # TokenBatch: pool/hardware/precision/engine/env labels, versions, experts
        sim.resync("fp8")   # e.g. from a monitor's resync callback; applied at the next step

Each step: every pool syncs the weights its pipeline would hold (``lag`` updates old, frozen
by a ``stop_sync`` fault, reloaded by :meth:`Simulation.resync`), samples its prompts, the
trainer re-scores every dialogue in fp32, and one GRPO update follows. Pools with
``backend="vllm"`` are real in-process vLLM engines (``vllm_pool``), synced through vLLM's own
weight-reload API; :meth:`Simulation.close` stops them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..batch import TokenBatch
from ..fingerprint import weights_fingerprint
from .batching import Padded, pad_rollouts, token_batch, trainer_token_logprobs
from .config import SimConfig
from .evaluation import Evaluator
from .objective import ppo_update
from .policy import build_model, model_config
from .pools import PoolSpec
from .sampler import PoolSampler, Rollout
from .task import Episode
from .tokenizer import CharTokenizer
from .trainer import Trainer
from .warmstart import warm_start


@dataclass(frozen=True)
class SimStep:
    """What one step produced.

    Attributes:
        step: RL step index (0-based).
        batch: the tokens the trainer consumed, as the monitor receives them.
        reward_mean: mean episode reward over the whole fleet, in [0, 1].
        reward_by_pool: mean episode reward per pool.
        loss, grad_norm: GRPO loss and gradient norm (before clipping) of the update.
        entropy: mean trainer entropy (nats) over the sampled tokens.
        trainer_version: weights version the trainer scored with (= updates taken before).
        seconds: wall time of the step.
        seconds_sampling: the part of it spent syncing pools and generating.
        eval_reward: fixed-prompt fp32 evaluation reward of the weights this step sampled with
            (``SimConfig.evaluation``), None on steps without an evaluation.
    """

    step: int
    batch: TokenBatch
    reward_mean: float
    reward_by_pool: dict[str, float]
    loss: float
    grad_norm: float
    entropy: float
    trainer_version: int
    seconds: float
    seconds_sampling: float
    eval_reward: float | None = None


def _seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (no Python ``hash`` randomisation)."""
    acc = 1469598103934665603
    for p in parts:
        acc = ((acc ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return acc


class Simulation:
    """Runs a :class:`SimConfig`; see the module docstring."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.tokenizer = CharTokenizer(config.alphabet)
        tok = self.tokenizer
        self._model_config = model_config(config.policy, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(config.seed, 0))
            model = build_model(self._model_config)
        self.warmstart_loss = warm_start(
            model, config.task, tok, steps=config.warmstart_steps, batch_size=config.warmstart_batch,
            learning_rate=config.warmstart_learning_rate,
            generator=torch.Generator().manual_seed(_seed(config.seed, 1)))
        self.trainer = Trainer(model, learning_rate=config.learning_rate, grad_clip=config.grad_clip,
                               correction=config.correction, thresholds=config.thresholds)
        depth = 1 + max(p.lag for p in config.pools)
        self._history: deque[tuple[int, dict[str, torch.Tensor]]] = deque([(0, self.trainer.state())], maxlen=depth)
        self._initial_state = self.trainer.state()    # what a wrong_weights fault sends
        self.samplers = {p.name: self._sampler(p) for p in config.pools}
        self.sync_events: list[dict[str, object]] = []
        self._fingerprint_cache: dict[int, tuple[dict[str, torch.Tensor], str]] = {}
        self.probe_engine_info: dict[str, dict[str, object]] = {}
        self._resync: set[str] = set()
        self.evaluator = (Evaluator(config.evaluation, config.task, config.alphabet, self._model_config, tok,
                                    _seed(config.seed, 5)) if config.evaluation.prompts else None)
        for spec in config.pools:     # engines start now, so a run records what they really run
            if spec.backend == "vllm":
                self.samplers[spec.name].load(self._initial_state, 0, spec.precision_at(0))
        self._step = 0

    # ------------------------------------------------------------------ public
    def pool_metadata(self) -> dict[str, dict[str, str | int]]:
        """Pool name -> hardware / precision / engine labels and max_staleness (what ``run.json`` records)."""
        return {p.name: p.metadata() for p in self.config.pools}

    def engine_info(self) -> dict[str, dict[str, object]]:
        """Pool name -> what its engine actually runs (vLLM pools: engine, version, dtype,
        quantization and methods as applied, KV-cache dtype, load time); empty before step 0."""
        return {name: dict(s.engine_info) for name, s in self.samplers.items() if getattr(s, "engine_info", None)}

    def close(self) -> None:
        """Stop the pools' engines (vLLM pools hold one each)."""
        for sampler in self.samplers.values():
            if hasattr(sampler, "close"):
                sampler.close()

    def resync(self, pool: str | None = None) -> None:
        """Push the trainer's current weights to ``pool`` (every pool when None) before the next step."""
        if pool is not None and pool not in self.samplers:
            raise ValueError(f"expected a pool in {sorted(self.samplers)}, got {pool!r}")
        self._resync.update(self.samplers if pool is None else (pool,))

    def run(self, steps: int, *, progress: bool = False) -> Iterator[SimStep]:
        """``steps`` further steps, with a progress bar when ``progress``."""
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, disable=not progress, unit="step", dynamic_ncols=True)
        try:
            for _ in range(steps):
                out = self.next_step()
                bar.set_postfix(reward=f"{out.reward_mean:.3f}", refresh=False)
                bar.update(1)
                yield out
        finally:
            bar.close()

    def next_step(self) -> SimStep:
        """Sync, sample, score and update once."""
        cfg, s, t0 = self.config, self._step, time.perf_counter()
        version = self.trainer.version
        eval_reward = None
        if self.evaluator is not None and cfg.evaluation.due(s):   # the weights this step samples with
            eval_reward = self.evaluator.reward(self._history[-1][1], version, cfg.temperature)
        t0 = time.perf_counter()      # the evaluation is not part of a training step's time
        self._sync(s, version)
        episode_gen = torch.Generator().manual_seed(_seed(cfg.seed, 2, s))
        rollouts, specs, episodes = [], [], []
        for index, spec in enumerate(cfg.pools):
            prompts = cfg.task.sample(spec.prompts, episode_gen, cfg.alphabet)
            group = [ep for ep in prompts for _ in range(cfg.group_size)]
            rollouts += self._rollout(self.samplers[spec.name], group, _seed(cfg.seed, 3, s, index), s)
            specs += [spec] * len(group)
            episodes += group
        sampled = time.perf_counter()
        rewards = torch.tensor([ep.reward(r.answers) for ep, r in zip(episodes, rollouts)], dtype=torch.float64)
        advantages = self._advantages(rewards)
        padded, logp, token_lp, batch = self._score(rollouts, specs, episodes, advantages, version)
        mask = padded.response_mask
        with torch.no_grad():
            entropy = float(-(logp.exp() * logp).sum(-1)[mask].mean())
        # a token whose sampler log-prob is not finite (a broken engine) gets no gradient: one bad
        # pool must not turn the trainer's weights into NaN; the monitor counts those tokens
        train = mask & torch.isfinite(padded.sampler_logprobs)
        if cfg.objective.kind == "ppo":
            pools = {p.name: p for p in specs}

            def rescore() -> torch.Tensor:
                new = self.trainer.score(padded.ids, padded.attention_mask, cfg.temperature)[0]
                return trainer_token_logprobs(new, padded, pools)[0]

            loss, grad_norm = ppo_update(self.trainer, rescore, token_lp, padded.sampler_logprobs,
                                         advantages.to(torch.float32), train, cfg.objective)
        else:
            token_adv = advantages.to(torch.float32).unsqueeze(1).expand_as(mask)[train]
            loss, grad_norm = self.trainer.update(token_lp[train], padded.sampler_logprobs[train], token_adv)
        self._history.append((self.trainer.version, self.trainer.state()))
        self._step += 1
        by_pool = {name: float(rewards[rows].mean()) for name, rows in padded.pool_rows.items()}
        return SimStep(step=s, batch=batch, reward_mean=float(rewards.mean()), reward_by_pool=by_pool,
                       loss=loss, grad_norm=grad_norm, entropy=entropy, trainer_version=version,
                       seconds=time.perf_counter() - t0, seconds_sampling=sampled - t0, eval_reward=eval_reward)

    def probe(self, pools: Sequence[PoolSpec], episodes: Sequence[Episode], *, seed: int = 0) -> TokenBatch:
        """Every pool in ``pools`` answers the same ``episodes``; the trainer scores; no update.

        Each probe pool holds the weights its ``lag`` gives at the current trainer version (as
        far back as the kept history reaches) in its format at the current step. For
        measurements that compare numeric paths on identical prompts. vLLM probe pools start an
        engine each, stopped afterwards; what each ran is left in :attr:`probe_engine_info`.
        """
        states = dict(self._history)
        version = self.trainer.version
        rollouts, specs, all_episodes = [], [], []
        for index, spec in enumerate(pools):
            sampler = self._sampler(spec)
            target = max(version - spec.lag, min(states))
            sampler.load(states[target], target, spec.precision_at(self._step))
            rollouts += self._rollout(sampler, list(episodes), _seed(seed, 4, index), self._step)
            specs += [spec] * len(episodes)
            all_episodes += list(episodes)
            if spec.backend == "vllm":
                self.probe_engine_info[spec.name] = dict(sampler.engine_info)  # type: ignore[attr-defined]
                sampler.close()  # type: ignore[attr-defined]
        with torch.no_grad():
            return self._score(rollouts, specs, all_episodes, None, version)[3]

    # ------------------------------------------------------------------ internals
    def _sampler(self, spec: PoolSpec) -> "PoolSampler":
        if spec.backend == "vllm":
            from .vllm_pool import VllmPoolSampler    # vllm is imported only there

            return VllmPoolSampler(spec, self._model_config, self.tokenizer)  # type: ignore[return-value]
        return PoolSampler(spec, self._model_config, self.tokenizer)

    def _sync(self, step: int, version: int) -> None:
        states = dict(self._history)
        oldest = min(states)
        for spec in self.config.pools:
            sampler = self.samplers[spec.name]
            resync = spec.name in self._resync
            if resync:
                target = version
            elif sampler.version < 0:
                target = max(version - spec.lag, oldest)
            elif spec.sync_stopped_at(step):
                target = sampler.version                              # stuck on what it holds
            else:                                                     # async pipeline, never backwards
                target = max(version - spec.lag, oldest, sampler.version)
            precision = spec.precision_at(step)
            if target != sampler.version or precision != sampler.precision or resync:
                state = states.get(target)
                if state is None:                                     # stuck weights, new format
                    state = sampler.held_state
                kind = "resync" if resync else "sync"
                if not resync and sampler.version >= 0 and spec.wrong_weights_at(step):
                    state, kind = self._initial_state, "sync_wrong_weights"
                options = {}
                if spec.backend == "vllm":
                    reset = resync or sampler.version < 0 or not spec.skips_cache_reset_at(step)
                    options["reset_prefix_cache"] = reset
                    kind += "" if reset else "_no_cache_reset"
                t0 = time.perf_counter()
                sampler.load(state, target, precision, **options)
                self.sync_events.append({"step": step, "pool": spec.name, "version": target, "kind": kind,
                                         "seconds": time.perf_counter() - t0,
                                         **self._fingerprints(state, states.get(target))})
            elif spec.sync_stopped_at(step) and target < version - spec.lag:
                self.sync_events.append({"step": step, "pool": spec.name, "version": target,
                                         "kind": "sync_skipped", "seconds": 0.0})
        self._resync.clear()

    def _fingerprints(self, sent: dict[str, torch.Tensor], meant: dict[str, torch.Tensor] | None
                      ) -> dict[str, str | None]:
        """The fingerprints a sync reports: of the weights the pool was given and of the version's
        (what the trainer meant to send; None where the pool keeps weights no longer held)."""
        trainer = None if meant is None else self._fingerprint_of(meant)
        return {"fingerprint": trainer if sent is meant else self._fingerprint_of(sent),
                "trainer_fingerprint": trainer}

    def _fingerprint_of(self, state: dict[str, torch.Tensor]) -> str:
        key = id(state)
        cached = self._fingerprint_cache.get(key)
        if cached is None or cached[0] is not state:
            cached = (state, weights_fingerprint(state))
            self._fingerprint_cache[key] = cached
            while len(self._fingerprint_cache) > 64:
                self._fingerprint_cache.pop(next(iter(self._fingerprint_cache)))
        return cached[1]

    def _rollout(self, sampler: PoolSampler, episodes: list[Episode], seed: int, step: int) -> list[Rollout]:
        return sampler.rollout(episodes, temperature=self.config.temperature,
                               max_new_tokens=self.config.task.max_answer_tokens() + 2, seed=seed,
                               ignore_temperature=sampler.spec.ignores_temperature_at(step))

    def _score(self, rollouts: list[Rollout], specs: list[PoolSpec], episodes: list[Episode],
               advantages: torch.Tensor | None, version: int
               ) -> tuple[Padded, torch.Tensor, torch.Tensor, TokenBatch]:
        """Pad, re-score in fp32 and build the batch: (padded, logp [B, T, V], log pi [B, T], batch)."""
        padded = pad_rollouts(rollouts, specs, self.tokenizer.vocab_size, self.tokenizer.pad_id)
        logp, trainer_experts = self.trainer.score(padded.ids, padded.attention_mask, self.config.temperature)
        token_lp, support = trainer_token_logprobs(logp, padded, {p.name: p for p in specs})
        batch = token_batch(padded, token_lp, support, trainer_experts, self._labels(specs, episodes),
                            advantages, version, self.config.task.turns > 1)
        return padded, logp, token_lp, batch

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-normalised advantages: (r - group mean) / (group std + 1e-6), groups contiguous."""
        groups = rewards.view(-1, self.config.group_size)
        centred = groups - groups.mean(1, keepdim=True)
        return (centred / (groups.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)

    @staticmethod
    def _labels(specs: list[PoolSpec], episodes: list[Episode]) -> dict[str, list[str]]:
        meta = [spec.metadata() for spec in specs]
        return {"pool": [spec.name for spec in specs],
                **{key: [m[key] for m in meta] for key in ("hardware", "precision", "engine")},
                "env": [ep.env for ep in episodes]}
