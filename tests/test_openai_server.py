"""OpenAI-compatible ingestion against a real vLLM server subprocess on 127.0.0.1.

The server (``python -m vllm.entrypoints.openai.api_server``, started once for the module and
stopped through its process group) serves a toy fp32 Qwen3 written from a seeded config with the
character tokenizer. What is checked: its ``/v1/completions`` token ids and log-probs, aligned to
the trainer's tokens, agree fully and give the same statistics as an in-process engine on the
same prompts and seeds (and both are at fp32 rounding against the torch recompute); the chat
endpoint's ids agree too; a planted retokenization (two tokens merged, as a BPE merge does) is
reported at CRITICAL with its first position and gets NaN sampler log-probs, and
``log_agreement`` keeps it in the run (outcome rows per pool and turn, a counted error with its
text) where DuckDB and ``summary`` read it back. The in-process engine runs while the server
boots. Runtime: 1.5-3 min, most of it the server's start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

from mismatch_monitor.collectors import MismatchCollector  # noqa: E402
from mismatch_monitor.openai_ingest import agreement_report, align_to_trainer, parse_response  # noqa: E402
from mismatch_monitor.sim.policy import PolicyShape, build_model, model_config  # noqa: E402
from mismatch_monitor.sim.task import StringTask  # noqa: E402
from mismatch_monitor.sim.tokenizer import CharTokenizer  # noqa: E402
from mismatch_monitor.sim.vllm_checkpoint import write_model_dir  # noqa: E402

torch.set_num_threads(1)
TEMPERATURE, MAX_TOKENS, SEED = 0.9, 10, 5
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    tok = CharTokenizer("abcdefgh")
    config = model_config(PolicyShape(head_dim=32), tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    torch.manual_seed(0)
    model = build_model(config)
    directory = write_model_dir(tmp_path_factory.mktemp("toy") / "model", config, tok,
                                {k: v.detach() for k, v in model.state_dict().items()}, "fp32")
    episodes = StringTask().sample(12, torch.Generator().manual_seed(2), tok.alphabet)
    prompts = [[tok.bos_id] + tok.encode(ep.prompt()) for ep in episodes]
    return tok, model, directory, prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(toy, tmp_path_factory):
    """The server, starting (1-3 min): the in-process engine below runs while it boots."""
    _, _, directory, _ = toy
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(directory), "--served-model-name", "toy", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "32",
           "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def local(toy, server_process):
    """The same prompts and seeds through an in-process engine of the same model (while the
    server boots): each sequence's sampled ids and log-probs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _, _, directory, prompts = toy
    llm = LLM(model=str(directory), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              block_size=32, max_model_len=256, logprobs_mode="processed_logprobs", seed=0)
    try:
        params = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, logprobs=0, seed=SEED)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [torch.tensor([step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]
    return ids, logprobs


@pytest.fixture(scope="module")
def server(server_process, local):
    proc, url, log_path = server_process
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM server did not answer in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(1)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def completions(server: str, prompts: list[list[int]]) -> dict:
    return post(f"{server}/v1/completions", {"model": "toy", "prompt": prompts, "max_tokens": MAX_TOKENS,
                                             "temperature": TEMPERATURE, "logprobs": 0, "seed": SEED,
                                             "return_token_ids": True})


def trainer_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float() / TEMPERATURE, -1)[0]
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]                                  # [T]


def collector_k3(tmp_path, trainer: list[torch.Tensor], sampler: list[torch.Tensor]) -> float:
    offsets = torch.tensor([0] + [len(t) for t in trainer]).cumsum(0)
    with MismatchCollector(tmp_path / "run") as c:
        report = c.log_step(0, trainer_logprobs=torch.cat(trainer), sampler_logprobs=torch.cat(sampler),
                            seq_offsets=offsets)
    return report["mismatch/k3_kl"]


@pytest.fixture(scope="module")
def server_batch(server, toy):
    _, _, _, prompts = toy
    responses = parse_response(completions(server, prompts))
    assert len(responses) == len(prompts)
    return responses


def test_server_path_equals_in_process_path(server_batch, local, toy, tmp_path):
    _, model, _, prompts = toy
    ids = [list(r.token_ids) for r in server_batch]
    aligned = align_to_trainer(server_batch, ids, pools=["server"] * len(ids), turns=[0] * len(ids))
    assert agreement_report(aligned.agreement)["mismatch/pool=server/token_id_agreement"] == 1.0
    local_ids, local = local
    assert local_ids == ids                              # same engine, same seeds: the same tokens
    for a, b in zip(aligned.sampler_logprobs, local):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a, b)
    trainer = [trainer_logprobs(model, p, r) for p, r in zip(prompts, ids)]
    k3_server = collector_k3(tmp_path / "server", trainer, aligned.sampler_logprobs)
    k3_local = collector_k3(tmp_path / "local", trainer, local)
    assert math.isclose(k3_server, k3_local, rel_tol=1e-3, abs_tol=1e-12)
    assert k3_server < 1e-9                              # fp32 engine vs fp32 torch: rounding level


