"""Number formats a sampler pool can run in: real casts and real fake-quantisation.

A *precision* names the format of the sampler's weights; the arithmetic then runs in
:data:`COMPUTE_DTYPE` of it (FP8 and INT weights are dequantised to bf16, as weight-only
quantised inference kernels do). Quantisation touches the linear weights inside the decoder
layers only: embeddings, norms, MoE routers and the LM head keep the compute dtype, the usual
choice of inference engines (the LM head has its own knob, see ``PoolSpec.lm_head``).
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch

Precision = Literal["fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4", "int3", "int2"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4", "int3", "int2")
Dtype = Literal["fp32", "fp16", "bf16"]

TORCH_DTYPE: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMPUTE_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8_e4m3": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16, "int3": torch.bfloat16,
    "int2": torch.bfloat16,
}
INT_BITS: dict[str, int] = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

# Parameter-name pieces of the decoder-layer linear weights (dense MLP, attention, MoE experts).
_QUANTISED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
              "gate_proj.weight", "up_proj.weight", "down_proj.weight",
              "experts.gate_up_proj", "experts.down_proj")


def is_quantised(name: str) -> bool:
    """Whether a state-dict entry is a decoder-layer linear weight (the part formats change)."""
    return ".layers." in f".{name}" and name.endswith(_QUANTISED)


def fake_quant_fp8_e4m3(w: torch.Tensor) -> torch.Tensor:
    """Round trip through float8_e4m3fn with one scale per output row (amax -> 448)."""
    w32 = w.to(torch.float32)
    scale = w32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (w32 / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def fake_quant_int(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Symmetric integer quantisation in groups of ``group_size`` along the input dimension."""
    w32 = w.to(torch.float32)
    n_in = w32.shape[-1]
    g = group_size if n_in % group_size == 0 else n_in   # fall back to per-row groups
    grouped = w32.reshape(*w32.shape[:-1], n_in // g, g)  # [..., groups, g]
    q_max = 2 ** (bits - 1) - 1
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / q_max
    q = torch.round(grouped / scale).clamp(-q_max - 1, q_max)
    return (q * scale).reshape(w32.shape)


def quantise_weight(w: torch.Tensor, precision: str, group_size: int = 32) -> torch.Tensor:
    """The fp32 values a weight takes in ``precision`` (before the cast to the compute dtype)."""
    if precision == "fp8_e4m3":
        return fake_quant_fp8_e4m3(w)
    if precision in INT_BITS:
        return fake_quant_int(w, INT_BITS[precision], group_size)
    if precision in TORCH_DTYPE:
        return w
    raise ValueError(f"expected a precision in {PRECISIONS}, got {precision!r}")


def format_state(state: Mapping[str, torch.Tensor], precision: str, group_size: int = 32) -> dict[str, torch.Tensor]:
    """A state dict whose decoder-layer linear weights are rounded to ``precision``.

    The result is fp32 (or the input dtype); loading it into a model whose parameters have the
    compute dtype performs the final cast.
    """
    return {name: quantise_weight(t, precision, group_size) if is_quantised(name) else t
            for name, t in state.items()}


def cast_lm_head(model: torch.nn.Module, dtype: torch.dtype) -> torch.utils.hooks.RemovableHandle:
    """Run the model's LM head in ``dtype``; its input is cast on the way in.

    Returns the pre-hook's handle. The logits come out in ``dtype``; generation casts them to
    fp32 before the softmax, as inference engines do.
    """
    head = model.get_output_embeddings()
    head.to(dtype)

    def cast_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0].to(dtype),) + args[1:]

    return head.register_forward_pre_hook(cast_input)
