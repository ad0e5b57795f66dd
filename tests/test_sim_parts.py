"""The simulator's small parts: number formats, the task, the tokenizer, the trainer's top-p set,
config validation. No model is trained here (about 3 s)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from mismatch_monitor.sim import FaultSpec, PolicyShape, PoolSpec, SimConfig, StringTask
from mismatch_monitor.sim.numerics import fake_quant_fp8_e4m3, fake_quant_int, format_state, is_quantised
from mismatch_monitor.sim.task import Episode, apply_op, turn_reward
from mismatch_monitor.sim.tokenizer import CharTokenizer
from mismatch_monitor.sim.trainer import correction_weights, kept_set
from mismatch_monitor.config import MetricConfig


def _e4m3_grid() -> np.ndarray:
    """Every finite non-negative float8 e4m3fn value, built from the format's definition
    (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; the all-ones pattern is NaN)."""
    values = [m / 8 * 2.0 ** -6 for m in range(8)]                       # subnormals
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)
               if not (e == 15 and m == 7)]
    return np.array(sorted(values))


def test_fp8_round_trip_lands_on_the_scaled_e4m3_grid_nearest_value():
    torch.manual_seed(0)
    w = torch.randn(16, 64) * 0.05
    q = fake_quant_fp8_e4m3(w).double().numpy()
    scale = w.abs().amax(1, keepdim=True).double().numpy() / 448.0
    grid = _e4m3_grid()
    scaled = np.abs(w.double().numpy()) / scale
    # nearest grid value, independently of torch's cast (ties are measure-zero for random data)
    nearest = grid[np.abs(scaled[..., None] - grid).argmin(-1)] * np.sign(w.numpy())
    np.testing.assert_allclose(q / scale, nearest, rtol=1e-6, atol=1e-9)
    # and the row maximum is kept exactly (it maps to 448, a grid point)
    np.testing.assert_allclose(np.abs(q).max(1), np.abs(w.double().numpy()).max(1), rtol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_int_groups_use_at_most_2_pow_bits_levels_and_half_a_step_of_error(bits):
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    q = fake_quant_int(w, bits, 32).double().numpy().reshape(8, 2, 32)
    x = w.double().numpy().reshape(8, 2, 32)
    step = np.abs(x).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    levels = np.round(q / step)
    np.testing.assert_allclose(levels * step, q, rtol=1e-6, atol=1e-9)   # on the grid
    assert levels.min() >= -(2 ** (bits - 1)) and levels.max() <= 2 ** (bits - 1) - 1
    assert np.all(np.abs(q - x) <= step / 2 * (1 + 1e-6))


def test_formats_touch_only_decoder_linear_weights():
    assert is_quantised("model.layers.0.self_attn.q_proj.weight")
    assert is_quantised("model.layers.1.mlp.experts.gate_up_proj")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight"):
        assert not is_quantised(name)
    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(4, 32), "lm_head.weight": torch.randn(4, 32)}
    out = format_state(state, "int4")
    assert torch.equal(out["lm_head.weight"], state["lm_head.weight"])
    assert not torch.equal(out["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])


def test_trainer_kept_set_matches_transformers_warpers():
    torch.manual_seed(2)
    logits = torch.randn(400, 20) * 3
    for top_k, top_p in ((0, 0.9), (5, 1.0), (5, 0.8), (0, 0.5)):
        scores = logits.clone()
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        ours = kept_set(torch.log_softmax(logits, -1), top_k, top_p)
        agree = (ours == torch.isfinite(scores)).all(-1).float().mean()
        assert agree >= 0.995, (top_k, top_p, float(agree))   # only exact ties may differ


def test_correction_weights_follow_the_shared_thresholds():
    cfg = MetricConfig(tis_cap=2.0, icepop_band=(0.5, 5.0))
    lr = torch.log(torch.tensor([0.1, 0.5, 0.9, 1.0, 3.0, 6.0]))
    assert torch.allclose(correction_weights(lr, "none", cfg), torch.ones(6))
    assert torch.allclose(correction_weights(lr, "tis", cfg), torch.tensor([0.1, 0.5, 0.9, 1.0, 2.0, 2.0]))
    assert torch.allclose(correction_weights(lr, "mis", cfg), torch.tensor([0.0, 0.0, 0.9, 1.0, 3.0, 0.0]))


def test_task_ops_rewards_and_reference_dialogue():
    assert apply_op(">", "cab") == "cab" and apply_op("<", "cab") == "bac" and apply_op("^", "cab") == "abc"
    assert turn_reward("abc", "abc") == 1.0 and turn_reward("abc", "abd") == pytest.approx(2 / 3)
    assert turn_reward("abc", "abcde") == pytest.approx(3 / 5) and turn_reward("", "") == 1.0
    ep = Episode("dcab", ("<", "^", ">"))
    answers = ep.reference_answers()
    assert answers == ["bacd", "abcd", "abcd"] and ep.reward(answers) == 1.0
    # each turn is judged against its own context: a wrong first answer, then a right sort of it
    assert ep.reward(["bdca", "abcd", "abcd"]) == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    tok = CharTokenizer("abcd")
    ids, mask = StringTask(turns=3).demonstration(ep, tok)
    assert tok.decode(ids, stop_at_eos=False) == "<dcab=bacd|^=abcd|>=abcd"
    assert sum(mask) == 3 * 5          # three answers of 4 letters + EOS each


def test_task_sampling_is_reproducible_and_within_bounds():
    task = StringTask(min_length=2, max_length=5, turns=2)
    a = task.sample(50, torch.Generator().manual_seed(3), "abcdefgh")
    b = task.sample(50, torch.Generator().manual_seed(3), "abcdefgh")
    assert a == b
    assert all(2 <= len(ep.source) <= 5 and len(ep.ops) == 2 for ep in a)


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("xyz")
    assert tok.decode(tok.encode("<xyz=zyx") + [tok.eos_id] + tok.encode("x")) == "<xyz=zyx"
    with pytest.raises(ValueError, match="expected characters"):
        tok.encode("q")
    with pytest.raises(ValueError, match="expected alphabet without the task symbols"):
        CharTokenizer("ab<")


@pytest.mark.parametrize("make, message", [
    (lambda: PoolSpec("a b"), "expected a pool name"),
    (lambda: PoolSpec("a", precision="fp4"), "expected a precision"),
    (lambda: PoolSpec("a", top_p=0.0), "expected 0 < top_p <= 1, got 0.0"),
    (lambda: PoolSpec("a", ship_kept_set=True), "expected top_p < 1 or top_k > 0"),
    (lambda: PoolSpec("a", lag=-1), "expected integer lag >= 0, got -1"),
    (lambda: FaultSpec("degrade_precision", 3), "expected precision exactly for degrade_precision"),
    (lambda: FaultSpec("melt", 3), "expected a fault kind"),
    (lambda: SimConfig(pools=(PoolSpec("a"), PoolSpec("a"))), "expected unique pool names"),
    (lambda: SimConfig(group_size=1), "expected integer group_size >= 2, got 1"),
    (lambda: SimConfig(correction="ppo"), "expected correction in"),
    (lambda: SimConfig(temperature=math.inf), "expected temperature > 0, got inf"),
    (lambda: SimConfig(task=StringTask(max_length=60, turns=4)), "expected policy.max_positions >="),
    (lambda: PolicyShape(variant="sparse"), "expected variant 'dense' or 'moe'"),
    (lambda: StringTask(min_length=5, max_length=4), "expected 1 <= min_length <= max_length"),
])
def test_configs_say_what_they_expected(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_faults_switch_on_at_their_step():
    pool = PoolSpec("p", precision="fp8_e4m3", faults=(
        FaultSpec("degrade_precision", 10, "int4"), FaultSpec("degrade_precision", 20, "int2"),
        FaultSpec("ignore_temperature", 15)))
    assert [pool.precision_at(s) for s in (0, 9, 10, 19, 20, 99)] == [
        "fp8_e4m3", "fp8_e4m3", "int4", "int4", "int2", "int2"]
    assert not pool.ignores_temperature_at(14) and pool.ignores_temperature_at(15)
    assert not pool.sync_stopped_at(100)
    # faults are silent: the labels stay what the spec declares
    assert pool.metadata()["precision"] == "fp8_e4m3"
