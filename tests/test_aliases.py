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


def verl_ess(old, rollout, mask, threshold=2.0, lower=None):
    """verl 0.6-0.7 clamps the weights to [1/C, C] for its ESS (lower=1/C); 0.8 to [0, C]."""
    w = torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask
    w = w.clamp(min=1.0 / threshold if lower is None else lower, max=threshold)
    normalized = w / (masked_mean(w, mask) + 1e-8)
    return 1.0 / masked_mean(normalized.square(), mask).item()


def verl_08_is(old, rollout, mask, threshold=2.0, icepop=None):
    """verl 0.8's token-level IS metrics: fractions and the out-of-band share from the raw
    (safety-clamped) weights, the mean from the weights the loss applies."""
    raw = torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask
    out = {"rollout_corr/rollout_is_ratio_fraction_high": masked_mean((raw > threshold).float(), mask).item(),
           "rollout_corr/rollout_is_ratio_fraction_low": masked_mean((raw < 1.0 / threshold).float(), mask).item(),
           "rollout_corr/rollout_is_mean": masked_mean(raw.clamp(max=threshold), mask).item(),
           "rollout_corr/rollout_is_eff_sample_size": verl_ess(old, rollout, mask, threshold, lower=0.0)}
    if icepop is not None:
        lo, hi = icepop
        out["rollout_corr/rollout_is_oob_ratio"] = masked_mean(((raw < lo) | (raw > hi)).float(), mask).item()
    return out


def verl_log_ppl_diff(old, rollout, mask):
    return (masked_mean(rollout, mask, axis=-1) - masked_mean(old, mask, axis=-1)).mean().item()


def nemo(micro_batches, cap=2.0):
    """micro_batches of one optimizer step: (generation, prev, mask) already sliced [:, 1:] as
    the loss does; is_oob_ratio in its default 'tis' mode (no minimum)."""
    global_valid_toks = sum(m.sum() for _, _, m in micro_batches)
    gen_kl = mult = oob = 0.0
    for gen, prev, mask in micro_batches:
        logr = prev - gen                                   # calculate_kl(gen, reference=prev)
        gen_kl += ((torch.exp(logr) - 1 - logr) * mask).sum() / (global_valid_toks + 1e-8)
        mult += (torch.exp(torch.abs(gen - prev) * mask) * mask).sum() / (global_valid_toks + 1e-8)
        weights = torch.exp(prev - gen)
        oob += (((weights > cap) | (weights < 0.0)).float() * mask).sum() / (global_valid_toks + 1e-8)
    return {"gen_kl_error": float(gen_kl), "token_mult_prob_error": float(mult), "is_oob_ratio": float(oob)}


def nemo_optimizer_steps(steps):
    """Several optimizer steps in one step: each one's metrics, averaged over them."""
    each = [nemo(s) for s in steps]
    return {k: float(np.mean([e[k] for e in each])) for k in each[0]}


def skyrl(micro_batches, cap=2.0, geo=(0.99, 1.01), product=(0.5, 2.0)):
    """SkyRL's off-policy metrics per micro-batch (old, rollout, loss_mask), averaged over them."""
    rows = []
    for old, rollout, mask in micro_batches:
        lr = old - rollout
        rho = torch.exp(torch.clamp(lr, -20.0, 20.0))
        n_seq = float(lr.shape[0])
        geo_ratio = torch.exp(torch.clamp((lr * mask).sum(-1) / mask.sum(-1).clamp(min=1.0), -20.0, 20.0))
        prod_ratio = torch.exp(torch.clamp((lr * mask).sum(-1), -20.0, 20.0))
        rows.append({
            "is_ratio_mean": masked_mean(rho, mask).item(),
            "tis_token_clip_high_ratio": (((rho > cap) & (mask > 0)).sum() / (mask > 0).sum().clamp(min=1)).item(),
            "geo_sequence_mask_masked_ratio": (((geo_ratio < geo[0]) | (geo_ratio > geo[1])).sum() / n_seq).item(),
            "product_sequence_mask_masked_ratio":
                (((prod_ratio < product[0]) | (prod_ratio > product[1])).sum() / n_seq).item()})
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


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
    """0.8-0.9: a token mean per micro-batch, then the mean over micro-batches."""
    return float(np.mean([masked_mean(r - o, m).item() for o, r, m in micro_batches]))


