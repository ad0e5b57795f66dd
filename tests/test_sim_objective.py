"""The simulator's collapse options: PPO objective, quantised LM head, fixed-prompt evaluation
(about 30 s: a few steps of a small simulation)."""

from __future__ import annotations


import pytest
import torch

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.sim import PoolSpec, SimConfig, Simulation
from mismatch_monitor.sim.evaluation import Evaluation
from mismatch_monitor.sim.objective import Objective, ppo_loss
from mismatch_monitor.sim.sampler import PoolSampler

CFG = MetricConfig()


def test_objective_options_are_validated_up_front():
    with pytest.raises(ValueError, match="kind 'pg'"):
        Objective(kind="pg", epochs=2)
    with pytest.raises(ValueError, match="epochs"):
        Objective(kind="ppo", epochs=0)
    with pytest.raises(ValueError, match="clip"):
        Objective(kind="ppo", clip=1.5)
    with pytest.raises(ValueError, match="ratio"):
        Objective(kind="ppo", ratio="answer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="old_logprobs='sampler'"):
        SimConfig(correction="tis", objective=Objective(kind="ppo", old_logprobs="sampler"))
    with pytest.raises(ValueError, match="every"):
        Evaluation(prompts=4, every=0)
    with pytest.raises(ValueError, match="lm_head"):
        PoolSpec("p", lm_head="int5")  # type: ignore[arg-type]


def _grad(loss_of, new: torch.Tensor) -> torch.Tensor:
    leaf = new.clone().requires_grad_(True)
    loss_of(leaf).backward()
    return leaf.grad


def test_first_ppo_epoch_around_the_trainer_is_the_weighted_policy_gradient():
    # at new == old the ratio is 1, so d(w r A) = w A d(log pi): the one-step objective's gradient
    torch.manual_seed(0)
    new, mu = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    adv = torch.randn(3)
    w = (new - mu).exp().clamp(max=CFG.tis_cap)
    ppo = _grad(lambda x: ppo_loss(x, x.detach(), x.detach() - mu, adv, mask, Objective(kind="ppo"), "tis", CFG), new)
    pg = _grad(lambda x: -(w * adv[:, None] * x)[mask].sum() / mask.sum(), new)
    torch.testing.assert_close(ppo, pg)


def test_sequence_ratio_clips_a_good_answer_the_sampler_underrates_and_pushes_a_bad_one():
    # the sampler as old: a sequence ratio above 1 + clip gives no gradient for A > 0, and a
    # gradient growing with the ratio for A < 0 (PPO without a dual clip)
    obj = Objective(kind="ppo", ratio="sequence", old_logprobs="sampler")
    mask = torch.ones(1, 4, dtype=torch.bool)
    zero = torch.zeros(1, 4)
    new = torch.full((1, 4), -1.0)
    for log_gap in (0.5, 1.0):       # sum of the answer's log pi - log mu = 4 * log_gap
        old = new - log_gap

        def loss(adv: float):
            return lambda x: ppo_loss(x, old, zero, torch.tensor([adv]), mask, obj, "none", CFG)

        assert torch.count_nonzero(_grad(loss(+1.0), new)) == 0
        g = _grad(loss(-1.0), new)
        torch.testing.assert_close(g, torch.full((1, 4), float(torch.tensor(4 * log_gap).exp())))


def test_a_quantised_lm_head_lies_on_its_integer_grid(tiny):
    sampler = PoolSampler(PoolSpec("q", precision="fp32", lm_head="int3"), tiny._model_config, tiny.tokenizer)
    sampler.load(tiny.trainer.state(), 0, "fp32")
    head = sampler._model.get_output_embeddings().weight.detach().double()
    groups = head.reshape(head.shape[0], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 3
    levels = groups / step
    assert head.dtype == torch.float64 and sampler._model.get_output_embeddings().weight.dtype == torch.bfloat16
    # 3 bits: integer levels in [-4, 3], up to the bf16 rounding of the stored values
    assert torch.all((levels - levels.round()).abs() < 0.02) and levels.round().abs().max() <= 4
    assert not torch.equal(head, tiny.trainer.state()["lm_head.weight"].double())


def _config(**options) -> SimConfig:
    return SimConfig(seed=2, warmstart_steps=10, group_size=4, pools=(PoolSpec("bf16", prompts=2),), **options)


@pytest.fixture(scope="module")
def tiny() -> Simulation:
    return Simulation(_config())


def test_evaluation_is_recorded_when_due_and_leaves_training_unchanged():
    plain = list(Simulation(_config()).run(3))
    evaluated = list(Simulation(_config(evaluation=Evaluation(prompts=4, every=2))).run(3))
    assert [o.eval_reward is None for o in evaluated] == [False, True, False]
    assert all(o.eval_reward is None for o in plain)
    assert all(0.0 <= o.eval_reward <= 1.0 for o in evaluated if o.eval_reward is not None)
    for a, b in zip(plain, evaluated):      # the evaluation takes no randomness from training
        assert torch.equal(a.batch.sampler_logprobs, b.batch.sampler_logprobs)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)


def test_evaluation_of_the_same_weights_gives_the_same_reward(tiny):
    evaluator = Simulation(_config(evaluation=Evaluation(prompts=6))).evaluator
    state = tiny.trainer.state()
    assert evaluator.reward(state, 0, 0.9) == evaluator.reward(state, 0, 0.9)


def test_ppo_epochs_take_several_optimiser_steps_and_one_version():
    sim = Simulation(_config(correction="none", objective=Objective(kind="ppo", epochs=3, old_logprobs="sampler")))
    before = sim.trainer.state()
    out = next(sim.run(1))
    assert sim.trainer.version == 1 and out.trainer_version == 0
    assert sim.trainer.optimizer.state_dict()["state"][0]["step"] == 3
    assert any(not torch.equal(before[k], v) for k, v in sim.trainer.state().items())


def test_collapse_arms_differ_where_the_doc_says():
    from mismatch_monitor.sim import scenario

    arms = {a: scenario("collapse_head", arm=a) for a in ("no_fault", "fault_none", "fault_tis", "matched")}
    assert {a: (c.pools[0].precision, c.pools[0].lm_head) for a, c in arms.items()} == {
        "no_fault": ("bf16", "same"), "fault_none": ("bf16", "int2"), "fault_tis": ("bf16", "int2"),
        "matched": ("fp32", "same")}
    assert {a: (c.correction, c.objective.old_logprobs) for a, c in arms.items()} == {
        "no_fault": ("none", "sampler"), "fault_none": ("none", "sampler"), "fault_tis": ("tis", "trainer"),
        "matched": ("none", "sampler")}
    assert all(c.evaluation.prompts > 0 and c.objective.kind == "ppo" for c in arms.values())
    with pytest.raises(ValueError, match="arm"):
        scenario("collapse_head", arm="fault")
