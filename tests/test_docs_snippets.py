"""Every Python snippet of README.md and docs/*.md, extracted and run as it is written, with small
real inputs this module provides for the names a snippet leaves to the reader (a loader of
batches, a trainer's log-probs that require grad, a tiny TRL model, ranks of a process group,
label values that are not plain pool names). Then what the snippet claims is checked against an
independent float64 reference or the stored run. A snippet without a runner here fails
``test_every_snippet_has_a_runner``, so a new one cannot go untested.

Runtime: about 2 min on a quiet machine (the simulator snippet's 40 MoE steps and its warm start, TRL,
two gloo ranks).
"""

from __future__ import annotations

import math
import os
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp

from mismatch_monitor import query

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ODD_POOLS = ["fp8", "bf16", "int4/awq", None, "fp8", "%odd pool"]   # undeclared, a slash, a null


def snippets() -> dict[tuple[str, str, int], str]:
    """``(file, section heading, n-th python block in it) -> code``."""
    out: dict[tuple[str, str, int], str] = {}
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            headings = re.findall(r"^#+ (.+)$", text[:block.start()], re.M)
            section = headings[-1] if headings else ""
            n = sum(1 for key in out if key[:2] == (path.name, section))
            out[(path.name, section, n)] = block.group(1)
    return out


def run_snippet(key: tuple[str, str, int], namespace: dict[str, Any]) -> dict[str, Any]:
    code = snippets()[key]
    exec(compile(code, f"{key[0]} ({key[1]}) snippet {key[2]}", "exec"), namespace)
    return namespace


# ---- small real inputs ---------------------------------------------------------------------

class TinyPolicy(torch.nn.Module):
    """A one-layer language model: the trainer scores in fp32 with gradients, the sampler with
    its weights rounded to bf16 (a real, small numeric mismatch)."""

    def __init__(self, vocab: int = 24, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def logprobs(self, tokens: torch.Tensor, *, rounded: bool = False) -> torch.Tensor:
        emb, weight, bias = self.embed.weight, self.head.weight, self.head.bias
        if rounded:
            emb, weight, bias = (x.detach().to(torch.bfloat16).float() for x in (emb, weight, bias))
        logits = torch.nn.functional.embedding(tokens[:, :-1], emb) @ weight.T + bias   # [B, T-1, V]
        logits = torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)           # [B, T, V]
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]      # [B, T]


class Batch:
    """What a rollout loader yields: tokens, the sampler's log-probs, a response mask, pools."""

    def __init__(self, policy: TinyPolicy, seed: int, pools: list[str | None]) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 24, (len(pools), 12), generator=g)
        with torch.no_grad():
            self.rollout_logprobs = policy.logprobs(self.tokens, rounded=True)
        lengths = torch.randint(3, 13, (len(pools),), generator=g)
        self.response_mask = torch.arange(12)[None, :] < lengths[:, None]
        self.pools = pools


class Wandb:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, report: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(report)))


def k3_by_pool(pairs: list[tuple[torch.Tensor, Batch]]) -> dict[str | None, float]:
    """float64 reference: mean(rho - 1 - lr) over the valid tokens of each pool."""
    sums: dict[str | None, list[float]] = {}
    for pi, batch in pairs:
        lr = pi.detach().double().numpy() - batch.rollout_logprobs.double().numpy()
        k3 = np.expm1(lr) - lr
        for i, pool in enumerate(batch.pools):
            valid = batch.response_mask[i].numpy()
            acc = sums.setdefault(pool, [0.0, 0.0])
            acc[0] += float(k3[i][valid].sum())
            acc[1] += float(valid.sum())
    return {pool: s / n for pool, (s, n) in sums.items()}


def stored_k3(run_dir: Path, steps: tuple[int, int] | None = None) -> dict[str | None, float]:
    df = query.metric_series(query.connect(), run_dir, ["pool"], metrics=["mismatch/k3_kl"],
                             steps=steps, per_step=False)
    return {None if pd.isna(p) else p: float(v) for p, v in zip(df["pool"], df["mismatch/k3_kl"])}