def test_chat_endpoint_ids_agree(server, toy):
    tok, _, _, prompts = toy
    text = tok.decode(prompts[0][1:])
    body = post(f"{server}/v1/chat/completions", {
        "model": "toy", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE, "logprobs": True, "seed": SEED, "return_token_ids": True})
    (response,) = parse_response(body)
    assert response.prompt_token_ids == tuple(prompts[0])           # the template adds BOS only
    aligned = align_to_trainer([response], [list(response.token_ids)], pools=["chat"], turns=[0])
    assert aligned.agreement[("chat", 0)].agreement == 1.0
    assert torch.isfinite(aligned.sampler_logprobs[0]).all()


def test_planted_retokenization_is_critical(server_batch, caplog):
    longest = max(range(len(server_batch)), key=lambda i: len(server_batch[i].token_ids))
    sampled = list(server_batch[longest].token_ids)
    assert len(sampled) >= 4
    merged = sampled[:1] + [99] + sampled[3:]          # tokens 1 and 2 merged into one id
    trainer = [list(r.token_ids) for r in server_batch]
    trainer[longest] = merged
    with caplog.at_level(logging.CRITICAL, logger="mismatch_monitor.openai_ingest"):
        aligned = align_to_trainer(server_batch, trainer, pools=["server"] * len(trainer),
                                   turns=[0] * len(trainer))
    cell = aligned.agreement[("server", 0)]
    assert cell.n_sequences_differing == 1 and cell.first_differences == [1]
    assert cell.agreement is not None and cell.agreement < 1.0
    assert any(r.levelno == logging.CRITICAL and "position 1" in r.getMessage() for r in caplog.records)
    assert torch.isnan(aligned.sampler_logprobs[longest][1:]).any()
    assert torch.isfinite(aligned.sampler_logprobs[longest][:1]).all()


def test_token_id_agreement_is_kept_in_the_run(server_batch, toy, tmp_path, capsys):
    """Through the real server's response: the agreement per pool and turn lands in the run's
    outcomes, and the planted retokenization as a counted error with its text, read back by
    DuckDB (query readers) and shown by ``summary``."""
    from mismatch_monitor import query
    from mismatch_monitor.cli import main
    from mismatch_monitor.openai_ingest import log_agreement
    from mismatch_monitor.query.events import run_outcomes

    tok, model, _, prompts = toy
    planted = max(range(len(server_batch)), key=lambda i: len(server_batch[i].token_ids))
    sampled = list(server_batch[planted].token_ids)
    merged = sampled[:1] + [(sampled[1] + 1) % tok.vocab_size] + sampled[3:]   # tokens 1 and 2 merged
    trainer_ids = [list(r.token_ids) for r in server_batch]
    trainer_ids[planted] = merged
    pools = ["planted" if i == planted else "clean" for i in range(len(server_batch))]
    aligned = align_to_trainer(server_batch, trainer_ids, pools=pools, turns=[0] * len(pools))
    run_dir = tmp_path / "run"
    trainer = [trainer_logprobs(model, p, r) for p, r in zip(prompts, trainer_ids)]
    with MismatchCollector(run_dir) as c:
        log_agreement(c, 0, aligned.agreement)
        c.log_step(0, trainer_logprobs=torch.cat(trainer), sampler_logprobs=torch.cat(aligned.sampler_logprobs),
                   seq_offsets=torch.tensor([0] + [len(t) for t in trainer]).cumsum(0),
                   labels={"pool": pools})
    con = query.connect()
    outcomes = run_outcomes(con, run_dir)
    stored = {(r.pool, r.name): r.value for r in outcomes.itertuples(index=False)}
    agreeing = sum(a == b for a, b in zip(merged, sampled))           # counted here, position by position
    assert stored[("planted", "token_id_agreement")] == agreeing / len(merged) < 1.0
    assert stored[("planted", "token_id_agreement/turn=0")] == agreeing / len(merged)
    assert stored[("planted", "token_ids_compared")] == len(merged)
    assert stored[("planted", "sequences_with_token_id_difference")] == 1.0
    clean_tokens = sum(len(t) for i, t in enumerate(trainer_ids) if i != planted)
    assert stored[("clean", "token_id_agreement")] == 1.0
    assert stored[("clean", "token_ids_agreeing")] == stored[("clean", "token_ids_compared")] == clean_tokens
    assert stored[("clean", "sequences_with_token_id_difference")] == 0.0
    errors = query.collector_errors(con, run_dir)
    found = errors[errors["kind"] == "TokenIdMismatch"]
    assert len(found) == 1 and found["step"].tolist() == [0]
    message = found["message"].iloc[0]
    assert message.startswith("pool planted turn 0: 1 of 1 sequences differ") and "[1]" in message
    assert int(query.steps_index(con, run_dir)["collector_errors"].max()) >= 1
    assert main(["summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "TokenIdMismatch: pool planted turn 0" in out and "token_id_agreement" in out