def openrlhf_010_vllm_kl(micro_batches):
    """0.10: each micro-batch's sum over the step's global token count, summed."""
    tokens = sum(m.sum() for _, _, m in micro_batches)
    return float(sum(((r - o) * m).sum() / tokens for o, r, m in micro_batches))


def prime_pooled_mismatch_kl(micro_batches):
    """After 0.4: every loss-mask token of every micro-batch pooled."""
    values = [(torch.exp(o - r) - (o - r) - 1)[m.bool()] for o, r, m in micro_batches]
    return torch.cat(values).mean().item()


# ------------------------------------------------------------------ tests
UNEQUAL = [3, 40, 7, 25, 12, 60]
EQUAL = [20] * 6


def test_every_alias_names_a_metric_we_define_and_the_release_it_was_read_from():
    for a in PEER_ALIASES:
        assert a.our_key in METRIC_BY_KEY, a
        assert (a.relation == "equal") == (a.differs_when == ""), a
        assert a.peer_version.startswith(a.framework.split("-")[0]), a
        assert a.sign in (1.0, -1.0), a
    with pytest.raises(ValueError, match="expected a framework among"):
        aliases_for("nonesuch")


def test_equal_aliases_agree_on_any_partition():
    cfg = MetricConfig(tis_cap=2.0, icepop_band=(0.5, 5.0))
    old, rollout, mask = padded(UNEQUAL, lr_scale=[0.6] * len(UNEQUAL))      # weights beyond C and 1/C
    mine = ours(old, rollout, mask, cfg)
    peer = {**verl_offpolicy(old, rollout, mask), **verl_08_is(old, rollout, mask, 2.0, icepop=(0.5, 5.0))}
    view = peer_view(mine, "verl")
    assert set(view) == {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_eff_sample_size",
                         "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_oob_ratio"}
    assert 0 < peer["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    for key, value in view.items():
        assert ALIAS_BY_PEER_KEY[("verl", key)][-1].relation == "equal"
        np.testing.assert_allclose(peer[key], value, rtol=1e-7, err_msg=f"verl {key}")
    # equal on any partition: prime-rl's pooled tokens and OpenRLHF 0.10's global count
    parts = [(old[:1], rollout[:1], mask[:1]), (old[1:], rollout[1:], mask[1:])]
    np.testing.assert_allclose(prime_pooled_mismatch_kl(parts), mine["mismatch/k3_kl"], rtol=1e-9)
    np.testing.assert_allclose(openrlhf_010_vllm_kl(parts), mine["mismatch/k1_kl"], rtol=1e-9, atol=1e-15)
    assert set(peer_view(mine, "prime-rl")) == {"mismatch_kl/all/mean"}
    assert set(peer_view(mine, "OpenRLHF")) == {"vllm_kl"}


def test_verl_08_fraction_low_and_the_mean_of_applied_weights():
    cfg = MetricConfig(tis_cap=2.0)
    old, rollout, mask = padded(UNEQUAL, lr_scale=[0.6] * len(UNEQUAL))
    mine, peer = ours(old, rollout, mask, cfg), verl_08_is(old, rollout, mask, 2.0)
    assert peer["rollout_corr/rollout_is_ratio_fraction_low"] > 0
    np.testing.assert_allclose(peer["rollout_corr/rollout_is_ratio_fraction_low"], mine["mismatch/clip_low_fraction"],
                               rtol=1e-7)
    # 0.8 averages min(rho, C): below our mean rho as soon as a weight passes C
    assert peer["rollout_corr/rollout_is_mean"] < mine["mismatch/rho/mean"] - 1e-3


def test_verl_log_ppl_diff_is_our_mean_geometric_log_ratio_negated():
    old, rollout, mask = padded(UNEQUAL)
    alias = ALIAS_BY_PEER_KEY[("verl", "rollout_corr/log_ppl_diff")][0]
    mine = ours(old, rollout, mask)
    np.testing.assert_allclose(verl_log_ppl_diff(old, rollout, mask), alias.sign * mine[alias.our_key], rtol=1e-7)
    assert abs(mine[alias.our_key]) > 1e-3
    # a row without response tokens counts as 0 in verl's mean over rows; we count sequences only
    old2, rollout2, mask2 = (torch.cat([t, torch.zeros(1, t.shape[1], dtype=F64)]) for t in (old, rollout, mask))
    assert ours(old2, rollout2, mask2)[alias.our_key] == pytest.approx(mine[alias.our_key], rel=1e-12)
    assert verl_log_ppl_diff(old2, rollout2, mask2) == pytest.approx(
        verl_log_ppl_diff(old, rollout, mask) * len(UNEQUAL) / (len(UNEQUAL) + 1), rel=1e-9)


def test_nemo_averages_optimizer_steps():
    """One optimizer step: token-global whatever its micro-batches; several: a mean of their means."""
    old, rollout, mask = padded(UNEQUAL, lr_scale=[0.6] * len(UNEQUAL))
    s = slice(1, None)
    mb = lambda rows: (rollout[rows, s], old[rows, s], mask[rows, s])         # noqa: E731
    mine = ours(old[:, s], rollout[:, s], mask[:, s], MetricConfig(tis_cap=2.0))
    one = nemo([mb(slice(0, 2)), mb(slice(2, None))])
    pairs = {"gen_kl_error": "mismatch/k3_kl", "token_mult_prob_error": "mismatch/mult_prob_error",
             "is_oob_ratio": "mismatch/clip_high_fraction"}
    for key, our_key in pairs.items():
        assert our_key in {a.our_key for a in ALIAS_BY_PEER_KEY[("NeMo-RL", key)]}
        np.testing.assert_allclose(one[key], mine[our_key], rtol=1e-7, err_msg=key)
    several = nemo_optimizer_steps([[mb(slice(0, 1))], [mb(slice(1, None))]])   # 2 tokens vs 144
    assert abs(several["gen_kl_error"] - mine["mismatch/k3_kl"]) > 1e-3


@pytest.mark.parametrize("n_micro_batches", [1, 2])
def test_skyrl_per_micro_batch_shares(n_micro_batches):
    cfg = MetricConfig(tis_cap=2.0, seq_geometric_band=(0.9, 1.1), seq_product_band=(0.5, 2.0))
    old, rollout, mask = padded(UNEQUAL)
    mine = ours(old, rollout, mask, cfg)
    parts = [(old, rollout, mask)] if n_micro_batches == 1 else [(old[:1], rollout[:1], mask[:1]),
                                                                  (old[1:], rollout[1:], mask[1:])]
    peer = skyrl(parts, geo=(0.9, 1.1))
    assert 0 < peer["geo_sequence_mask_masked_ratio"] < 1 and 0 < peer["product_sequence_mask_masked_ratio"] < 1
    for key, value in peer.items():
        our_key = ALIAS_BY_PEER_KEY[("SkyRL", key)][0].our_key
        if n_micro_batches == 1:
            np.testing.assert_allclose(value, mine[our_key], rtol=1e-7, err_msg=key)
    if n_micro_batches == 2:      # the 3-token sequence alone weighs as much as the other 144 tokens
        assert abs(peer["is_ratio_mean"] - mine["mismatch/rho/mean"]) > 1e-3


def test_verl_chi2_differs_only_beyond_its_clamp():
    old, rollout, mask = padded(UNEQUAL)
    np.testing.assert_allclose(verl_offpolicy(old, rollout, mask)["rollout_corr/chi2_token"],
                               ours(old, rollout, mask)["mismatch/chi2"], rtol=1e-7)
    rollout[1, 0], old[1, 0] = -30.0, -5.0                    # lr = 25 > 20
    assert ours(old, rollout, mask)["mismatch/chi2"] > 10 * verl_offpolicy(old, rollout, mask)["rollout_corr/chi2_token"]


def test_verl_06_ess_differs_when_a_weight_falls_below_one_over_cap():
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


def test_the_integrations_doc_shows_the_map_as_it_is():
    from pathlib import Path

    from mismatch_monitor.collectors.aliases import alias_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "INTEGRATIONS.md").read_text(encoding="utf-8")
    assert alias_table() in doc, "docs/INTEGRATIONS.md: paste collectors.aliases.alias_table() over the alias table"