def assert_no_collector_errors(run_dir: Path, reports: list[dict[str, float]]) -> None:
    errors = [r.get("mismatch/collector_errors", 0.0) for r in reports]
    stored = query.steps_index(query.connect(), run_dir)["collector_errors"].tolist()
    assert not any(errors) and not any(stored), (errors, stored, reports[:1])


# ---- the snippets ---------------------------------------------------------------------------

def readme_attach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    policy = TinyPolicy()
    loader = [Batch(policy, seed, ODD_POOLS) for seed in range(3)]
    scored: list[tuple[torch.Tensor, Batch]] = []

    def trainer_logprobs(batch: Batch) -> torch.Tensor:
        pi = policy.logprobs(batch.tokens)          # from the loss's forward: requires grad
        assert pi.requires_grad
        scored.append((pi, batch))
        return pi

    wandb = Wandb()
    run_snippet(("README.md", "Attach to your loop", 0),
                {"loader": loader, "trainer_logprobs": trainer_logprobs, "wandb": wandb})
    run_dir = tmp_path / "runs" / "exp1"
    assert_no_collector_errors(run_dir, [r for _, r in wandb.logged])
    assert [s for s, _ in wandb.logged] == [0, 1, 2]
    assert "mismatch/k3_kl" in wandb.logged[0][1]
    idx = query.steps_index(query.connect(), run_dir)
    assert idx["n_tokens"].tolist() == [int(b.response_mask.sum()) for b in loader]
    want = k3_by_pool(scored)
    got = stored_k3(run_dir)
    assert set(got) == set(want)                    # None stays its own pool, "int4/awq" too
    for pool, value in want.items():
        assert got[pool] == pytest.approx(value, rel=1e-5, abs=1e-12), pool


