"""Each sampler pool's mismatch is what its numeric path makes it.

Every pool answers the *same* prompts with the same trainer weights (``Simulation.probe``); k3
and the log-ratios are computed here in float64 numpy from the batch, independently of the
metric engine. Orderings are checked only where the number formats decide them unambiguously:
fp32 (same arithmetic, other kernels) ~ 0 < fp16 (10 mantissa bits) < bf16 (7) < FP8 e4m3 weights
(3) and bf16 < INT4 weights; a stale pool's k3 grows with its lag. About 12 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor.sim import PoolSpec, SimConfig, Simulation, StringTask


def log_ratios(batch) -> dict[str, np.ndarray]:
    """Pool -> float64 lr = log pi - log mu of its tokens."""
    lr = batch.trainer_logprobs.double().numpy() - batch.sampler_logprobs.double().numpy()
    pools = np.asarray(batch.labels["pool"])[batch.seq_index.numpy()]
    return {p: lr[pools == p] for p in dict.fromkeys(pools.tolist())}


def k3(lr: np.ndarray) -> float:
    """mean(rho - 1 - lr), rho = exp(lr)."""
    return float(np.mean(np.exp(lr) - 1.0 - lr))


@pytest.fixture(scope="module")
def sim() -> Simulation:
    # the lag-4 pool only makes the simulation keep four old weight versions for the probes
    return Simulation(SimConfig(seed=0, pools=(PoolSpec("train", precision="bf16", lag=4),),
                                warmstart_steps=60))


@pytest.fixture(scope="module")
def episodes(sim: Simulation):
    return sim.config.task.sample(48, torch.Generator().manual_seed(11), sim.config.alphabet)


def test_number_formats_order_the_mismatch(sim, episodes):
    formats = ("fp32", "fp16", "bf16", "fp8_e4m3", "int4")
    lr = log_ratios(sim.probe([PoolSpec(f, precision=f) for f in formats], episodes))
    k = {f: k3(lr[f]) for f in formats}
    assert all(len(lr[f]) > 300 for f in formats)
    assert k["fp32"] < 1e-3 * k["fp16"], k          # fp32 vs fp32: kernel order only, ~0
    assert k["fp16"] < k["bf16"] < k["fp8_e4m3"], k
    assert k["bf16"] < k["int4"], k
    assert np.abs(lr["fp32"]).max() < 1e-4


def test_low_precision_lm_head_alone_is_a_real_mismatch(sim, episodes):
    lr = log_ratios(sim.probe([PoolSpec("fp32", precision="fp32"),
                               PoolSpec("head", precision="fp32", lm_head="bf16")], episodes))
    assert k3(lr["head"]) > 100 * k3(lr["fp32"])


def test_other_kernels_and_batch_shapes_stay_at_fp32_rounding(sim, episodes):
    lr = log_ratios(sim.probe([PoolSpec("bs1", precision="fp32", decode_batch=1),
                               PoolSpec("eager", precision="fp32", attention="eager")], episodes))
    for name in ("bs1", "eager"):
        assert 0 < np.abs(lr[name]).max() < 1e-4, name     # different, but only in rounding


def test_truncated_sampling_with_and_without_the_kept_set(sim, episodes):
    batch = sim.probe([PoolSpec("trunc", precision="fp32", top_p=0.8),
                       PoolSpec("replay", precision="fp32", top_p=0.8, ship_kept_set=True)], episodes)
    lr = log_ratios(batch)
    pools = np.asarray(batch.labels["pool"])[batch.seq_index.numpy()]
    kept = batch.sampler_kept_logmass.double().numpy()
    # without the kept set the trainer scores the full distribution: every lr is log S <= 0
    assert lr["trunc"].max() < 1e-5 and lr["trunc"].mean() < -0.01
    assert np.isnan(kept[pools == "trunc"]).all()                 # the pool does not report S
    # with it the trainer renormalises over the same set: back to fp32 rounding
    assert np.abs(lr["replay"]).max() < 1e-4
    assert (kept[pools == "replay"] <= 1e-6).all() and kept[pools == "replay"].mean() < -0.01
    support = batch.in_trainer_support.numpy()
    assert support[pools == "replay"].mean() > 0.99 and support[pools == "trunc"].all()


def test_stale_weights_mismatch_grows_with_the_lag(sim, episodes):
    for _ in sim.run(5):
        pass
    lags = (0, 1, 2, 4)
    batch = sim.probe([PoolSpec(f"lag{k}", precision="fp32", lag=k) for k in lags], episodes)
    lr = log_ratios(batch)
    k = [k3(lr[f"lag{lag}"]) for lag in lags]
    assert k[0] < 1e-9 and k[0] < k[1] < k[2] < k[3], k
    staleness = batch.trainer_version - batch.policy_version.numpy()
    seq_pools = np.asarray(batch.labels["pool"])
    for lag in lags:
        assert (staleness[seq_pools == f"lag{lag}"] == lag).all()


def test_multi_turn_batches_carry_turns_and_leave_environment_tokens_out():
    sim = Simulation(SimConfig(seed=1, task=StringTask(max_length=6, turns=3), warmstart_steps=10,
                               pools=(PoolSpec("bf16", prompts=2),), group_size=4))
    out = sim.next_step()
    batch = out.batch
    turns = batch.turn_index.numpy()
    seq = batch.seq_index.numpy()
    assert set(turns.tolist()) == {0, 1, 2}
    for b in range(batch.num_sequences):
        t = turns[seq == b]
        assert (np.diff(t) >= 0).all() and t[0] == 0 and t[-1] == 2
    assert out.batch.advantages.shape == (8,)
    # the environment's turns ("|", op, "=") sit right before each later turn, outside the response
    tok = sim.tokenizer
    episodes = sim.config.task.sample(4, torch.Generator().manual_seed(5), sim.config.alphabet)
    for ep, r in zip(episodes, sim.samplers["bf16"].rollout(episodes, temperature=0.9, max_new_tokens=9, seed=1)):
        positions = r.positions.tolist()
        for k in (1, 2):
            first = positions[r.turns.tolist().index(k)]
            assert r.ids[first - 3: first] == tok.encode(f"|{ep.ops[k]}=")
            assert not set(range(first - 3, first)) & set(positions)
