"""Sampler log-probs from OpenAI-compatible servers (vLLM, SGLang, llama.cpp share the format).

A ``/v1/completions`` or ``/v1/chat/completions`` response with log-probs becomes the sampler
side of a batch: the sampled tokens' ids and log mu, aligned to the tokens the trainer scores.

    responses = parse_response(body)                      # the JSON body, already decoded
    aligned = align_to_trainer(responses, trainer_ids, pools=["srv"] * n, turns=[0] * n)
    aligned.sampler_logprobs[i]      # [T_i] log mu at each trainer token (NaN where ids differ)
    aligned.agreement[("srv", 0)]    # TokenAgreement: tokens compared, tokens agreeing, ...

Token-id agreement is the share of trainer response tokens whose id equals the id the sampler
sent at the same position. Anything below 1 means the trainer is not scoring what was sampled
(a response retokenized from its text, a dropped or merged token): a data bug, not numerics, so
every disagreement is logged at CRITICAL with its pool, turn, sequence and first position, and
those tokens get a NaN sampler log-prob (the collector counts them as non-finite input instead
of reading a ratio of two different tokens). A response without token ids (servers that send
only token strings) cannot be checked and is counted as ``n_unverified``.

``log_agreement(collector, step, aligned.agreement)`` keeps the agreement in the run: outcome rows
per pool and turn, and a counted ``TokenIdMismatch`` error with its text for every cell that
disagrees or cannot be checked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from .collectors import MismatchCollector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledResponse:
    """One choice of a response: ``token_ids`` None when the server sent none."""

    token_ids: tuple[int, ...] | None
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    prompt_token_ids: tuple[int, ...] | None = None


def _completion_choice(choice: Mapping[str, Any], prompt_ids: Any) -> SampledResponse:
    lp = choice.get("logprobs") or {}
    values = lp.get("token_logprobs")
    if values is None:
        raise ValueError("expected choices[].logprobs.token_logprobs in a completion (request logprobs)")
    return SampledResponse(_ids(choice.get("token_ids")), tuple(lp.get("tokens") or ()),
                           tuple(float(v) for v in values), _ids(choice.get("prompt_token_ids", prompt_ids)))


def _chat_choice(choice: Mapping[str, Any], prompt_ids: Any) -> SampledResponse:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise ValueError("expected choices[].logprobs.content in a chat completion (request logprobs=true)")
    return SampledResponse(_ids(choice.get("token_ids")), tuple(c["token"] for c in content),
                           tuple(float(c["logprob"]) for c in content), _ids(prompt_ids))


def _ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def parse_response(body: Mapping[str, Any]) -> list[SampledResponse]:
    """Every choice of a decoded completion / chat-completion body, in ``index`` order."""
    kind = body.get("object")
    if kind not in ("text_completion", "chat.completion"):
        raise ValueError(f"expected object 'text_completion' or 'chat.completion', got {kind!r}")
    parse = _completion_choice if kind == "text_completion" else _chat_choice
    choices = sorted(body.get("choices") or (), key=lambda c: c.get("index", 0))
    out = [parse(c, body.get("prompt_token_ids")) for c in choices]
    for r in out:
        if r.token_ids is not None and len(r.token_ids) != len(r.logprobs):
            raise ValueError(f"expected one log-prob per token id, got {len(r.logprobs)} for {len(r.token_ids)}")
    return out


@dataclass
class TokenAgreement:
    """Mergeable counts of one (pool, turn) cell."""

    n_tokens: int = 0              # trainer response tokens compared
    n_agree: int = 0
    n_sequences: int = 0
    n_sequences_differing: int = 0
    n_unverified: int = 0          # sequences whose server sent no token ids
    first_differences: list[int] = field(default_factory=list)   # per differing sequence

    @property
    def agreement(self) -> float | None:
        """Share of agreeing tokens; None for an empty cell (no observation, not 0)."""
        return self.n_agree / self.n_tokens if self.n_tokens else None

    def merge(self, other: "TokenAgreement") -> "TokenAgreement":
        return TokenAgreement(self.n_tokens + other.n_tokens, self.n_agree + other.n_agree,
                              self.n_sequences + other.n_sequences,
                              self.n_sequences_differing + other.n_sequences_differing,
                              self.n_unverified + other.n_unverified,
                              self.first_differences + other.first_differences)


@dataclass(frozen=True)
class Aligned:
    sampler_logprobs: list[torch.Tensor]          # [T_i] float32 per sequence, trainer positions
    agreement: dict[tuple[str, int], TokenAgreement]


def align_to_trainer(responses: Sequence[SampledResponse], trainer_ids: Sequence[Sequence[int]], *,
                     pools: Sequence[str], turns: Sequence[int]) -> Aligned:
    """Sampler log-probs at the trainer's response tokens, and token-id agreement per (pool, turn)."""
    if not (len(responses) == len(trainer_ids) == len(pools) == len(turns)):
        raise ValueError(f"expected one trainer sequence, pool and turn per response, got {len(responses)} "
                         f"responses, {len(trainer_ids)} sequences, {len(pools)} pools, {len(turns)} turns")
    out: list[torch.Tensor] = []
    cells: dict[tuple[str, int], TokenAgreement] = {}
    for i, (resp, ids, pool, turn) in enumerate(zip(responses, trainer_ids, pools, turns)):
        ids = list(ids)
        cell = cells.setdefault((pool, int(turn)), TokenAgreement())
        cell.n_sequences += 1
        lp = torch.full((len(ids),), math.nan, dtype=torch.float32)
        if resp.token_ids is None:
            cell.n_unverified += 1
            log.critical("pool %s turn %d sequence %d: the server sent no token ids; the trainer's tokens "
                         "cannot be checked against what was sampled", pool, turn, i)
            out.append(lp)
            continue
        sampled = torch.tensor(resp.token_ids, dtype=torch.int64)
        n = min(len(ids), len(sampled))
        same = torch.zeros(len(ids), dtype=torch.bool)
        same[:n] = torch.tensor(ids[:n], dtype=torch.int64) == sampled[:n]
        lp[same] = torch.tensor(resp.logprobs, dtype=torch.float32)[:n][same[:n]]
        agree = int(same.sum())
        cell.n_tokens += len(ids)
        cell.n_agree += agree
        if agree < len(ids) or len(sampled) != len(ids):
            first = int((~same).nonzero()[0]) if agree < len(ids) else n
            cell.n_sequences_differing += 1
            cell.first_differences.append(first)
            log.critical("pool %s turn %d sequence %d: trainer tokens differ from the sampled token ids from "
                         "position %d (%d of %d agree; %d sampled): retokenized or misaligned response",
                         pool, turn, i, first, agree, len(ids), len(sampled))
        out.append(lp)
    return Aligned(out, cells)


