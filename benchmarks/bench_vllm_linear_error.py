"""How far a vLLM pool's linear layers are from their format's own rounding, layer by layer.

    python benchmarks/bench_vllm_linear_error.py [--precision int8] [--seed 0]

Starts one pool in ``--precision`` (int8, fp8_e4m3 or bf16) from a freshly built toy policy and
feeds random bf16 inputs through each linear layer of its first decoder layer inside the engine.
Each output is compared with the exact fp32 product of the trainer's weights (relative error,
Frobenius norm), beside references computed here: the format itself (int8 W8A8: symmetric
per-token int8 activations, per-channel int8 weights with bf16 scales, exact integer products;
FP8 W8A8: per-token and per-channel float8_e4m3 scaled to 448, fp32 products) and a bf16 matmul.
An engine far above its format's own error has a lossy kernel. Needs vLLM (``make install-vllm``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from mismatch_monitor.sim import PoolSpec  # noqa: E402
from mismatch_monitor.sim.policy import PolicyShape, build_model, model_config  # noqa: E402
from mismatch_monitor.sim.scenarios import VLLM_POLICY  # noqa: E402
from mismatch_monitor.sim.tokenizer import CharTokenizer  # noqa: E402
from mismatch_monitor.sim.vllm_pool import VllmPoolSampler  # noqa: E402


def int8_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xs = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    ws = (w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127).to(torch.bfloat16).float()
    return (torch.round(x / xs).clamp(-128, 127) @ torch.round(w / ws).clamp(-128, 127).T) * xs * ws.T


def fp8_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    def e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t / scale).to(torch.float8_e4m3fn).to(torch.float32), scale
    (xq, xs), (wq, ws) = e4m3(x), e4m3(w)
    return (xq @ wq.T) * xs * ws.T


FORMAT = {"int8": int8_w8a8, "fp8_e4m3": fp8_w8a8, "bf16": lambda x, w: x.bfloat16() @ w.T.bfloat16()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=sorted(FORMAT), default="int8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = CharTokenizer("abcdefgh")
    cfg = model_config(PolicyShape(**VLLM_POLICY), tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    torch.manual_seed(args.seed)
    state = build_model(cfg).state_dict()
    layer = "model.layers.0."
    weights = {
        "qkv_proj": torch.cat([state[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o_proj": state[f"{layer}self_attn.o_proj.weight"],
        "gate_up_proj": torch.cat([state[f"{layer}mlp.gate_proj.weight"], state[f"{layer}mlp.up_proj.weight"]]),
        "down_proj": state[f"{layer}mlp.down_proj.weight"],
    }

    def measure(model: torch.nn.Module) -> list[tuple[str, str, int, float, float, float]]:
        block = model.model.layers[0]
        modules = {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
                   "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}
        gen = torch.Generator().manual_seed(args.seed)
        rows = []
        for name, module in modules.items():
            w = weights[name]
            for tokens in (1, 40):
                x = torch.randn(tokens, w.shape[1], generator=gen).to(torch.bfloat16)
                out = module(x)
                out = out[0] if isinstance(out, tuple) else out
                exact = x.float() @ w.T

                def rel(y: torch.Tensor) -> float:
                    return float((y.float() - exact).norm() / exact.norm())
                kernel = getattr(getattr(module, "scheme", None), "kernel", None)
                path = getattr(getattr(kernel, "linear_method", None), "__name__", "")
                method = kernel if kernel is not None else getattr(module, "quant_method", None)
                rows.append((name, f"{type(method).__name__} {path}".strip(), tokens, rel(out),
                             rel(FORMAT[args.precision](x.float(), w)), rel(x @ w.T.to(torch.bfloat16))))
        return rows

    spec = PoolSpec(args.precision, precision=args.precision, backend="vllm", engine="vllm")  # type: ignore[arg-type]
    sampler = VllmPoolSampler(spec, cfg, tok)
    try:
        sampler.load(state, 0, args.precision)
        rows = sampler._llm.apply_model(measure)[0]
    finally:
        sampler.close()
    print("relative error against the exact fp32 product:")
    print(f"{'layer':13} {'kernel':50} {'tokens':>6} {'engine':>9} {'format':>9} {'bf16':>9}")
    for name, kernel, tokens, engine, fmt, bf16 in rows:
        print(f"{name:13} {kernel:50} {tokens:6d} {engine:9.2e} {fmt:9.2e} {bf16:9.2e}")


if __name__ == "__main__":
    main()
