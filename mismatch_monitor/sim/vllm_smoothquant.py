"""SmoothQuant for the int8 W8A8 checkpoint: move activation outliers into the weights first.

W8A8 int8 quantizes each token's activations with one scale (its largest |x|), so the small
channels beside an outlier channel lose most of their bits. SmoothQuant (Xiao et al., 2023), the
usual step before an int8 W8A8 checkpoint, divides each input channel j of a linear layer's
activations by ``s_j = max|x_j|^a / max|W[:, j]|^(1-a)`` and multiplies the weights' column j by
the same ``s_j``: the product is unchanged, and the outliers are shared between activations and
weights. The division is folded into the RMSNorm that produces those activations (its weight is
a per-channel scale), so the engine runs the smoothed model with no extra operation:

* ``input_layernorm`` -> ``q_proj``, ``k_proj``, ``v_proj``;
* ``post_attention_layernorm`` -> ``gate_proj``, ``up_proj`` (with a MoE policy: the router
  and every expert's fused gate/up projection; they all read the same normalised input).

``o_proj`` and ``down_proj`` have no norm before them and stay as they were. ``max|x_j|`` is
calibrated on a few sequences the fp32 policy samples itself (from BOS, seeded), not on the
prompts a pool is later measured on.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from transformers import PretrainedConfig

from .policy import build_model
from .tokenizer import CharTokenizer

# the migration strength a pool's int8 checkpoint is smoothed with; None: not smoothed (the
# default: the toy policy's activations have no outlier channels, and smoothing raised the int8
# pool's k3 on one measurement and lowered it on another; docs/SIMULATOR.md has both)
ALPHA: float | None = None
DEFAULT_ALPHA = 0.5
CALIBRATION_SEQUENCES = 8
CALIBRATION_TOKENS = 64
CALIBRATION_SEED = 0
_FLOOR = 1e-5

# each RMSNorm of a decoder layer -> the tensors that read its output (last axis = its channels)
FOLDS: dict[str, tuple[str, ...]] = {
    "input_layernorm": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "post_attention_layernorm": ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate.weight",
                                 "mlp.experts.gate_up_proj"),
}


def _model(config: PretrainedConfig, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(config)
    model.load_state_dict({k: v.detach().to(torch.float32) for k, v in state.items()})
    return model.eval()


def calibration_ids(model: torch.nn.Module, tokenizer: CharTokenizer, *, sequences: int = CALIBRATION_SEQUENCES,
                    tokens: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """``[sequences, 1 + tokens]`` ids the fp32 ``model`` samples from BOS at temperature 1
    (special tokens masked, so every position is text), with its own seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((sequences, 1), tokenizer.bos_id, dtype=torch.long)
    special = [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id]
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(input_ids=ids).logits[:, -1].to(torch.float32)
            logits[:, special] = -torch.inf
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def activation_max(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per channel ``max |x|`` of each folded norm's output over ``ids``: ``{state name of the
    norm's weight: [hidden]}``."""
    found: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in FOLDS and ".layers." in f".{name}":
            def record(_m: Any, _inputs: Any, out: torch.Tensor, key: str = f"{name}.weight") -> None:
                found[key] = out.detach().abs().reshape(-1, out.shape[-1]).amax(dim=0).to(torch.float32)
            hooks.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return found


def smooth(state: Mapping[str, torch.Tensor], act_max: Mapping[str, torch.Tensor],
           alpha: float = DEFAULT_ALPHA) -> tuple[dict[str, torch.Tensor], int]:
    """``state`` with every folded norm's weight divided by ``s`` and its readers' input columns
    multiplied by ``s`` (fp32; the same function in exact arithmetic), and how many tensors were
    scaled."""
    out = {k: v.detach().to(torch.float32).clone() for k, v in state.items()}
    scaled = 0
    for norm_name, amax in act_max.items():
        prefix = norm_name[: -len(f"{norm_name.split('.')[-2]}.weight")]
        readers = [prefix + r for r in FOLDS[norm_name.split(".")[-2]] if prefix + r in out]
        if not readers:
            continue
        wmax = torch.stack([out[r].reshape(-1, amax.numel()).abs().amax(dim=0) for r in readers]).amax(dim=0)
        s = (amax.clamp(min=_FLOOR) ** alpha / wmax.clamp(min=_FLOOR) ** (1 - alpha)).clamp(min=_FLOOR)
        out[norm_name] = out[norm_name] / s
        for r in readers:
            out[r] = out[r] * s
        scaled += len(readers)
    return out, scaled


def smoothquant_state(config: PretrainedConfig, state: Mapping[str, torch.Tensor], tokenizer: CharTokenizer,
                      alpha: float = DEFAULT_ALPHA) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The smoothed fp32 state for the int8 checkpoint, and what was done (for the run's record)."""
    model = _model(config, state)
    ids = calibration_ids(model, tokenizer)
    smoothed, scaled = smooth(state, activation_max(model, ids), alpha)
    info = {"method": "SmoothQuant", "alpha": alpha, "scaled_tensors": scaled,
            "folded_into": sorted(FOLDS), "calibration": f"{ids.shape[0]} sequences of {ids.shape[1] - 1} "
                                                          "tokens sampled by the fp32 policy from BOS"}
    return smoothed, info
