"""One sampler pool at run time: its own model copy in its own format, generating dialogues.

The copy is built from the model config in the pool's compute dtype and filled with
``load_state_dict`` from the trainer's fp32 weights (rounded to the pool's format first). It
samples through ``transformers``' ``generate``: left-padded prompts, KV cache, one forward per
token, fp32 softmax over the (processed) logits. The pool reports what a real engine reports:
the log-prob of each sampled token under the distribution it sampled from and, for the MoE
variant, the experts its routers chose for the position that produced the token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from .numerics import COMPUTE_DTYPE, TORCH_DTYPE, cast_lm_head, format_state, quantise_weight
from .policy import RouterTap, build_model
from .pools import PoolSpec
from .task import Episode
from .tokenizer import CharTokenizer


@dataclass(frozen=True)
class Rollout:
    """One sequence's dialogue as the sampler produced it (n = sampled tokens, all turns).

    Attributes:
        ids: every token of the dialogue (prompt, answers, environment turns), no padding.
        positions: ``[n]`` index in ``ids`` of each sampled token.
        turns: ``[n]`` turn of each sampled token.
        sampler_logprobs: ``[n]`` fp32 log mu of each sampled token.
        experts: ``[n, L, K]`` uint8 experts of the position that produced each token, or None.
        kept: ``[n, V]`` bool kept set of each token when the pool ships it, else None.
        kept_logmass: ``[n]`` log of the kept mass (0 without truncation; NaN when not reported).
        answers: decoded answer of each turn.
        policy_version: weights version the pool sampled with.
    """

    ids: list[int]
    positions: torch.Tensor
    turns: torch.Tensor
    sampler_logprobs: torch.Tensor
    experts: torch.Tensor | None
    kept: torch.Tensor | None
    kept_logmass: torch.Tensor
    answers: list[str]
    policy_version: int


class PoolSampler:
    """Holds a pool's weights (a version of the trainer's) and generates with them."""

    def __init__(self, spec: PoolSpec, config: PretrainedConfig, tokenizer: CharTokenizer) -> None:
        self.spec = spec
        self._config = config
        self._tokenizer = tokenizer
        self._model: torch.nn.Module | None = None
        self.precision: str | None = None
        self.version = -1
        self.held_state: dict[str, torch.Tensor] = {}

    def load(self, state: dict[str, torch.Tensor], version: int, precision: str) -> None:
        """Load the trainer's fp32 ``state`` (weights ``version``) rounded to ``precision``."""
        if precision != self.precision or self._model is None:
            config = self._config.__class__.from_dict(self._config.to_dict())
            config._attn_implementation = self.spec.attention
            with torch.random.fork_rng(devices=[]):     # init values are overwritten below
                self._model = build_model(config, COMPUTE_DTYPE[precision])
            if self.spec.lm_head != "same":
                cast_lm_head(self._model, COMPUTE_DTYPE[self.spec.lm_head])
            self.precision = precision
        formatted = format_state(state, precision)
        if self.spec.lm_head not in TORCH_DTYPE and self.spec.lm_head != "same":   # a quantised head
            formatted["lm_head.weight"] = quantise_weight(formatted["lm_head.weight"], self.spec.lm_head)
        self._model.load_state_dict(formatted)
        self.held_state = state      # the fp32 weights this pool was sent (kept for a format change)
        self.version = version

    def rollout(self, episodes: list[Episode], *, temperature: float, max_new_tokens: int,
                seed: int, ignore_temperature: bool = False) -> list[Rollout]:
        """Generate every turn of ``episodes`` (reproducible from ``seed``)."""
        if self._model is None:
            raise RuntimeError("expected load() before rollout()")
        tok = self._tokenizer
        temp = 1.0 if ignore_temperature else temperature
        B = len(episodes)
        contexts = [[tok.bos_id] + tok.encode(ep.prompt()) for ep in episodes]
        parts: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(B)]
        answers: list[list[str]] = [[] for _ in range(B)]
        chunk = self.spec.decode_batch or B
        for turn in range(len(episodes[0].ops)):
            if turn > 0:
                for i, ep in enumerate(episodes):
                    contexts[i] = contexts[i] + tok.encode(Episode.follow_up(ep.ops[turn]))
            for c, start in enumerate(range(0, B, chunk)):
                rows = list(range(start, min(start + chunk, B)))
                out = self._generate([contexts[i] for i in rows], temp, max_new_tokens,
                                     seed=(seed + 7919 * turn + 104729 * c) % (1 << 63))
                for j, i in enumerate(rows):
                    n = out["lengths"][j]
                    new_ids = out["tokens"][j, :n].tolist()
                    piece = {k: v[j, :n] for k, v in out.items() if k not in ("lengths", "tokens")}
                    piece["positions"] = torch.arange(len(contexts[i]), len(contexts[i]) + n)
                    piece["turns"] = torch.full((n,), turn, dtype=torch.int64)
                    parts[i].append(piece)
                    answers[i].append(tok.decode(new_ids))
                    contexts[i] = contexts[i] + new_ids
        return [self._assemble(contexts[i], parts[i], answers[i]) for i in range(B)]

    def _assemble(self, ids: list[int], parts: list[dict[str, torch.Tensor]], answers: list[str]) -> Rollout:
        cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return Rollout(ids=ids, positions=cat["positions"], turns=cat["turns"],
                       sampler_logprobs=cat["logprobs"], experts=cat.get("experts"),
                       kept=cat.get("kept"), kept_logmass=cat["kept_logmass"], answers=answers,
                       policy_version=self.version)

    @torch.no_grad()
    def _generate(self, contexts: list[list[int]], temperature: float, max_new_tokens: int,
                  seed: int) -> dict[str, torch.Tensor]:
        tok, spec = self._tokenizer, self.spec
        b, P = len(contexts), max(len(c) for c in contexts)
        input_ids = torch.full((b, P), tok.pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((b, P), dtype=torch.int64)
        for j, c in enumerate(contexts):                  # left padding, as engines batch prompts
            input_ids[j, P - len(c):] = torch.tensor(c)
            attention_mask[j, P - len(c):] = 1
        tap = RouterTap(self._model)
        with tap, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self._model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                temperature=temperature, top_p=spec.top_p, top_k=spec.top_k,
                max_new_tokens=max_new_tokens, output_scores=True, output_logits=spec.ship_kept_set,
                return_dict_in_generate=True, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
        tokens = out.sequences[:, P:]                                     # [b, t]
        scores = torch.stack(out.scores, 1).float()                       # [b, t, V] processed
        logp = torch.log_softmax(scores, -1)
        result = {"tokens": tokens,
                  "logprobs": logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)}
        is_eos = tokens == tok.eos_id
        ends = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, tokens.shape[1])
        result["lengths"] = ends
        if spec.ship_kept_set:
            kept = torch.isfinite(scores)                                 # [b, t, V]
            full = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1)
            result["kept"] = kept
            result["kept_logmass"] = full.masked_fill(~kept, -torch.inf).logsumexp(-1)
        else:   # nothing truncated: log S = 0; truncated but not reported: unknown
            fill = torch.nan if spec.truncates else 0.0
            result["kept_logmass"] = torch.full_like(result["logprobs"], fill)
        if tap.active:
            result["experts"] = self._experts(tap.calls, b, P, tokens.shape[1])
        return result

    @staticmethod
    def _experts(calls: list[torch.Tensor], b: int, P: int, t: int) -> torch.Tensor:
        """Router calls -> ``[b, t, L, K]``: the experts of the position that produced token s."""
        L, _, K = calls[0].shape
        prefill = calls[0].view(L, b, P, K)[:, :, -1]                      # [L, b, K]
        steps = [prefill] + [c.view(L, b, K) for c in calls[1:t]]         # t forwards
        return torch.stack(steps, 2).permute(1, 2, 0, 3).contiguous()     # [b, t, L, K]
