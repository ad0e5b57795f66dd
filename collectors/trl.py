"""TRL: per-token trainer and sampler log-probs of ``GRPOTrainer``, logged through the collector.

TRL's callbacks only ever see averaged scalars, so the per-token log-probs are captured by
wrapping the trainer's generation and scoring step (targets TRL 1.x with transformers 5):

* **sampler** (mu): with vLLM, TRL already keeps the engine's log-probs. Without it, TRL 1.x
  generation returns none, so ``_generate_single_turn`` generates with one more logits processor
  that reads the log-probability of each sampled token under the distribution it was sampled
  from. It must run after everything that shapes that distribution: transformers puts a caller's
  processors *before* its own warpers (temperature, top-k, top-p, min-p), so the capture is
  appended to the list ``_get_logits_processor`` builds, after the warpers. Continuous batching
  (``use_transformers_continuous_batching``) returns no log-probs and is refused at attach time. TRL pads and shuffles them with the
  rest of the batch; the mixin then moves them to its own key so that TRL's loss never sees them
  (with ``off_policy_mask_threshold`` TRL would otherwise use them): loss values do not change.
* **trainer** (pi): what ``_get_per_token_logps_and_entropies`` returns inside ``_compute_loss``,
  or ``old_per_token_logps`` when TRL computed those (at the sampler's weights).
* **one step per optimizer step**: micro-batches are gathered by a :class:`StepHook` and logged
  at ``on_step_end`` under TRL's ``global_step``, the step TRL logs its own scalars under. The
  collector's report is added to TRL's next log line (wandb, TensorBoard, ...).

    trainer = MismatchGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                  train_dataset=..., mismatch_collector=MismatchCollector("runs/x"))

Staleness is exact: each sequence carries the ``global_step`` it was generated at; the trainer
version is the step at which its trainer log-probs were computed.

Several processes (``torchrun``, ``accelerate launch``): the collector's default ``reducer="auto"``
reduces every step to rank 0, which alone writes the run; the trainer resolves it once the
process group is up, and every rank logs every step (an empty share when it has none).
Supported TRL versions: ``trl_compat.py``; checked when the trainer is built.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TrainerCallback
from trl import GRPOTrainer

import trl
from mismatch_monitor.batch import TokenBatch
from .adapters.common import sequence_mean, turn_index
from .aliases import aliases_for
from .step_hook import StepHook, StepSink
from .trl_compat import check_generation, check_trl
from .trl_outcomes import TrainingOutcomes, record_weight_sync

SAMPLER_KEY = "mismatch_sampler_logps"       # [B, T] sampler log-probs, carried with the batch
VERSION_KEY = "mismatch_policy_version"      # [B] global_step at which each sequence was generated


class SampledTokenLogProbs(LogitsProcessor):
    """Appended last to ``generate``'s processors: log mu of every sampled token.

    At call t it still holds the scores of call t-1, whose sampled token is now the last column
    of ``input_ids``; only one [B, V] score tensor is ever held.
    """

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._held is not None:
            self._take(input_ids[:, -1])
        self._held = (scores, torch.logsumexp(scores.float(), dim=-1))
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        scores, lse = self._held
        self._values.append(scores.gather(1, tokens[:, None])[:, 0].float() - lse)
        self._held = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of the T generated tokens, given generate's output ``sequences``."""
        if self._held is not None:
            self._take(sequences[:, -1])
        return torch.stack(self._values, dim=1) if self._values else sequences.new_zeros((len(sequences), 0), dtype=torch.float32)