def alerts_exporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_snippet(("ALERTS.md", "The exporter", 0), {})
    exporter, collector = ns["exporter"], ns["collector"]
    try:
        policy = TinyPolicy()
        batch = Batch(policy, 0, ODD_POOLS)
        report = collector.log_step(0, trainer_logprobs=policy.logprobs(batch.tokens),
                                    sampler_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                                    labels={"pool": batch.pools})
        assert not report.get("mismatch/collector_errors"), report
        with urllib.request.urlopen(f"http://127.0.0.1:{ns['port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        totals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("mismatch_tokens_total{")]
        assert sum(totals) == int(batch.response_mask.sum())
    finally:
        collector.close()
        exporter.stop()


def integrations_step_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    policy = TinyPolicy()
    batch = Batch(policy, 0, ODD_POOLS)
    pi = policy.logprobs(batch.tokens)              # requires grad, as from the loss's forward
    wandb = Wandb()
    run_snippet(("INTEGRATIONS.md", "Any training loop: the step hook", 0), {
        "num_steps": 2, "micro_batches": [0, 1], "pi": pi, "mu": batch.rollout_logprobs,
        "mask": batch.response_mask, "pools": batch.pools, "versions": [0] * len(ODD_POOLS),
        "optimizer": torch.optim.SGD(policy.parameters(), lr=0.1), "wandb": wandb})
    run_dir = tmp_path / "runs" / "exp1"
    assert_no_collector_errors(run_dir, [r for _, r in wandb.logged])
    idx = query.steps_index(query.connect(), run_dir)
    assert idx["n_tokens"].tolist() == [2 * int(batch.response_mask.sum())] * 2   # two micro-batches a step
    want = k3_by_pool([(pi, batch)])
    got = stored_k3(run_dir, steps=(0, 0))
    assert set(got) == set(want)
    for pool, value in want.items():
        assert got[pool] == pytest.approx(value, rel=1e-5, abs=1e-12), pool


def integrations_trl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TRL snippet on a tiny Llama in fp32 at temperature 0.7: sampler and
    trainer then score the same distribution, so |lr| stays at float rounding."""
    from datasets import Dataset
    from trl import GRPOConfig

    from test_trl_grpo import WORDS, model, reward, tokenizer

    monkeypatch.chdir(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                      bf16=False, save_strategy="no", seed=0, temperature=0.7, learning_rate=1e-2)
    dataset = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3]) for i in range(8)]})
    run_snippet(("INTEGRATIONS.md", "TRL (`GRPOTrainer`, TRL 1.x)", 0), {
        "model": model(), "reward": reward, "training_args": args, "dataset": dataset,
        "tokenizer": tokenizer()})
    run_dir = tmp_path / "runs" / "grpo"
    idx = query.steps_index(query.connect(), run_dir)
    assert len(idx) == 2 and (idx["n_tokens"] > 0).all() and not idx["collector_errors"].any(), idx
    mean_abs = query.metric_series(query.connect(), run_dir, metrics=["mismatch/abs_log_ratio/mean"],
                                   per_step=False)["mismatch/abs_log_ratio/mean"].iloc[0]
    assert mean_abs < 1e-4, f"mean |lr| {mean_abs:.3g} in fp32: the sampler side is not what was sampled from"


def _rank(rank: int, port: int, run_root: str) -> None:
    os.chdir(run_root)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    ns = run_snippet(("INTEGRATIONS.md", "Several ranks", 0), {"exporter": None})
    policy = TinyPolicy()
    batch = Batch(policy, rank, ODD_POOLS[rank::2])
    ns["collector"].log_step(0, trainer_logprobs=policy.logprobs(batch.tokens),
                             sampler_logprobs=batch.rollout_logprobs, response_mask=batch.response_mask,
                             labels={"pool": batch.pools})
    ns["collector"].close()
    ns["dist"].destroy_process_group()


def integrations_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    policy = TinyPolicy()
    batches = [Batch(policy, rank, ODD_POOLS[rank::2]) for rank in range(2)]
    idx = query.steps_index(query.connect(), tmp_path / "runs" / "exp1")
    assert idx["n_tokens"].tolist() == [sum(int(b.response_mask.sum()) for b in batches)]   # both ranks
    want = k3_by_pool([(policy.logprobs(b.tokens), b) for b in batches])
    got = stored_k3(tmp_path / "runs" / "exp1")
    assert set(got) == set(want)
    for pool, value in want.items():
        assert got[pool] == pytest.approx(value, rel=1e-5, abs=1e-12), pool


def simulator_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_snippet(("SIMULATOR.md", "The simulator: a small RL system with genuine mismatch", 0), {})
    run_dir = tmp_path / "runs" / "sim"
    idx = query.steps_index(query.connect(), run_dir)
    assert len(idx) == 40 and (idx["n_tokens"] > 0).all() and not idx["collector_errors"].any()
    assert len(ns["sim"].config.pools) > 1
    alerts = query.rows(query.connect(), run_dir, "alerts")
    resyncs = alerts[(alerts["state"] == "firing") & alerts["resync"].astype(bool)]
    assert len(resyncs) and resyncs["step"].min() >= 20, alerts   # the fault's pool, once it starts


def simulator_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = run_snippet(("SIMULATOR.md", "What the formats give (measured)", 0), {})
    lr = ns["lr"]
    assert lr.shape == tuple(ns["batch"].trainer_logprobs.shape) and np.isfinite(lr).any()


def integrations_fingerprints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snippet as written against a real in-process vLLM engine serving a tiny Qwen3: a push
    of the trainer's weights is an ordinary sync that the engine really loaded; the same code
    pushing version 0's buffer again is recorded as the pool holding version 0."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from mismatch_monitor.collectors import MismatchCollector
    from mismatch_monitor.fingerprint import weights_fingerprint
    from mismatch_monitor.sim import PoolSpec
    from mismatch_monitor.sim.policy import PolicyShape, build_model, model_config
    from mismatch_monitor.sim.scenarios import VLLM_POLICY
    from mismatch_monitor.sim.tokenizer import CharTokenizer
    from mismatch_monitor.sim.vllm_pool import VllmPoolSampler

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = CharTokenizer("abcdefgh")
    config = model_config(PolicyShape(**VLLM_POLICY), tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    torch.manual_seed(0)
    model = build_model(config)
    wire0 = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}
    pool = VllmPoolSampler(PoolSpec("fp8", precision="bf16", backend="vllm", engine="vllm"), config, tok)
    try:
        pool.load(model.state_dict(), 0, "bf16")                          # the engine starts on version 0
        with MismatchCollector(tmp_path / "run", alert_evaluator=None) as mc:
            mc.log_event("weight_sync", step=0, pool="fp8", version=0, trainer_fingerprint=weights_fingerprint(wire0))
            with torch.no_grad():                                       # a training step moves every weight
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            right = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}
            for v, pushed in ((1, right), (2, wire0)):                  # then a stale buffer sent again
                run_snippet(("INTEGRATIONS.md", "Weight syncs and training outcomes", 0),
                            {"torch": torch, "model": model, "llm": pool._llm, "mc": mc, "v": v, "pushed": pushed})
                if v == 1:
                    assert mc.errors_by_kind == {}
                    held = pool._llm.apply_model(lambda m: m.model.embed_tokens.weight.detach().float().clone())[0]
                    sent = right["model.embed_tokens.weight"].float()                  # the engine pads the vocab
                    assert torch.equal(held[: sent.shape[0]], sent)                        # it really loaded
            assert mc.errors_by_kind == {"WrongWeights": 1}
    finally:
        pool.close()
        torch.set_num_threads(threads)
    from mismatch_monitor.query.events import run_events

    events = run_events(query.connect(), tmp_path / "run")
    assert events["version"].tolist() == [0, 1, 0, 2]
    assert events["message"].iloc[2].startswith("pool holds version 0's weights")
    assert events["message"].iloc[3].startswith("weights not applied")


RUNNERS: dict[tuple[str, str, int], Callable[[Path, pytest.MonkeyPatch], None]] = {
    ("README.md", "Attach to your loop", 0): readme_attach,
    ("ALERTS.md", "The exporter", 0): alerts_exporter,
    ("INTEGRATIONS.md", "Any training loop: the step hook", 0): integrations_step_hook,
    ("INTEGRATIONS.md", "TRL (`GRPOTrainer`, TRL 1.x)", 0): integrations_trl,
    ("INTEGRATIONS.md", "Several ranks", 0): integrations_ranks,
    ("INTEGRATIONS.md", "Weight syncs and training outcomes", 0): integrations_fingerprints,
    ("SIMULATOR.md", "The simulator: a small RL system with genuine mismatch", 0): simulator_run,
    ("SIMULATOR.md", "What the formats give (measured)", 0): simulator_probe,
}


def test_every_snippet_has_a_runner():
    assert set(snippets()) == set(RUNNERS), "a Python snippet in the docs has no runner here (or one moved)"


@pytest.mark.parametrize("key", list(RUNNERS), ids=lambda k: f"{k[0]}:{k[1]}:{k[2]}")
def test_snippet_runs_as_written(key, tmp_path, monkeypatch):
    RUNNERS[key](tmp_path, monkeypatch)


def test_the_readmes_optional_fields_are_parameters_and_a_misspelt_one_raises(tmp_path):
    """Each optional field the README names is a keyword of ``log_step``; a misspelt one (the
    README: "a mistake in the call ... raises at once") raises even without strict mode."""
    import inspect

    from mismatch_monitor.collectors import MismatchCollector

    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("Optional fields:"):text.index("(`TokenBatch.from_flat`)")]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    assert {"turn_index", "policy_version", "token_ids", "seq_ids"} <= named
    params = set(inspect.signature(MismatchCollector.log_step).parameters)
    assert named <= params, named - params
    policy = TinyPolicy()
    batch = Batch(policy, 0, ODD_POOLS)
    with MismatchCollector(tmp_path / "run") as mc:
        with pytest.raises(TypeError, match="trainer_logprob"):
            mc.log_step(0, trainer_logprob=policy.logprobs(batch.tokens), sampler_logprobs=batch.rollout_logprobs,
                        response_mask=batch.response_mask)
