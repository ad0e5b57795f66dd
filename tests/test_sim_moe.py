"""The MoE variant: routing decisions really flip in a bf16 pool and never in an fp32 one.

Expert ids come from forward hooks on every layer's router, during ``generate`` (KV cache) on the
sampler side and in the full forward on the trainer side. Flips are counted here with numpy
(sets compared after sorting along top-k) and compared with the engine's count (about 8 s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor.engine import compute_stats
from mismatch_monitor.metrics import report
from mismatch_monitor.sim import PolicyShape, PoolSpec, SimConfig, Simulation


@pytest.fixture(scope="module")
def probe():
    sim = Simulation(SimConfig(seed=0, policy=PolicyShape(variant="moe"), warmstart_steps=60,
                               pools=(PoolSpec("train", precision="bf16"),)))
    episodes = sim.config.task.sample(192, torch.Generator().manual_seed(7), sim.config.alphabet)
    return sim, sim.probe([PoolSpec("fp32", precision="fp32"), PoolSpec("bf16", precision="bf16")], episodes)


def flips(batch) -> dict[str, tuple[int, int]]:
    """Pool -> (flipped (token, layer) decisions, decisions)."""
    t = np.sort(batch.trainer_experts.numpy(), -1)
    s = np.sort(batch.sampler_experts.numpy(), -1)
    differ = (t != s).any(-1)                                              # [N, L]
    pools = np.asarray(batch.labels["pool"])[batch.seq_index.numpy()]
    return {p: (int(differ[pools == p].sum()), differ[pools == p].size) for p in ("fp32", "bf16")}


def test_expert_ids_have_the_router_shape(probe):
    sim, batch = probe
    shape = sim.config.policy
    assert batch.trainer_experts.dtype == torch.uint8 and batch.sampler_experts.dtype == torch.uint8
    assert batch.trainer_experts.shape == (batch.num_tokens, shape.num_layers, shape.experts_per_token)
    assert int(batch.trainer_experts.max()) < shape.num_experts
    # top-k ids of one decision are distinct
    e = batch.sampler_experts.numpy()
    assert (e[..., 0] != e[..., 1]).all()


def test_bf16_pool_flips_routing_and_fp32_pool_does_not(probe):
    _, batch = probe
    counts = flips(batch)
    assert counts["fp32"][0] == 0 and counts["fp32"][1] > 2000
    assert counts["bf16"][0] > 0, counts
    # the engine counts the same decisions
    r = report(compute_stats(batch), by=["pool"]).set_index("pool")
    for pool, (n_flip, n_dec) in counts.items():
        assert r.loc[pool, "mismatch/routing/flip_rate"] == pytest.approx(n_flip / n_dec, abs=1e-12)
