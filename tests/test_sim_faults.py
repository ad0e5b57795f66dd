"""Faults switch on at their step and leave the fingerprint their mechanism implies (about 8 s).

One fleet carries all three faults from step 2: a bf16 pool that ignores the temperature (the
trainer scores at 0.7, the pool samples at 1), an fp32 pool whose weight sync stops (resynced
once after step 4), a bf16 pool whose weights degrade to INT4; a clean bf16 pool beside them.
Log-ratios and their statistics are computed here in float64 numpy.
"""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_monitor.sim import FaultSpec, PoolSpec, SimConfig, Simulation

FAULT_STEP, RESYNC_AFTER, STEPS = 2, 4, 7


def per_pool(batch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(pool -> float64 token log-ratios, pool -> per-sequence staleness)."""
    lr = batch.trainer_logprobs.double().numpy() - batch.sampler_logprobs.double().numpy()
    seq_pool = np.asarray(batch.labels["pool"])
    tok_pool = seq_pool[batch.seq_index.numpy()]
    staleness = batch.trainer_version - batch.policy_version.numpy()
    names = dict.fromkeys(seq_pool.tolist())
    return {p: lr[tok_pool == p] for p in names}, {p: staleness[seq_pool == p] for p in names}


def t_stat(x: np.ndarray) -> float:
    """Signed mean over its standard error."""
    return float(x.mean() / (x.std(ddof=1) / np.sqrt(len(x))))


def k3(x: np.ndarray) -> float:
    return float(np.mean(np.exp(x) - 1.0 - x))


@pytest.fixture(scope="module")
def steps():
    sim = Simulation(SimConfig(seed=0, temperature=0.7, warmstart_steps=60, pools=(
        PoolSpec("clean", precision="bf16", prompts=6),
        PoolSpec("hot", precision="bf16", prompts=6, faults=(FaultSpec("ignore_temperature", FAULT_STEP),)),
        PoolSpec("stuck", precision="fp32", prompts=1, faults=(FaultSpec("stop_sync", FAULT_STEP),)),
        PoolSpec("deg", precision="bf16", prompts=2,
                 faults=(FaultSpec("degrade_precision", FAULT_STEP, "int4"),)))))
    out = []
    for step in sim.run(STEPS):
        out.append(per_pool(step.batch))
        if step.step == RESYNC_AFTER:
            sim.resync("stuck")
    return sim, out


def test_ignoring_temperature_gives_a_persistent_signed_mean_a_clean_pool_does_not(steps):
    _, out = steps
    before = [lr["hot"] for lr, _ in out[:FAULT_STEP]]
    after = [lr["hot"] for lr, _ in out[FAULT_STEP:]]
    assert all(abs(t_stat(x)) < 4 for x in before)
    # E_mu[log pi - log mu] = -KL(mu || pi) < 0: negative at every step, far from zero pooled
    assert all(x.mean() < 0 and t_stat(x) < -2 for x in after)
    assert t_stat(np.concatenate(after)) < -6
    clean = [lr["clean"] for lr, _ in out]
    assert all(abs(t_stat(x)) < 4 for x in clean) and abs(t_stat(np.concatenate(clean))) < 4


def test_a_pool_that_stops_syncing_goes_stale_until_resynced(steps):
    sim, out = steps
    staleness = [int(st["stuck"].max()) for _, st in out]
    # holds version 1 from step 2; resynced to version 5 before step 5, stuck there again
    assert staleness == [0, 0, 1, 2, 3, 0, 1]
    assert all((st["stuck"] == st["stuck"][0]).all() for _, st in out)
    assert all(int(st["clean"].max()) == 0 for _, st in out)
    lr = [x["stuck"] for x, _ in out]
    assert k3(lr[4]) > 1e3 * k3(lr[0])          # 3 updates of lag vs fp32 rounding
    assert k3(lr[5]) < 1e-9                     # the resync brought it back


def test_degrading_precision_switches_the_pool_format_at_its_step(steps):
    sim, out = steps
    k = [k3(lr["deg"]) for lr, _ in out]
    assert min(k[FAULT_STEP:]) > 10 * max(k[:FAULT_STEP]), k
    assert sim.samplers["deg"].precision == "int4"
    assert sim.pool_metadata()["deg"]["precision"] == "bf16"   # the label does not tell
