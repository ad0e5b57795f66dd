"""The trainer's weights as a checkpoint a vLLM engine loads: a model directory, or a stream.

A vLLM pool starts from a Hugging Face model directory (config, safetensors, tokenizer files,
all written here, nothing downloaded) and is synced afterwards with the same tensors streamed
through ``reload_weights``. Both carry the pool's format in *checkpoint* form:

* ``fp32`` / ``fp16`` / ``bf16`` / ``fp8_e4m3``: the fp32 weights; the engine casts them to its
  dtype, and for ``fp8_e4m3`` quantizes the linear layers itself (online ``fp8_per_channel``:
  FP8 weights with one scale per output channel, FP8 activations with one scale per token).
* ``int8``: compressed-tensors W8A8 (int8 weights, one scale per output channel; int8
  activations quantized per token at run time).
* ``int4``: compressed-tensors W4A16 (int4 weights packed eight to an int32, one scale per 32
  inputs; bf16 activations).
* ``int4_dequantized``: the same int4 grid (the same integers and bf16 scales) multiplied out
  into plain weights for a bf16 engine: what a W4A16 kernel computes (dequantize, then a bf16
  matmul), for a CPU whose vLLM build has no W4A16 kernel (``vllm_pool`` records that it ran so).

The quantized linear weights are the decoder layers' projections; embeddings, norms, routers
and the LM head stay in the engine's dtype (the usual choice, as in the torch pools).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .numerics import is_quantised
from .tokenizer import BOS, EOS, PAD, CharTokenizer

# precision -> (engine dtype, online quantization method or None)
ENGINE_FORMAT: dict[str, tuple[str, str | None]] = {
    "fp32": ("float32", None), "fp16": ("float16", None), "bf16": ("bfloat16", None),
    "fp8_e4m3": ("bfloat16", "fp8_per_channel"), "int8": ("bfloat16", None), "int4": ("bfloat16", None),
    "int4_dequantized": ("bfloat16", None),
}
INT4_GROUP = 32


def _scheme(precision: str) -> dict[str, Any] | None:
    """The compressed-tensors ``quantization_config`` of an offline-quantized format."""
    if precision == "int8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        group = {"targets": ["Linear"], "weights": weights,
                 "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                       "strategy": "token", "dynamic": True}}
        fmt = "int-quantized"
    elif precision == "int4":
        group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": INT4_GROUP,
                                                    "dynamic": False}}
        fmt = "pack-quantized"
    else:
        return None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def _int8_channel(w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0          # [out, 1]
    yield "weight", torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    yield "weight_scale", scale.to(torch.bfloat16)


def int4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 of ``w`` ``[out, in]`` in groups of 32 inputs: the integers ``[out, in]``
    (int8 in -8..7) and the bf16 scales ``[out, in / 32]`` the checkpoint stores."""
    out_dim, in_dim = w.shape
    if in_dim % INT4_GROUP:
        raise ValueError(f"expected int4 linear inputs divisible by {INT4_GROUP}, got {tuple(w.shape)}")
    grouped = w.reshape(out_dim, in_dim // INT4_GROUP, INT4_GROUP)            # [out, groups, 32]
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7.0
    q = torch.round(grouped / scale).clamp(-8, 7).to(torch.int8).reshape(out_dim, in_dim)
    return q, scale.squeeze(-1).to(torch.bfloat16)


def _int4_group(w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, scale = int4_grid(w)
    yield "weight_packed", pack_to_int32(q, 4)                                 # [out, in / 8]
    yield "weight_scale", scale                                                # [out, groups]
    yield "weight_shape", torch.tensor(list(w.shape), dtype=torch.int64)


def _int4_dequantized(w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    q, scale = int4_grid(w)
    yield "weight", (q.to(torch.float32).reshape(*scale.shape, INT4_GROUP)
                     * scale.to(torch.float32).unsqueeze(-1)).reshape(w.shape)


def checkpoint_weights(state: Mapping[str, torch.Tensor], precision: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the trainer's fp32 ``state`` in ``precision``'s checkpoint form."""
    if precision not in ENGINE_FORMAT:
        raise ValueError(f"expected a vLLM pool precision in {sorted(ENGINE_FORMAT)}, got {precision!r}")
    quantise = {"int8": _int8_channel, "int4": _int4_group, "int4_dequantized": _int4_dequantized}.get(precision)
    for name, tensor in state.items():
        w = tensor.detach().to(torch.float32)
        if quantise is None or not (is_quantised(name) and name.endswith(".weight") and w.ndim == 2):
            yield name, w
            continue
        prefix = name[: -len("weight")]
        for suffix, part in quantise(w):
            yield prefix + suffix, part


def _tokenizer_files(directory: Path, tokenizer: CharTokenizer) -> None:
    """A Hugging Face fast tokenizer with the same ids as :class:`CharTokenizer` (one per char)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tokenizer.tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    # a chat request becomes BOS + the messages' text, so /v1/chat/completions works on the toy
    fast.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(directory)


def write_model_dir(directory: Path, hf_config: Any, tokenizer: CharTokenizer,
                    state: Mapping[str, torch.Tensor], precision: str) -> Path:
    """Write config, weights (in ``precision``'s checkpoint form) and tokenizer to ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config.to_dict()
    config.pop("_attn_implementation", None)
    config["torch_dtype"] = "float32"
    # a config built in memory names no class; vLLM picks the model class from this list
    config["architectures"] = ["Qwen3MoeForCausalLM" if config.get("model_type") == "qwen3_moe" else "Qwen3ForCausalLM"]
    scheme = _scheme(precision)
    if scheme is not None:
        config["quantization_config"] = scheme
    (directory / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tensors = {name: t.contiguous() for name, t in checkpoint_weights(state, precision)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer_files(directory, tokenizer)
    return directory
