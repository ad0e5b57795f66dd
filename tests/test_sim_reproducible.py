"""A run is reproducible from its seed: bitwise, on the CPU with one torch thread (about 10 s)."""

from __future__ import annotations

import dataclasses

import torch

from mismatch_monitor.sim import FaultSpec, PolicyShape, PoolSpec, SimConfig, Simulation


def config(seed: int) -> SimConfig:
    return SimConfig(seed=seed, policy=PolicyShape(variant="moe"), warmstart_steps=10, group_size=4, pools=(
        PoolSpec("bf16", prompts=2),
        PoolSpec("topp", precision="fp8_e4m3", top_p=0.9, ship_kept_set=True, prompts=1),
        PoolSpec("async", precision="bf16", lag=1, prompts=1, faults=(FaultSpec("ignore_temperature", 1),))))


def run(seed: int, steps: int = 3) -> list:
    return list(Simulation(config(seed)).run(steps))


def tensors(batch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def test_same_seed_same_run_bitwise():
    a, b = run(3), run(3)
    for x, y in zip(a, b):
        assert x.batch.labels == y.batch.labels
        assert x.batch.trainer_version == y.batch.trainer_version
        tx, ty = tensors(x.batch), tensors(y.batch)
        assert tx.keys() == ty.keys() and "sampler_experts" in tx
        for name in tx:
            assert torch.equal(tx[name], ty[name]), name
        assert (x.reward_mean, x.loss, x.grad_norm, x.entropy) == (y.reward_mean, y.loss, y.grad_norm, y.entropy)


def test_another_seed_another_run():
    a, c = run(3, steps=1)[0].batch, run(4, steps=1)[0].batch

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.shape == y.shape and torch.equal(x, y)

    assert not same(a.token_ids, c.token_ids)
    assert not same(a.sampler_logprobs, c.sampler_logprobs)


def test_the_global_torch_generator_is_left_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    list(Simulation(config(5)).run(1))
    assert torch.equal(torch.rand(3), expected)
