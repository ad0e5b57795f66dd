"""An independent float64 reference for the metric engine, and the synthetic inputs it checks.

Written for clarity, not speed, and deliberately *differently* from the engine: tokens are
grouped with pandas and every cell is computed with plain numpy over boolean masks in a Python
loop; bands are tested on rho = exp(lr) (the engine compares lr with log thresholds); k3 uses a
Taylor series for small |lr|; ESS uses normalised weights; histogram bins are found by searching
a table of powers of gamma; routing compares Python sets; quantiles are nearest-rank order
statistics of a sorted array with an exact rational rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from mismatch_monitor.batch import STANDARD_DIMENSIONS, TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine.fields import SEQ_HIST_KINDS, TABLES

# --------------------------------------------------------------------------- synthetic inputs


@dataclass(frozen=True)
class Case:
    """One batch in a plain numpy form (tokens contiguous per sequence, in order)."""

    trainer: np.ndarray                 # [N] float64 (rounded to `dtype` when the batch is built)
    sampler: np.ndarray                 # [N]
    seq: np.ndarray                     # [N] int64, non-decreasing
    num_sequences: int
    labels: dict[str, list[str]] = field(default_factory=dict)
    turn: np.ndarray | None = None      # [N] int64
    policy_version: np.ndarray | None = None  # [B]
    trainer_version: int | None = None
    advantages: np.ndarray | None = None      # [B]
    trainer_experts: np.ndarray | None = None  # [N, L, K]
    sampler_experts: np.ndarray | None = None
    support: np.ndarray | None = None   # [N] bool
    kept: np.ndarray | None = None      # [N] float64
    dtype: torch.dtype = torch.float64

    @property
    def num_tokens(self) -> int:
        return int(self.trainer.shape[0])

    def logprobs(self) -> tuple[np.ndarray, np.ndarray]:
        """Trainer and sampler log-probs exactly as the engine sees them (rounded to dtype)."""
        def rounded(x: np.ndarray) -> np.ndarray:
            return torch.from_numpy(x).to(self.dtype).to(torch.float64).numpy()
        return rounded(self.trainer), rounded(self.sampler)

    def _optional(self) -> dict:
        def t(x, dt=None):
            return None if x is None else torch.from_numpy(np.ascontiguousarray(x)) if dt is None \
                else torch.from_numpy(np.ascontiguousarray(x)).to(dt)
        return dict(turn_index=t(self.turn), trainer_experts=t(self.trainer_experts),
                    sampler_experts=t(self.sampler_experts), in_trainer_support=t(self.support),
                    sampler_kept_logmass=t(self.kept))

    def _common(self) -> dict:
        return dict(labels=self.labels or None, policy_version=self.policy_version,
                    trainer_version=self.trainer_version,
                    advantages=None if self.advantages is None else torch.from_numpy(self.advantages))

    def batch(self, layout: str = "offsets", permutation_seed: int = 0) -> TokenBatch:
        """The same tokens as a TokenBatch: layout 'offsets', 'seq_ids' (shuffled) or 'padded'."""
        t = torch.from_numpy(self.trainer).to(self.dtype)
        s = torch.from_numpy(self.sampler).to(self.dtype)
        opt = self._optional()
        if layout == "offsets":
            lengths = np.bincount(self.seq, minlength=self.num_sequences)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            return TokenBatch.from_flat(t, s, seq_offsets=torch.from_numpy(offsets), **opt, **self._common())
        if layout == "seq_ids":
            perm = torch.from_numpy(np.random.default_rng(permutation_seed).permutation(self.num_tokens))
            opt = {k: None if v is None else v[perm] for k, v in opt.items()}
            return TokenBatch.from_flat(t[perm], s[perm], seq_ids=torch.from_numpy(self.seq)[perm],
                                        num_sequences=self.num_sequences, **opt, **self._common())
        if layout == "padded":
            B = self.num_sequences
            lengths = np.bincount(self.seq, minlength=B)
            T = int(lengths.max()) + 3 if B else 1
            # response tokens at the end of each row, after a random-length prompt
            start = np.random.default_rng(permutation_seed).integers(0, T - lengths + 1)
            pos = np.arange(self.num_tokens) - np.concatenate(([0], np.cumsum(lengths)))[self.seq]
            cols = start[self.seq] + pos
            mask = torch.zeros(B, T, dtype=torch.bool)
            mask[self.seq, cols] = True

            def pad(x: torch.Tensor | None, fill=0) -> torch.Tensor | None:
                if x is None:
                    return None
                out = torch.full((B, T) + tuple(x.shape[1:]), fill, dtype=x.dtype)
                # garbage in the padding: the mask alone must decide
                out[self.seq, cols] = x
                return out
            return TokenBatch.from_padded(pad(t, float("nan")), pad(s, 7.0), mask.to(torch.uint8),
                                          **{k: pad(v) for k, v in opt.items()}, **self._common())
        raise ValueError(f"unknown layout {layout!r}")

    def select_sequences(self, keep: np.ndarray) -> "Case":
        """The sub-batch of the sequences in ``keep`` (sorted ids), renumbered 0..len(keep)-1."""
        keep = np.asarray(keep, dtype=np.int64)
        tok = np.isin(self.seq, keep)
        renum = np.full(self.num_sequences, -1, dtype=np.int64)
        renum[keep] = np.arange(len(keep))

        def per_tok(x):
            return None if x is None else x[tok]

        def per_seq(x):
            return None if x is None else x[keep]
        return replace(
            self, trainer=self.trainer[tok], sampler=self.sampler[tok], seq=renum[self.seq[tok]],
            num_sequences=len(keep), labels={k: [v[i] for i in keep] for k, v in self.labels.items()},
            turn=per_tok(self.turn), policy_version=per_seq(self.policy_version),
            advantages=per_seq(self.advantages), trainer_experts=per_tok(self.trainer_experts),
            sampler_experts=per_tok(self.sampler_experts), support=per_tok(self.support),
            kept=per_tok(self.kept))


def top_k_ids(rng: np.random.Generator, rows: int, num_experts: int, k: int) -> np.ndarray:
    """[rows, k] distinct expert ids per row."""
    return np.argsort(rng.random((rows, num_experts)), axis=1)[:, :k]


def make_case(seed: int, *, num_sequences: int = 40, max_len: int = 300, dtype: torch.dtype = torch.float64,
              tail_fraction: float = 1e-3, base_scale: float = 1e-3, bad_fraction: float = 0.0,
              turns: bool = True, routing: tuple[int, int] | None = (4, 2), num_experts: int = 16,
              id_dtype: type = np.uint8, support: bool = True, kept: bool = True,
              staleness: bool = True, advantages: bool = True, extra_dim: bool = True,
              empty_sequences: int = 1, equal_fraction: float = 0.0) -> Case:
    """Heavy-tailed mismatch: most |lr| ~ base_scale, a `tail_fraction` of tokens with |lr| in [1, 5].

    Sampler log-probs are spread so that every low-probability bucket is populated; lengths are
    log-uniform so that several length buckets occur; ``empty_sequences`` sequences have no token.
    ``equal_fraction`` of the tokens get the sampler's log-prob on both sides (drawn last, so the
    other draws do not change with it).
    """
    rng = np.random.default_rng(seed)
    B = num_sequences
    lengths = np.exp(rng.uniform(0, math.log(max_len), B)).astype(np.int64)
    lengths[rng.choice(B, size=min(empty_sequences, B), replace=False)] = 0
    seq = np.repeat(np.arange(B), lengths)
    N = int(lengths.sum())
    sampler = -rng.exponential(2.0, N)
    lr = rng.normal(0.0, base_scale, N)
    tail = rng.random(N) < tail_fraction
    lr[tail] = rng.uniform(1.0, 5.0, int(tail.sum())) * rng.choice([-1.0, 1.0], int(tail.sum()))
    trainer = sampler + lr
    if bad_fraction:
        bad = np.nonzero(rng.random(N) < bad_fraction)[0]
        kinds = rng.integers(0, 4, bad.size)
        trainer[bad[kinds == 0]] = np.nan
        sampler[bad[kinds == 1]] = -np.inf
        trainer[bad[kinds == 2]] = np.inf
        sampler[bad[kinds == 3]] = 0.5          # a probability above one
    labels = {"pool": list(rng.choice(["bf16", "fp8", "int4"], B)),
              "hardware": list(rng.choice(["h100", "tpu-v5"], B))}
    if extra_dim:
        labels["task"] = list(rng.choice(["math", "code"], B))
    turn = None
    if turns:
        new_turn = rng.random(N) < 0.05
        turn = np.zeros(N, dtype=np.int64)
        for b in range(B):  # fine in a reference: sequences of a small test batch
            sel = seq == b
            turn[sel] = np.cumsum(new_turn[sel])
    te = se = None
    if routing is not None:
        L, K = routing
        te = top_k_ids(rng, N * L, num_experts, K)
        se = te.copy()
        permuted = rng.random(N * L) < 0.3            # same set, other order: not a flip
        se[permuted] = se[permuted][:, ::-1]
        flipped = np.nonzero(rng.random(N * L) < 0.05)[0]
        for r in flipped:                             # one expert replaced by one outside the set
            outside = np.setdiff1d(np.arange(num_experts), te[r])
            se[r, rng.integers(0, K)] = rng.choice(outside)
        te = te.reshape(N, L, K).astype(id_dtype)
        se = se.reshape(N, L, K).astype(id_dtype)
    kept_arr = None
    if kept:
        kept_arr = np.where(rng.random(N) < 0.9, -rng.exponential(0.01, N), np.nan)
    if equal_fraction:
        same = rng.random(N) < equal_fraction
        trainer[same] = sampler[same]
    return Case(
        trainer=trainer, sampler=sampler, seq=seq, num_sequences=B, labels=labels, turn=turn,
        policy_version=rng.integers(0, 8, B) if staleness else None,
        trainer_version=7 if staleness else None,
        advantages=rng.normal(0, 1, B) if advantages else None,
        trainer_experts=te, sampler_experts=se,
        support=(rng.random(N) < 0.97) if support else None,
        kept=kept_arr, dtype=dtype)


# --------------------------------------------------------------------------- building blocks

def lower_edge(values: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """Bucket of each value, named by its lower edge: the largest edge <= value, else 0."""
    table = [0] + list(edges)
    return np.array([max(e for e in table if e <= v) for v in np.asarray(values).tolist()], dtype=np.int64)


def k3_terms(lr: np.ndarray) -> np.ndarray:
    """rho - 1 - lr: Taylor series where |lr| < 1e-2 (no cancellation), exp elsewhere."""
    small = np.abs(lr) < 1e-2
    x = np.where(small, lr, 0.0)
    series = sum(x ** n / math.factorial(n) for n in range(2, 9))
    return np.where(small, series, np.exp(lr) - 1.0 - lr)


class Bins:
    """The log-spaced histogram bins, found by searching a table of powers of gamma."""

    def __init__(self, config: MetricConfig):
        a = config.hist_relative_accuracy
        self.gamma = (1 + a) / (1 - a)
        k = 0
        while self.gamma ** k < config.hist_min:   # smallest k with gamma^k >= hist_min
            k += 1
        while self.gamma ** (k - 1) >= config.hist_min:
            k -= 1
        self.k_min = k
        upper = [self.gamma ** self.k_min]
        while upper[-1] < config.hist_max:
            upper.append(self.gamma ** (self.k_min + len(upper)))
        self.upper = np.array(upper)        # upper edge of bins 1..len(upper)
        self.overflow = len(upper) + 1

    def unsigned(self, v: np.ndarray) -> np.ndarray:
        v = np.abs(np.asarray(v, dtype=np.float64))
        b = 1 + np.searchsorted(self.upper, v, side="left")     # first upper edge >= v
        b = np.where(v > self.upper[-1], self.overflow, b)
        return np.where(v <= self.upper[0] / self.gamma, 0, b).astype(np.int64)

    def signed(self, v: np.ndarray) -> np.ndarray:
        b = self.unsigned(v)
        return np.where(np.asarray(v) < 0, -b, b)

    def read(self, b: int) -> float:
        """Value a bin reads as (the centre that is within alpha of the whole bin)."""
        if b == 0:
            return 0.0
        return 2.0 * self.upper[b - 1] / (self.gamma + 1.0)


def nearest_rank(sorted_values: np.ndarray, q: float) -> float:
    """The k-th smallest value, k = max(1, ceil(q n)), with q taken as the decimal it is written as."""
    n = len(sorted_values)
    k = max(1, math.ceil(Fraction(str(q)) * n))
    return float(sorted_values[k - 1])


def routing_flips(te: np.ndarray, se: np.ndarray) -> np.ndarray:
    """[n, L] bool: whether the expert *sets* differ, by Python sets."""
    n, L, _ = te.shape
    out = np.zeros((n, L), dtype=bool)
    for i in range(n):
        for layer in range(L):
            out[i, layer] = set(te[i, layer].tolist()) != set(se[i, layer].tolist())
    return out


# --------------------------------------------------------------------------- per-token frame

def token_frame(case: Case, config: MetricConfig) -> tuple[pd.DataFrame, list[str]]:
    """One row per token with its cell keys and the raw per-token values."""
    t, s = case.logprobs()
    dims = list(STANDARD_DIMENSIONS) + sorted(set(case.labels) - set(STANDARD_DIMENSIONS))
    lengths = np.bincount(case.seq, minlength=case.num_sequences)
    df = pd.DataFrame({"seq": case.seq, "t": t, "s": s})
    for d in dims:
        vals = case.labels.get(d)
        df[d] = pd.array([None] * len(df) if vals is None else np.asarray(vals, dtype=object)[case.seq],
                         dtype="string")
    df["length_bucket"] = lower_edge(lengths, config.length_edges)[case.seq]
    df["turn_bucket"] = pd.array(lower_edge(case.turn, config.turn_edges) if case.turn is not None
                                 else [None] * len(df), dtype="Int64")
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(t) & np.isfinite(s)
        positive = finite & ((t > config.positive_logprob_tol) | (s > config.positive_logprob_tol))
    df["nonfinite"] = ~finite
    df["positive"] = positive
    df["valid"] = finite & ~positive
    with np.errstate(invalid="ignore"):
        df["lr"] = np.where(df["valid"], t - s, np.nan)
    if case.trainer_experts is not None:
        flips = routing_flips(case.trainer_experts, case.sampler_experts)
        df["flips"] = flips.sum(1)
        for layer in range(flips.shape[1]):
            df[f"flip_{layer}"] = flips[:, layer]
    if case.support is not None:
        df["support"] = case.support
    if case.kept is not None:
        df["kept"] = case.kept
    return df, dims


def _groups(df: pd.DataFrame, keys: list[str]):
    """(key tuple, row positions) of every non-empty group; NA keys included."""
    if not keys:
        yield (), np.arange(len(df))
        return
    for key, idx in df.groupby(keys, dropna=False, sort=False).indices.items():
        yield (key if isinstance(key, tuple) else (key,)), idx


# --------------------------------------------------------------------------- reference tables

def reference_tables(case: Case, config: MetricConfig) -> dict[str, pd.DataFrame]:
    """Every engine table, computed cell by cell in float64."""
    df, dims = token_frame(case, config)
    bins = Bins(config)
    C = config.tis_cap
    lo_i, hi_i = config.icepop_band
    lo_x, hi_x = config.extreme_band
    cell_keys = dims + ["length_bucket", "turn_bucket"]
    rows: dict[str, list[dict]] = {name: [] for name in TABLES}
    for key, idx in _groups(df, cell_keys):
        g = df.iloc[idx]
        base = dict(zip(cell_keys, key))
        v = g[g["valid"]]
        lr = v["lr"].to_numpy()
        rho = np.exp(lr)
        rc = np.minimum(rho, C)
        n = len(lr)
        p_t, p_s = np.exp(v["t"].to_numpy()), np.exp(v["s"].to_numpy())   # differences taken as they are
        row = dict(base, n_tokens=n, n_nonfinite=int(g["nonfinite"].sum()),
                   n_positive_logprob=int(g["positive"].sum()),
                   n_lr_zero=int((v["t"].to_numpy() == v["s"].to_numpy()).sum()),
                   sum_lr=lr.sum(), sum_lr2=(lr ** 2).sum(), sum_abs_lr=np.abs(lr).sum(),
                   sum_k3=k3_terms(lr).sum(), sum_exp_abs_lr=np.exp(np.abs(lr)).sum(),
                   sum_rho=rho.sum(), sum_rho2=np.exp(2 * lr).sum(), sum_rho_capped=rc.sum(),
                   sum_rho_capped2=(rc ** 2).sum(),
                   n_clip_high=int((rho > C).sum()), n_clip_low=int((rho <= 1 / C).sum()),
                   n_outside_icepop=int(((rho <= lo_i) | (rho > hi_i)).sum()),
                   n_extreme=int(((rho <= lo_x) | (rho > hi_x)).sum()),
                   n_outside_ppo_clip=int(((rho <= 1.0 - config.ppo_clip_eps) | (rho > 1.0 + config.ppo_clip_eps)).sum()),
                   sum_p_trainer=p_t.sum(), sum_p_sampler=p_s.sum(), sum_p_trainer2=(p_t ** 2).sum(),
                   sum_p_sampler2=(p_s ** 2).sum(), sum_p_cross=(p_t * p_s).sum(),
                   sum_abs_dp=np.abs(p_t - p_s).sum(), max_abs_dp=np.abs(p_t - p_s).max() if n else np.nan,
                   min_lr=lr.min() if n else np.nan, max_lr=lr.max() if n else np.nan,
                   max_abs_lr=np.abs(lr).max() if n else np.nan)
        routed = case.trainer_experts is not None
        L = case.trainer_experts.shape[1] if routed else 0
        row.update(n_routed_tokens=len(g) if routed else 0, n_routing_decisions=len(g) * L,
                   n_routing_flips=int(g["flips"].sum()) if routed else 0,
                   n_tokens_any_flip=int((g["flips"] > 0).sum()) if routed else 0)
        has_sup = case.support is not None
        row.update(n_support_known=len(g) if has_sup else 0,
                   n_support_mismatch=int((~g["support"]).sum()) if has_sup else 0)
        if case.kept is not None:
            kv = v["kept"].to_numpy()
            kv = kv[np.isfinite(kv)]
            row.update(n_kept_logmass=len(kv), sum_kept_logmass=kv.sum())
        else:
            row.update(n_kept_logmass=0, sum_kept_logmass=0.0)
        # the two ends of the sampler-probability buckets (p_S >= the last edge; p_S < the one before)
        edges = np.asarray(config.lowprob_edges)
        end = np.searchsorted(edges, np.exp(v["s"].to_numpy()), side="right")
        for side, m in (("top_p", end == len(edges)), ("low_p", end < len(edges) - 1)):
            row.update({f"n_{side}": int(m.sum()), f"sum_dev_{side}": np.expm1(lr[m]).sum(),
                        f"sum_rho2_{side}": np.exp(2 * lr[m]).sum()})
        rows["tokens"].append(row)
        for b, count in zip(*np.unique(bins.unsigned(lr), return_counts=True)):
            rows["abs_hist"].append(dict(base, bin=int(b), count=int(count)))
        p = np.exp(v["s"].to_numpy())
        bucket = np.searchsorted(np.asarray(config.lowprob_edges), p, side="right")
        for u in np.unique(bucket):
            m = bucket == u
            rows["lowprob"].append(dict(base, bucket=int(u), n_tokens=int(m.sum()),
                                        sum_abs_lr=np.abs(lr[m]).sum(), sum_k3=k3_terms(lr[m]).sum()))
        for layer in range(L):
            c = int(g[f"flip_{layer}"].sum())
            if c:
                rows["routing_layers"].append(dict(base, layer=layer, n_flips=c))

    seqs = _sequence_frame(case, df, dims)
    seq_keys = dims + ["length_bucket"]
    for key, idx in _groups(seqs, seq_keys):
        g = seqs.iloc[idx]
        base = dict(zip(seq_keys, key))
        sl, ml, mx = g["sum_lr"].to_numpy(), g["mean_lr"].to_numpy(), g["max_abs"].to_numpy()
        prod, geo = np.exp(sl), np.exp(ml)
        row = dict(base, n_sequences=len(g), sum_seq_len=int(g["n"].sum()), sum_seq_lr=sl.sum(),
                   sum_seq_lr2=float(np.sum(sl * sl)), sum_seq_mean_lr=ml.sum(), sum_seq_max_abs_lr=mx.sum(),
                   lse_seq_w=np.logaddexp.reduce(sl), lse_seq_w2=np.logaddexp.reduce(2.0 * sl),
                   min_seq_lr=sl.min(),
                   max_seq_lr=sl.max(), max_seq_max_abs_lr=mx.max(),
                   n_drop_product=int(((prod <= config.seq_product_band[0]) | (prod > config.seq_product_band[1])).sum()),
                   n_drop_geometric=int(((geo <= config.seq_geometric_band[0]) | (geo > config.seq_geometric_band[1])).sum()),
                   n_drop_mult_error=int((g["mean_exp_abs"] > config.seq_mult_error_threshold).sum()))
        if case.advantages is not None:
            adv = g["adv"].to_numpy()
            row.update(n_adv_known=len(g), n_drop_neg_adv=int(((adv < 0) & (-ml > config.neg_adv_delta)).sum()))
        else:
            row.update(n_adv_known=0, n_drop_neg_adv=0)
        if case.policy_version is not None:
            st = g["staleness"].to_numpy()
            row.update(n_stale_known=len(g), sum_staleness=int(st.sum()), max_staleness=float(st.max()))
            for u, c in zip(*np.unique(np.minimum(st, config.staleness_max), return_counts=True)):
                rows["staleness"].append(dict(base, staleness=int(u), count=int(c)))
        else:
            row.update(n_stale_known=0, sum_staleness=0, max_staleness=np.nan)
        rows["sequences"].append(row)
        for kind, values in zip(SEQ_HIST_KINDS, (sl, ml, mx)):
            for b, c in zip(*np.unique(bins.signed(values), return_counts=True)):
                rows["seq_hist"].append(dict(base, kind=kind, bin=int(b), count=int(c)))
    return {name: _frame(rows[name], name, dims) for name in TABLES}


def _sequence_frame(case: Case, df: pd.DataFrame, dims: list[str]) -> pd.DataFrame:
    """One row per sequence with at least one valid token."""
    out = []
    for b, idx in df[df["valid"]].groupby("seq").indices.items():
        g = df[df["valid"]].iloc[idx]
        lr = g["lr"].to_numpy()
        row = {d: g[d].iloc[0] for d in dims}
        row.update(seq=b, length_bucket=int(g["length_bucket"].iloc[0]), n=len(lr), sum_lr=lr.sum(),
                   mean_lr=lr.sum() / len(lr), max_abs=np.abs(lr).max(),
                   mean_exp_abs=np.exp(np.abs(lr)).mean(),
                   adv=np.nan if case.advantages is None else case.advantages[b],
                   staleness=0 if case.policy_version is None
                   else case.trainer_version - int(case.policy_version[b]))
        out.append(row)
    cols = dims + ["seq", "length_bucket", "n", "sum_lr", "mean_lr", "max_abs", "mean_exp_abs", "adv", "staleness"]
    frame = pd.DataFrame(out, columns=cols)
    return frame.astype({d: "string" for d in dims})


def _frame(rows: list[dict], table: str, dims: list[str]) -> pd.DataFrame:
    keys = dims + ["length_bucket"] + (["turn_bucket"] if table in ("tokens", "abs_hist", "lowprob", "routing_layers") else []) \
        + list(TABLES[table][0])
    fields = TABLES[table][1]
    df = pd.DataFrame(rows, columns=keys + [f.name for f in fields])
    types = {d: "string" for d in dims}
    types.update({"length_bucket": "int64", **{f.name: f.dtype for f in fields}})
    if "turn_bucket" in keys:
        types["turn_bucket"] = "Int64"
    for extra in TABLES[table][0]:
        types[extra] = "string" if extra == "kind" else "int64"
    return df.astype(types)


# --------------------------------------------------------------------------- reference metrics

def reference_metrics(case: Case, config: MetricConfig, by: Sequence[str]) -> pd.DataFrame:
    """Every metric key of ``metrics.METRICS`` per group of ``by``, straight from the tokens."""
    df, dims = token_frame(case, config)
    seqs = _sequence_frame(case, df, dims)
    C = config.tis_cap
    out = []
    for key, idx in _groups(df, list(by)):
        g = df.iloc[idx]
        lr = g.loc[g["valid"], "lr"].to_numpy()
        n = len(lr)
        row: dict = dict(zip(by, key))
        nan = np.nan

        def mean(x) -> float:
            return float(np.mean(x)) if len(x) else nan
        rho = np.exp(lr)
        w = rho / rho.sum() if n else rho
        wc = np.minimum(rho, C)
        wc = wc / wc.sum() if n else wc
        srt = np.sort(np.abs(lr))
        valid = g[g["valid"]]
        row.update({
            "mismatch/n_tokens": float(n),
            "mismatch/exact_agreement": mean(valid["t"].to_numpy() == valid["s"].to_numpy()),
            "mismatch/k1_kl": mean(-lr), "mismatch/k2_kl": mean(lr ** 2) / 2,
            "mismatch/k3_kl": mean(k3_terms(lr)), "mismatch/log_ratio/mean": mean(lr),
            "mismatch/log_ratio/std_error": float(np.std(lr, ddof=1) / math.sqrt(n)) if n > 1 else nan,
            "mismatch/log_ratio/min": lr.min() if n else nan, "mismatch/log_ratio/max": lr.max() if n else nan,
            "mismatch/abs_log_ratio/mean": mean(np.abs(lr)),
            "mismatch/abs_log_ratio/max": srt[-1] if n else nan,
            "mismatch/mult_prob_error": mean(np.exp(np.abs(lr))),
            "mismatch/rho/mean": mean(np.exp(lr)),
            **reference_probability_metrics(valid["t"].to_numpy(), valid["s"].to_numpy()),
            "mismatch/chi2": mean(np.exp(2 * lr)) - 1 if n else nan,
            "mismatch/ess": 1.0 / (n * np.sum(w ** 2)) if n else nan,
            "mismatch/ess_capped": 1.0 / (n * np.sum(wc ** 2)) if n else nan,
            "mismatch/clip_high_fraction": mean(rho > C), "mismatch/clip_low_fraction": mean(rho <= 1 / C),
            "mismatch/icepop_masked_fraction": mean((rho <= config.icepop_band[0]) | (rho > config.icepop_band[1])),
            "mismatch/extreme_fraction": mean((rho <= config.extreme_band[0]) | (rho > config.extreme_band[1])),
            "mismatch/ppo_clip_fraction": mean(~((rho > 1.0 - config.ppo_clip_eps) & (rho <= 1.0 + config.ppo_clip_eps))),
            "mismatch/data_quality/nonfinite_tokens": float(g["nonfinite"].sum()),
            "mismatch/data_quality/positive_logprob_tokens": float(g["positive"].sum()),
        })
        row.update(_reference_sharpness(lr, valid["s"].to_numpy(), config))
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
            row[f"mismatch/abs_log_ratio/{name}"] = nearest_rank(srt, q) if n else nan
        if case.trainer_experts is not None:
            fl = g[[c for c in g.columns if c.startswith("flip_")]].to_numpy()
            row["mismatch/routing/flip_rate"] = float(fl.mean()) if fl.size else nan
            row["mismatch/routing/any_layer_flip_fraction"] = float(fl.any(1).mean()) if len(fl) else nan
            row["mismatch/routing/decisions"] = float(fl.size)
        else:
            row["mismatch/routing/flip_rate"] = row["mismatch/routing/any_layer_flip_fraction"] = nan
            row["mismatch/routing/decisions"] = 0.0
        row["mismatch/support_mismatch_fraction"] = mean(~g["support"].to_numpy()) \
            if case.support is not None else nan
        if case.kept is not None:
            kv = g.loc[g["valid"], "kept"].to_numpy()
            row["mismatch/kept_logmass/mean"] = mean(kv[np.isfinite(kv)])
        else:
            row["mismatch/kept_logmass/mean"] = nan
        row.update(_reference_seq_metrics(case, config, seqs, by, key))
        out.append(row)
    return pd.DataFrame(out)


def _reference_sharpness(lr: np.ndarray, s: np.ndarray, config: MetricConfig) -> dict[str, float]:
    """The sharpness metrics from the tokens: exp(s) compared with the edges one by one, and the
    t of mean(rho - 1) from np.std of the weights themselves."""
    p = np.exp(s)
    edges = config.lowprob_edges
    top, low = p >= edges[-1], p < (edges[-2] if len(edges) > 1 else 0.0)

    def t(x: np.ndarray) -> float:
        w = np.exp(x)
        n = len(w)
        spread = float(np.sum(np.square(w - w.mean()))) if n else 0.0
        if n < 2 or spread <= 2 * (3 * n + 4) * 2.0 ** -53 * float(np.sum(w * w)):
            return np.nan
        return float(np.mean(np.expm1(x))) / (float(np.std(w, ddof=1)) / math.sqrt(n))
    ta, tb = t(lr[top]), t(lr[low])
    if math.isnan(ta) or math.isnan(tb):
        contrast = np.nan
    else:
        contrast = math.copysign(min(abs(ta), abs(tb)), ta) if ta * tb < 0 else 0.0
    return {"mismatch/sharpness/top_rho_shift": float(np.mean(np.expm1(lr[top]))) if top.any() else np.nan,
            "mismatch/sharpness/low_rho_shift": float(np.mean(np.expm1(lr[low]))) if low.any() else np.nan,
            "mismatch/sharpness/contrast_t": contrast}


def reference_probability_metrics(t: np.ndarray, s: np.ndarray) -> dict[str, float]:
    """|p_T - p_S| as a plain difference of exps, and np.corrcoef on the probabilities."""
    p_t, p_s = np.exp(t), np.exp(s)
    n = len(p_t)
    defined = n > 1 and np.var(p_t) > 0 and np.var(p_s) > 0
    return {"mismatch/abs_prob_diff/mean": float(np.mean(np.abs(p_t - p_s))) if n else np.nan,
            "mismatch/abs_prob_diff/max": float(np.max(np.abs(p_t - p_s))) if n else np.nan,
            "mismatch/prob_pearson_corr": float(np.corrcoef(p_t, p_s)[0, 1]) if defined else np.nan}


def reference_sequence_is(seq_lr: np.ndarray) -> dict[str, float]:
    """ESS and chi^2 of w = exp(seq_lr), from weights scaled by their largest (w / max w)."""
    w = np.exp(seq_lr - seq_lr.max())
    n = len(w)
    ess = w.sum() ** 2 / (n * np.sum(w * w))
    return {"mismatch/seq/is_ess": float(ess), "mismatch/seq/is_chi2": float(n * np.sum(w * w) / w.sum() ** 2 - 1.0)}


def _reference_seq_metrics(case: Case, config: MetricConfig, seqs: pd.DataFrame, by: Sequence[str],
                           key: tuple) -> dict:
    keys = ("n_sequences", "is_ess", "is_chi2", "log_ratio/mean", "log_ratio/variance", "log_ratio/min", "log_ratio/max",
            "mean_log_ratio/mean", "max_abs_log_ratio/mean", "product_mask_fraction", "geometric_mask_fraction",
            "mult_error_mask_fraction", "neg_adv_mask_fraction")
    res = {f"mismatch/seq/{k}": np.nan for k in keys}
    res["mismatch/staleness/mean"] = res["mismatch/staleness/max"] = np.nan
    if "turn_bucket" in by:           # a sequence spans turns: no sequence value per turn
        return res
    sel = np.ones(len(seqs), dtype=bool)
    for k, v in zip(by, key):
        col = seqs[k]
        sel &= (col.isna().to_numpy() if pd.isna(v) else (col == v).fillna(False).to_numpy())
    g = seqs[sel]
    if len(g) == 0:
        return res
    sl, ml = g["sum_lr"].to_numpy(), g["mean_lr"].to_numpy()
    res.update({
        "mismatch/seq/n_sequences": float(len(g)),
        "mismatch/seq/log_ratio/mean": sl.mean(), "mismatch/seq/log_ratio/min": sl.min(),
        "mismatch/seq/log_ratio/variance": float(np.var(sl, ddof=1)) if len(sl) > 1 else np.nan,
        **reference_sequence_is(sl),
        "mismatch/seq/log_ratio/max": sl.max(), "mismatch/seq/mean_log_ratio/mean": ml.mean(),
        "mismatch/seq/max_abs_log_ratio/mean": g["max_abs"].mean(),
        "mismatch/seq/product_mask_fraction": np.mean(~((np.exp(sl) > config.seq_product_band[0]) & (np.exp(sl) <= config.seq_product_band[1]))),
        "mismatch/seq/geometric_mask_fraction": np.mean(~((np.exp(ml) > config.seq_geometric_band[0]) & (np.exp(ml) <= config.seq_geometric_band[1]))),
        "mismatch/seq/mult_error_mask_fraction": np.mean(g["mean_exp_abs"] > config.seq_mult_error_threshold),
    })
    if case.advantages is not None:
        res["mismatch/seq/neg_adv_mask_fraction"] = np.mean((g["adv"] < 0) & (-g["mean_lr"] > config.neg_adv_delta))
    if case.policy_version is not None:
        res["mismatch/staleness/mean"] = g["staleness"].mean()
        res["mismatch/staleness/max"] = float(g["staleness"].max())
    return res


# --------------------------------------------------------------------------- comparison

EXACT_FLOATS = {"min_lr", "max_lr", "max_abs_lr", "max_seq_max_abs_lr", "max_staleness"}


def sort_table(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return df.sort_values(keys, na_position="first", kind="stable").reset_index(drop=True) if keys else df


def assert_tables_match(got: pd.DataFrame, want: pd.DataFrame, table: str, *, rtol: float = 1e-9,
                        atol: float = 1e-10, exact: bool = True) -> None:
    """Same cells, same keys; integer columns and extrema exact, float sums to rtol/atol."""
    assert list(got.columns) == list(want.columns), f"{table}: columns {list(got.columns)} vs {list(want.columns)}"
    fields = {f.name: f for f in TABLES[table][1]}
    keys = [c for c in got.columns if c not in fields]
    g, w = sort_table(got, keys), sort_table(want, keys)
    assert len(g) == len(w), f"{table}: {len(g)} rows vs reference {len(w)}"
    for k in keys:
        assert g[k].isna().equals(w[k].isna()), f"{table}.{k} nulls differ"
        present = g[k].notna().to_numpy()
        a, b = g[k].to_numpy()[present], w[k].to_numpy()[present]
        assert (a == b).all(), f"{table}.{k} differs"
    for name, f in fields.items():
        a, b = g[name].to_numpy(np.float64), w[name].to_numpy(np.float64)
        assert str(g[name].dtype) == f.dtype, f"{table}.{name} dtype {g[name].dtype}"
        if f.dtype == "int64" or (exact and name in EXACT_FLOATS):
            np.testing.assert_array_equal(a, b, err_msg=f"{table}.{name}")
        else:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{table}.{name}")
