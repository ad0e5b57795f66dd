"""The tiny policy: a toy-sized Qwen3 (dense) or Qwen3-MoE built from a config, no download.

Both sides of the simulated system run the same transformers architecture: the sampler through
``generate`` (KV cache, one token per forward), the trainer through one full forward. For the
MoE variant, :class:`RouterTap` records the top-k expert ids that each layer's router
(``mlp.gate``) picks, in ``generate`` as well as in the trainer's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import (PretrainedConfig, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

Variant = Literal["dense", "moe"]
Attention = Literal["sdpa", "eager"]


@dataclass(frozen=True)
class PolicyShape:
    """Size of the toy policy (defaults: about 0.08M parameters dense, 0.13M MoE).

    Attributes:
        variant: ``dense`` (Qwen3) or ``moe`` (Qwen3-MoE, every layer sparse).
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim: the transformer's shape.
        intermediate_size: MLP width of the dense variant.
        num_experts, experts_per_token, expert_size: MoE router fan-out, top-k and expert width.
        max_positions: longest dialogue (prompt + every turn) the rotary table covers.
    """

    variant: Variant = "dense"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    num_experts: int = 8
    experts_per_token: int = 2
    expert_size: int = 32
    max_positions: int = 256

    def __post_init__(self) -> None:
        if self.variant not in ("dense", "moe"):
            raise ValueError(f"expected variant 'dense' or 'moe', got {self.variant!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "num_experts", "expert_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"expected num_heads divisible by num_kv_heads, got {self.num_heads}, {self.num_kv_heads}")
        if not 1 <= self.experts_per_token <= min(self.num_experts, 255):
            raise ValueError(f"expected 1 <= experts_per_token <= num_experts, got {self.experts_per_token}")
        if self.num_experts > 256:
            raise ValueError(f"expected num_experts <= 256 (ids are shipped as uint8), got {self.num_experts}")


def model_config(shape: PolicyShape, vocab_size: int, pad_id: int, bos_id: int, eos_id: int,
                 attention: Attention = "sdpa") -> PretrainedConfig:
    common = dict(vocab_size=vocab_size, hidden_size=shape.hidden_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                  num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=shape.max_positions, tie_word_embeddings=False,
                  pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, use_cache=True,
                  attn_implementation=attention)
    if shape.variant == "dense":
        return Qwen3Config(intermediate_size=shape.intermediate_size, **common)
    return Qwen3MoeConfig(intermediate_size=shape.intermediate_size, moe_intermediate_size=shape.expert_size,
                          num_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_token,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          output_router_logits=False, **common)


def build_model(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A freshly initialised model of ``config`` in ``dtype`` (the caller seeds torch)."""
    cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
    model = cls(config).to(dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()


class RouterTap:
    """Records each MoE layer's chosen experts while active (a context manager).

    ``calls[c]`` is a ``[L, n, K]`` uint8 tensor for forward call ``c`` (n = batch x positions of
    that call, flattened batch-major as the router sees them). A dense model has no routers:
    :attr:`active` is False and nothing is recorded.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._routers = [layer.mlp.gate for layer in model.model.layers
                         if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k")]
        self._pending: list[torch.Tensor | None] = [None] * len(self._routers)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.calls: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return bool(self._routers)

    @property
    def num_layers(self) -> int:
        return len(self._routers)

    def __enter__(self) -> "RouterTap":
        self.calls = []
        for i, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(module: torch.nn.Module, args: tuple, out: tuple[torch.Tensor, ...]) -> None:
            self._pending[layer] = out[2].detach().to(torch.uint8)      # [n, K]
            if layer == len(self._routers) - 1:                          # last layer closes a call
                self.calls.append(torch.stack(self._pending))            # [L, n, K]
                self._pending = [None] * len(self._routers)
        return record
