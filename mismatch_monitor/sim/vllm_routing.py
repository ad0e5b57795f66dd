"""The experts a vLLM MoE engine routed each token to, read from its routers in this process.

vLLM's own capture (``enable_return_routed_experts``) needs Model Runner V2, which needs Triton
(none on the CPU). Its routers take a capture callback, though (``BaseRouter.set_capture_fn``,
which vLLM's capturer itself binds; a private API): it is called with each forward's top-k
expert ids ``[tokens, K]``, per MoE layer, before any expert-parallel remapping. The callback is
a plain Python function, so the ids land in this object only when the engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); with a separate engine process nothing arrives
and :meth:`produced` says so instead of returning nothing.

Which rows belong to which sequence: a forward mixes the scheduled requests' tokens, in an order
the scheduler chooses. A pool that captures routing therefore generates one request at a time
(vLLM on the CPU is batch-invariant: the same sequence alone or in a batch gives bit-identical
log-probs, measured). One request's rows, forward after forward, are its uncached prompt tokens
and then one row per decode step; the token sampled at decode step j comes from the last row of
the forward before it, so the ``n`` sampled tokens come from the last ``n`` rows.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch


class RouterCapture:
    """Binds a capture callback to every MoE router of an in-process ``vllm.LLM``."""

    def __init__(self, llm: Any, top_k: int) -> None:
        self._rows: dict[int, list[torch.Tensor]] = {}
        self.layers: list[int] = []
        self.top_k = top_k
        self.bind(llm)

    def bind(self, llm: Any) -> None:
        """(Re)bind the callbacks (after a start or a weight reload, which may rebuild layers)."""
        layers = sorted(llm.apply_model(self._install)[0])
        if not layers:
            raise RuntimeError("expected MoE routers with a capture callback in the vLLM model, found none")
        if self.layers and layers != self.layers:
            raise RuntimeError(f"expected the MoE layers {self.layers} after a reload, found {layers}")
        self.layers = layers

    def _install(self, model: torch.nn.Module) -> list[int]:
        found = []
        for module in model.modules():
            router = getattr(module, "router", None)
            layer = getattr(module, "layer_id", None)
            if router is not None and layer is not None and hasattr(router, "set_capture_fn"):
                router.set_capture_fn(partial(self._record, int(layer)))
                found.append(int(layer))
        return found

    def _record(self, layer: int, topk_ids: torch.Tensor) -> None:
        # the kernel may reuse its buffer: keep a copy
        self._rows.setdefault(layer, []).append(topk_ids.detach().to(torch.uint8, copy=True))

    def clear(self) -> None:
        self._rows = {}

    def produced(self, n: int) -> torch.Tensor:
        """``[n, L, K]`` uint8: the experts of the positions that produced the last request's
        ``n`` sampled tokens (the last ``n`` rows captured since :meth:`clear`)."""
        if n == 0:
            return torch.zeros((0, len(self.layers), self.top_k), dtype=torch.uint8)
        missing = [layer for layer in self.layers if layer not in self._rows]
        if missing:
            raise RuntimeError(f"no routing arrived from MoE layers {missing}: routing capture needs the "
                               "in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        per_layer = [torch.cat(self._rows[layer]) for layer in self.layers]
        if min(len(rows) for rows in per_layer) < n:
            raise RuntimeError(f"expected at least {n} routed rows per MoE layer, got "
                               f"{[len(rows) for rows in per_layer]}")
        return torch.stack([rows[-n:] for rows in per_layer], dim=1)     # [n, L, K]
