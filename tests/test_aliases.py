"""The alias map: each peer's number computed two ways from the same batch.

Way 1 re-does what the framework does (its masked means, its partition into micro-batches,
ranks or samples, its clamps), written here the way the framework writes it. Way 2 is our
metric through the alias. ``equal`` aliases must agree on any partition; ``equal_if`` aliases
agree exactly when their condition holds and differ, in a predictable direction, when it does
not. Runtime: < 1 s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors.aliases import ALIAS_BY_PEER_KEY, PEER_ALIASES, aliases_for, peer_view
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.metrics import METRIC_BY_KEY, report

torch.set_num_threads(1)
F64 = torch.float64


def padded(lengths, seed=0, lr_scale=None, tail_low=False):
    """old (trainer) and rollout (sampler) log-probs [B, T] plus a right-padded mask.

    ``lr_scale`` per sequence sets the size of its log-ratio noise; short sequences get larger
    noise when it is None (the pattern of a pool that loses its long rollouts first).
    """
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(F64)
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 5
    scale = torch.tensor(lr_scale if lr_scale is not None else [2.0 / math.sqrt(n) for n in lengths], dtype=F64)
    lr = torch.randn(B, T, generator=g, dtype=F64) * scale[:, None]
    if tail_low:
        lr[0, 0] = -3.0                                       # exp(lr) well below 1/C
    old = (rollout + lr).clamp(max=0.0)
    rollout = rollout.masked_fill(mask == 0, 0.0)             # frameworks pad with 0.0
    old = old.masked_fill(mask == 0, 0.0)
    return old, rollout, mask


def ours(old, rollout, mask, config=None):
    batch = TokenBatch.from_padded(old, rollout, mask)
    return report(compute_stats(batch, config), (), config).iloc[0].to_dict()


# ------------------------------------------------------------------ the peers, as they compute
def masked_mean(values, mask, axis=None):                  # verl_F.masked_mean
    s = (values * mask).sum() if axis is None else (values * mask).sum(axis)
    return s / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def verl_offpolicy(old, rollout, mask):
    log_ratio = old - rollout
    rho = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    return {"rollout_corr/kl": masked_mean(rollout - old, mask).item(),
            "rollout_corr/k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
            "rollout_corr/chi2_token": (masked_mean(rho.square(), mask) - 1.0).item()}


def verl_ess(old, rollout, mask, threshold=2.0):
    w = torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask
    w = w.clamp(min=1.0 / threshold, max=threshold)
    normalized = w / (masked_mean(w, mask) + 1e-8)
    return 1.0 / masked_mean(normalized.square(), mask).item()


def nemo(micro_batches):
    """micro_batches: (generation, prev, mask) already sliced [:, 1:] as the loss does."""
    global_valid_toks = sum(m.sum() for _, _, m in micro_batches)
    gen_kl = mult = 0.0
    for gen, prev, mask in micro_batches:
        logr = prev - gen                                   # calculate_kl(gen, reference=prev)
        gen_kl += ((torch.exp(logr) - 1 - logr) * mask).sum() / (global_valid_toks + 1e-8)
        mult += (torch.exp(torch.abs(gen - prev) * mask) * mask).sum() / (global_valid_toks + 1e-8)
    return {"gen_kl_error": float(gen_kl), "token_mult_prob_error": float(mult)}


def trl(ranks):
    means, maxes = [], []
    for old, sampling, mask in ranks:
        delta = torch.abs(old - sampling)[mask.bool()]
        means.append(delta.mean())
        maxes.append(delta.max())
    return {"sampling/sampling_logp_difference/mean": torch.stack(means).mean().item(),
            "sampling/sampling_logp_difference/max": torch.stack(maxes).max().item()}


def slime_abs_diff(old, rollout, mask):
    per_sample = [((o - r).abs() * m).sum() / torch.clamp_min(m.sum(), 1) for o, r, m in zip(old, rollout, mask)]
    return (sum(per_sample) / len(per_sample)).item()       # sum_of_sample_mean / n_samples


def prime_mismatch_kl(old, rollout, mask):
    per_sample = []
    for o, r, m in zip(old, rollout, mask.bool()):
        lr = o - r
        k3 = torch.exp(lr) - lr - 1
        per_sample.append(k3[m].sum() / torch.clamp_min(m.sum(), 1))
    return torch.stack(per_sample).mean().item()


def openrlhf_vllm_kl(micro_batches):
    return float(np.mean([masked_mean(r - o, m).item() for o, r, m in micro_batches]))


# ------------------------------------------------------------------ tests
UNEQUAL = [3, 40, 7, 25, 12, 60]
EQUAL = [20] * 6


def test_every_alias_names_a_metric_we_define():
    for a in PEER_ALIASES:
        assert a.our_key in METRIC_BY_KEY, a
        assert (a.relation == "equal") == (a.differs_when == ""), a
    with pytest.raises(ValueError, match="expected a framework among"):
        aliases_for("nonesuch")


def test_equal_aliases_agree_on_any_partition():
    old, rollout, mask = padded(UNEQUAL)
    mine = ours(old, rollout, mask)
    peer = verl_offpolicy(old, rollout, mask)
    half = [(rollout[:2, 1:], old[:2, 1:], mask[:2, 1:]), (rollout[2:, 1:], old[2:, 1:], mask[2:, 1:])]
    mine_sliced = ours(old[:, 1:], rollout[:, 1:], mask[:, 1:])
    peer.update(nemo(half))
    for framework in ("verl", "NeMo-RL"):
        view = peer_view(mine_sliced if framework == "NeMo-RL" else mine, framework)
        for key, value in view.items():
            assert ALIAS_BY_PEER_KEY[(framework, key)].relation == "equal"
            np.testing.assert_allclose(peer[key], value, rtol=1e-7, err_msg=f"{framework} {key}")
    assert set(peer_view(mine, "verl")) == {"rollout_corr/kl", "rollout_corr/k3_kl"}


def test_verl_chi2_differs_only_beyond_its_clamp():
    old, rollout, mask = padded(UNEQUAL)
    np.testing.assert_allclose(verl_offpolicy(old, rollout, mask)["rollout_corr/chi2_token"],
                               ours(old, rollout, mask)["mismatch/chi2"], rtol=1e-7)
    rollout[1, 0], old[1, 0] = -30.0, -5.0                    # lr = 25 > 20
    assert ours(old, rollout, mask)["mismatch/chi2"] > 10 * verl_offpolicy(old, rollout, mask)["rollout_corr/chi2_token"]


def test_verl_ess_differs_when_a_weight_falls_below_one_over_cap():
    cfg = MetricConfig(tis_cap=2.0)
    old, rollout, mask = padded(UNEQUAL, lr_scale=[0.05] * len(UNEQUAL))     # no rho < 1/2
    assert ((old - rollout)[mask.bool()] > -math.log(2.0)).all()
    np.testing.assert_allclose(verl_ess(old, rollout, mask), ours(old, rollout, mask, cfg)["mismatch/ess_capped"], rtol=1e-7)
    old, rollout, mask = padded(UNEQUAL, lr_scale=[0.05] * len(UNEQUAL), tail_low=True)
    # verl lifts the low weight to 1/C, which makes the weights more alike: its ESS is higher
    assert verl_ess(old, rollout, mask) > ours(old, rollout, mask, cfg)["mismatch/ess_capped"] + 1e-4


@pytest.mark.parametrize("lengths,equal", [(UNEQUAL, False), (EQUAL, True)])
def test_mean_of_sequence_means(lengths, equal):
    """slime and prime-rl weigh every sample once; we weigh every token once."""
    old, rollout, mask = padded(lengths)
    mine = ours(old, rollout, mask)
    pairs = ((slime_abs_diff(old, rollout, mask), mine["mismatch/abs_log_ratio/mean"]),
             (prime_mismatch_kl(old, rollout, mask), mine["mismatch/k3_kl"]))
    for peer, our in pairs:
        if equal:
            np.testing.assert_allclose(peer, our, rtol=1e-9)
        else:   # short samples carry the larger log-ratios here, and count more for the peer
            assert peer > 1.2 * our


@pytest.mark.parametrize("lengths,equal", [(UNEQUAL, False), (EQUAL, True)])
def test_mean_of_rank_and_micro_batch_means(lengths, equal):
    """TRL averages rank means, OpenRLHF micro-batch means; a max is a max either way."""
    old, rollout, mask = padded(lengths)
    mine = ours(old, rollout, mask)
    parts = [(old[:1], rollout[:1], mask[:1]), (old[1:], rollout[1:], mask[1:])] if not equal else \
        [(old[:3], rollout[:3], mask[:3]), (old[3:], rollout[3:], mask[3:])]
    peer = trl(parts)
    assert peer["sampling/sampling_logp_difference/max"] == pytest.approx(mine["mismatch/abs_log_ratio/max"], rel=1e-12)
    vllm_kl = openrlhf_vllm_kl(parts)
    if equal:
        np.testing.assert_allclose(peer["sampling/sampling_logp_difference/mean"], mine["mismatch/abs_log_ratio/mean"], rtol=1e-9)
        np.testing.assert_allclose(vllm_kl, mine["mismatch/k1_kl"], rtol=1e-7, atol=1e-12)
    else:   # rank 0 holds 3 noisy tokens, rank 1 the other 144: its mean counts as much
        assert peer["sampling/sampling_logp_difference/mean"] > 1.5 * mine["mismatch/abs_log_ratio/mean"]
        assert abs(vllm_kl - mine["mismatch/k1_kl"]) > 1e-3
