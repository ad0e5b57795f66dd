"""The int8 checkpoint's SmoothQuant and the int4 fallback's weights, checked without an engine.

SmoothQuant must leave the fp32 model's function unchanged (it only moves a per-channel scale
from the RMSNorm into the weights that read it) and must shrink the error of W8A8 int8 (per-token
activations, per-channel weights) on activations with an outlier channel, against the exact
fp32 product. The int4 fallback must serve exactly the grid the W4A16 checkpoint stores, read back
through compressed-tensors' own unpacking.
"""

from __future__ import annotations

import pytest
import torch

from mismatch_monitor.sim import vllm_smoothquant as sq
from mismatch_monitor.sim.policy import PolicyShape, build_model, model_config
from mismatch_monitor.sim.tokenizer import CharTokenizer

TOK = CharTokenizer("abcdefgh")


def outlier_state(variant: str) -> tuple[object, dict[str, torch.Tensor]]:
    """A toy policy whose norms give channels 3 and 17 of every layer 30x the others: the
    activation outliers real LLMs have and a per-token int8 scale suffers from."""
    cfg = model_config(PolicyShape(variant=variant, head_dim=32), TOK.vocab_size, TOK.pad_id, TOK.bos_id, TOK.eos_id)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in build_model(cfg).state_dict().items()}
    for name in state:
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            state[name][[3, 17]] *= 30.0
    return cfg, state


def w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 W8A8 as the checkpoint's scheme computes it: symmetric per-token activations,
    symmetric per-output-channel weights, exact integer products."""
    xs = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    ws = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(x / xs) @ torch.round(w / ws).T) * xs * ws.T


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_smoothing_keeps_the_fp32_model(variant):
    cfg, state = outlier_state(variant)
    smoothed, info = sq.smoothquant_state(cfg, state, TOK)
    assert info["scaled_tensors"] == 2 * 5       # per layer: q, k, v; gate, up (MoE: router, experts)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(smoothed[norm], state[norm])
    ids = torch.randint(3, TOK.vocab_size, (4, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = sq._model(cfg, state)(input_ids=ids).logits
        after = sq._model(cfg, smoothed)(input_ids=ids).logits
    assert (after - before).abs().max() < 1e-4 * before.abs().max()


def test_smoothing_lowers_the_int8_error_beside_outliers():
    cfg, state = outlier_state("dense")
    model = sq._model(cfg, state)
    ids = sq.calibration_ids(model, TOK)
    smoothed, _ = sq.smooth(state, sq.activation_max(model, ids))
    x = {}                                   # q_proj's input in each model, on fresh prompts
    fresh = torch.randint(3, TOK.vocab_size, (4, 48), generator=torch.Generator().manual_seed(2))
    for label, st in (("plain", state), ("smooth", smoothed)):
        m = sq._model(cfg, st)
        hook = m.model.layers[0].input_layernorm.register_forward_hook(
            lambda _m, _i, out, label=label: x.__setitem__(label, out.detach().reshape(-1, out.shape[-1])))
        with torch.no_grad():
            m(input_ids=fresh)
        hook.remove()
    name = "model.layers.0.self_attn.q_proj.weight"
    exact = x["plain"] @ state[name].T
    torch.testing.assert_close(x["smooth"] @ smoothed[name].T, exact, rtol=1e-4, atol=1e-5)
    err = {label: (w8a8(x[label], w) - exact).pow(2).mean().item()
           for label, w in (("plain", state[name]), ("smooth", smoothed[name]))}
    assert err["smooth"] < 0.5 * err["plain"], err


def test_calibration_is_seeded_and_leaves_the_global_generator_alone():
    cfg, state = outlier_state("dense")
    model = sq._model(cfg, state)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = sq.calibration_ids(model, TOK)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(first, sq.calibration_ids(model, TOK))
    assert first.shape == (sq.CALIBRATION_SEQUENCES, 1 + sq.CALIBRATION_TOKENS)
    assert not set(first[:, 1:].unique().tolist()) & {TOK.pad_id, TOK.bos_id, TOK.eos_id}


def test_int4_fallback_serves_the_w4a16_checkpoints_grid():
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (make install-vllm)")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from mismatch_monitor.sim.vllm_checkpoint import INT4_GROUP, checkpoint_weights

    _, state = outlier_state("dense")
    packed = dict(checkpoint_weights(state, "int4"))
    plain = dict(checkpoint_weights(state, "int4_dequantized"))
    assert set(plain) == set(state)
    name = "model.layers.1.mlp.down_proj"
    shape = torch.Size(packed[name + ".weight_shape"].tolist())
    q = unpack_from_int32(packed[name + ".weight_packed"], 4, shape).to(torch.float32)
    scale = packed[name + ".weight_scale"].to(torch.float32).repeat_interleave(INT4_GROUP, dim=1)
    assert torch.equal(plain[name + ".weight"], q * scale)
    assert q.abs().max() <= 8 and len(q.unique()) > 8                       # really the int4 grid
    assert torch.equal(plain["model.norm.weight"], state["model.norm.weight"])  # non-linears as they were