def _by_pool(cells: Mapping[tuple[str, int], TokenAgreement]) -> dict[str, TokenAgreement]:
    """Each pool's cell over its turns: sums of counts, never a mean of shares."""
    by_pool: dict[str, TokenAgreement] = {}
    for (pool, _), cell in sorted(cells.items()):
        by_pool[pool] = by_pool.get(pool, TokenAgreement()).merge(cell)
    return by_pool


def agreement_report(cells: Mapping[tuple[str, int], TokenAgreement]) -> dict[str, float | None]:
    """Flat keys per pool and turn: ``mismatch/pool=<p>/turn=<t>/token_id_agreement`` and the
    pool's total over its turns."""
    report: dict[str, float | None] = {}
    for (pool, turn), cell in sorted(cells.items()):
        report[f"mismatch/pool={pool}/turn={turn}/token_id_agreement"] = cell.agreement
    for pool, cell in _by_pool(cells).items():
        report[f"mismatch/pool={pool}/token_id_agreement"] = cell.agreement
        report[f"mismatch/pool={pool}/sequences_with_token_id_difference"] = float(cell.n_sequences_differing)
    return report


class TokenIdMismatch(ValueError):
    """The trainer scores other tokens than the server sampled, or cannot check them."""


def _findings(pool: str, turn: int, cell: TokenAgreement) -> list[TokenIdMismatch]:
    out = []
    if cell.n_sequences_differing:
        out.append(TokenIdMismatch(
            f"pool {pool} turn {turn}: {cell.n_sequences_differing} of {cell.n_sequences} sequences differ from "
            f"the sampled token ids (first differing positions {cell.first_differences[:8]}); {cell.n_agree} of "
            f"{cell.n_tokens} trainer tokens agree: a retokenized or misaligned response"))
    if cell.n_unverified:
        out.append(TokenIdMismatch(
            f"pool {pool} turn {turn}: {cell.n_unverified} of {cell.n_sequences} sequences came without token "
            "ids: the trainer's tokens cannot be checked against what was sampled"))
    return out


def log_agreement(collector: "MismatchCollector", step: int, cells: Mapping[tuple[str, int], TokenAgreement]) -> None:
    """Keep a step's token-id agreement in the collector's run (call it before that step's
    ``log_step``, so the step's error count includes what it finds).

    * ``outcomes`` rows of ``step`` per pool: ``token_id_agreement`` (the pool's share over its
      turns), ``token_id_agreement/turn=<t>`` per turn, and the counts a share over several steps
      is merged from (``token_ids_compared``, ``token_ids_agreeing``) with
      ``sequences_with_token_id_difference`` and ``sequences_without_token_ids``. An empty cell
      has no share (null, not 0): its share row is left out, its counts are kept.
    * each cell with a differing or unverifiable sequence: a counted :class:`TokenIdMismatch`
      (``collector.log_error``), its text in the run's ``errors`` table (a critical finding,
      shown by ``summary`` and the Overview; ``strict=True`` raises it).
    """
    for pool, total in _by_pool(cells).items():
        values: dict[str, float] = {"token_ids_compared": float(total.n_tokens),
                                    "token_ids_agreeing": float(total.n_agree),
                                    "sequences_with_token_id_difference": float(total.n_sequences_differing),
                                    "sequences_without_token_ids": float(total.n_unverified)}
        if total.agreement is not None:
            values["token_id_agreement"] = total.agreement
        for (cell_pool, turn), cell in sorted(cells.items()):
            if cell_pool == pool and cell.agreement is not None:
                values[f"token_id_agreement/turn={turn}"] = cell.agreement
        collector.log_outcomes(step, values, pool=pool)
    for (pool, turn), cell in sorted(cells.items()):
        for finding in _findings(pool, turn, cell):
            collector.log_error(finding, step=step, where=f"step {step}: token-id agreement")