@contextmanager
def capturing_generate(model: Any, capture: SampledTokenLogProbs) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, ``model.generate`` also runs ``capture``, last of all its logits
    processors (after the warpers); yields {"sequences": ...}."""
    original, build = model.generate, model._get_logits_processor
    out: dict[str, torch.Tensor] = {}

    def processors(*args: Any, **kwargs: Any) -> LogitsProcessorList:
        # the list generate samples from: the caller's processors, then temperature, top-k,
        # top-p, min-p ...; the capture reads the distribution after all of them
        return LogitsProcessorList([*build(*args, **kwargs), capture])

    def generate(*args: Any, **kwargs: Any) -> torch.Tensor:
        out["sequences"] = original(*args, **kwargs)
        return out["sequences"]

    # instance attributes shadow the class methods for this one call
    model.generate, model._get_logits_processor = generate, processors
    try:
        yield out
    finally:
        del model.generate, model._get_logits_processor


def trl_batch_fields(inputs: Mapping[str, Any], trainer_logps: torch.Tensor, *,
                     labels: Mapping[str, str], trainer_version: int) -> dict[str, Any]:
    """``TokenBatch.from_padded`` fields of one TRL micro-batch (``inputs`` of ``_compute_loss``)."""
    mask = inputs["completion_mask"].bool()
    tool_mask = inputs.get("tool_mask")
    if tool_mask is not None:
        mask = mask & tool_mask.bool()
    old = inputs.get("old_per_token_logps")
    policy_version = inputs[VERSION_KEY]
    if old is not None:          # scored at generation time, with the sampler's weights
        trainer_logps, trainer_version = old, int(policy_version.max())
    advantages = inputs["advantages"]
    B = mask.shape[0]
    return dict(
        trainer_logprobs=trainer_logps.detach(), sampler_logprobs=inputs[SAMPLER_KEY], response_mask=mask,
        labels={dim: [value] * B for dim, value in labels.items()},
        turn_index=turn_index(mask) if tool_mask is not None else None,
        policy_version=policy_version, trainer_version=trainer_version,
        advantages=advantages if advantages.dim() == 1 else sequence_mean(advantages, mask),
        token_ids=inputs["completion_ids"])


class _EndOfStep(TrainerCallback):
    def __init__(self, trainer: "MismatchCaptureMixin") -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # HF calls this after the optimizer step: global_step is already advanced
        self.trainer._mismatch_end_step(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        flush = getattr(self.trainer.mismatch_hook.collector, "flush", None)
        if flush is not None:
            flush()


class MismatchCaptureMixin:
    """Mix into ``GRPOTrainer`` (or a subclass of it) to log per-token mismatch every step.

    Args (keyword, on top of the trainer's own):
        mismatch_collector: a ``MismatchCollector`` (or anything with ``log_step``).
        mismatch_labels: labels for every sequence; defaults to the sampler TRL uses
            (``pool``/``engine``: ``vllm`` or ``transformers``) and ``precision`` from the args.
        mismatch_log_reports: add each step's report to TRL's logs (default True).
        mismatch_log_outcomes: store TRL's loss, reward, grad_norm and entropy of each log line
            in the run's ``outcomes`` and its weight pushes to vLLM in ``events``
            (``trl_outcomes.py``; default True).
    """

    def __init__(self, *args: Any, mismatch_collector: StepSink,
                 mismatch_labels: Mapping[str, str] | None = None,
                 mismatch_log_reports: bool = True, mismatch_log_outcomes: bool = True, **kwargs: Any) -> None:
        mro = type(self).__mro__                   # what the wrapped methods call: the class after us
        check_trl(trl.__version__, mro[mro.index(MismatchCaptureMixin) + 1])
        super().__init__(*args, **kwargs)
        check_generation(self.args, use_vllm=self.use_vllm)
        # the process group is up now (accelerate starts it with the arguments): several ranks
        # reduce to rank 0, which alone writes the run
        resolve = getattr(mismatch_collector, "resolve_reducer", None)
        if resolve is not None:
            resolve()
        engine = "vllm" if self.use_vllm else "transformers"
        precision = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"
        self.mismatch_labels = {"pool": engine, "engine": engine, "precision": precision,
                                **dict(mismatch_labels or {})}
        self.mismatch_hook = StepHook(mismatch_collector)
        self.mismatch_log_reports = mismatch_log_reports
        self.mismatch_report: dict[str, float] = {}
        self._mm_capture: list[torch.Tensor] | None = None
        self._mm_injected = False
        self.add_callback(_EndOfStep(self))
        self._mm_outcomes = mismatch_log_outcomes
        if mismatch_log_outcomes and hasattr(mismatch_collector, "log_outcomes"):
            self.add_callback(TrainingOutcomes(mismatch_collector))

    # -------------------------------------------------------------- sampler side
    def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: dict,
                              num_generations: int, has_tool_images: bool = False) -> tuple[list, list | None]:
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        capture = SampledTokenLogProbs()
        with capturing_generate(self.accelerator.unwrap_model(self.model_wrapped), capture) as out:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if logprobs is None and "sequences" in out:
            values = capture.finish(out["sequences"]).cpu()
            logprobs = [values[i, :len(ids)].tolist() for i, ids in enumerate(completion_ids)]
            self._mm_injected = True
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._mm_injected = False
        loaded = getattr(self, "_last_loaded_step", None)
        output = super()._generate_and_score_completions(inputs)
        if self.use_vllm and self._mm_outcomes:      # TRL pushed its weights to vLLM meanwhile?
            record_weight_sync(self.mismatch_hook.collector, self, loaded, self.mismatch_labels.get("pool"))
        sampler = output.pop("sampling_per_token_logps") if self._mm_injected else output.get("sampling_per_token_logps")
        if sampler is not None:
            output[SAMPLER_KEY] = sampler
            output[VERSION_KEY] = torch.full((len(sampler),), self.state.global_step, dtype=torch.int64,
                                             device=sampler.device)
        return output

    # -------------------------------------------------------------- trainer side
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._mm_capture is not None:
            self._mm_capture.append(result[0].detach())
        return result

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self._mm_capture = []
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            captured, self._mm_capture = self._mm_capture, None
        if self.model.training and captured and SAMPLER_KEY in inputs:
            self.mismatch_hook.add(**trl_batch_fields(inputs, captured[0], labels=self.mismatch_labels,
                                                      trainer_version=self.state.global_step))
        return loss

    # -------------------------------------------------------------- steps and logs
    def _mismatch_end_step(self, step: int) -> None:
        if self.mismatch_hook.pending:
            self.mismatch_report = self.mismatch_hook.end_step(step)
        elif getattr(self.mismatch_hook.collector, "reducer", None) is not None:
            # the reduction is a collective: a rank with nothing this step still joins it
            empty = torch.zeros(0, dtype=torch.float32)
            self.mismatch_report = self.mismatch_hook.collector.log_step(
                step, TokenBatch.from_flat(empty, empty, seq_offsets=[0]))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.mismatch_log_reports and self.model.training and self.mismatch_report:
            logs = {**logs, **self.mismatch_report}
            self.mismatch_report = {}
        super().log(logs, start_time)


class MismatchGRPOTrainer(MismatchCaptureMixin, GRPOTrainer):
    """``GRPOTrainer`` that logs per-token trainer/sampler mismatch through a collector."""


class TRLMismatchScalars(TrainerCallback):
    """Forwards TRL's own logged mismatch scalars (vLLM importance-sampling correction).

    ``sink(step, values)`` receives ``{"trl/<key>": value}`` for the TRL keys of the alias map
    (``sampling/sampling_logp_difference/mean`` ...; ``eval_`` ones too), whenever TRL logs them.
    TRL computes them only with ``use_vllm=True`` and ``vllm_importance_sampling_correction``;
    see ``aliases.py`` for how each relates to ours.
    """

    def __init__(self, sink: Callable[[int, dict[str, float]], None]) -> None:
        self.sink = sink
        self.keys = tuple(a.peer_key for a in aliases_for("TRL")) + (
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")
        self.logs_seen = 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        self.logs_seen += 1
        found = {f"trl/{prefix}{key}": float(logs[prefix + key])
                 for key in self.keys for prefix in ("", "eval_")
                 if logs and logs.get(prefix + key) is not None}
        if found:
            self.sink(state.global_step, found)
