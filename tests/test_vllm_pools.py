"""Simulator pools served by real in-process vLLM engines, measured through the collector.

One warm start for the module (``sim``: the faulted fleet, whose engines stay up while the probe
starts and stops one engine per format beside them); every pool is a real vLLM engine started
from the trainer's weights. What is checked: each format's mismatch against the fp32 trainer, on the same
prompts, orders fp32 < fp16 < bf16 < fp8 < int4 with int8 well above fp16, and fp32 is at rounding
level (int8 is not placed against bf16, fp8 and int4: its level is the CPU's int8 kernel's, at
int4's on AVX2 and at bf16's on AVX-512 VNNI, docs/SIMULATOR.md); a truncated
pool's processed log-probs agree with the trainer's own renormalised top-p distribution; the
engine reports the quantization it applied (int4 without a W4A16 kernel says it ran the int4 grid
dequantized in bf16); a smoothed int8 checkpoint serves; a skipped sync and a sync without the prefix-cache
reset each show in that pool only, and a resync (a real weight reload) restores it; a sync that
breaks the weights (int8 reload_weights on the CPU) stops with the pool's name, and the int8
pool's restart sync works beside the other live engines. Runtime: 2.3 min on 2 cores at load
average 5 (one warm start, eleven engine starts); 7.5 min at load 11 with two warm starts.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # before the first engine
os.environ["OMP_NUM_THREADS"] = "1"


import torch  # noqa: E402

from mismatch_monitor.collectors import MismatchCollector  # noqa: E402
from mismatch_monitor.sim import FaultSpec, PoolSpec, SimConfig, Simulation, StringTask  # noqa: E402
from mismatch_monitor.sim import vllm_pool as pool_module  # noqa: E402
from mismatch_monitor.sim import vllm_smoothquant  # noqa: E402
from mismatch_monitor.sim.policy import PolicyShape  # noqa: E402
from mismatch_monitor.sim.scenarios import VLLM_POLICY, VLLM_PREAMBLE  # noqa: E402

torch.set_num_threads(1)
PROBE_EPISODES = 48


def vllm_pool(name: str, precision: str, **extra: object) -> PoolSpec:
    return PoolSpec(name, precision=precision, backend="vllm", engine="vllm", **extra)  # type: ignore[arg-type]


def config(pools: tuple[PoolSpec, ...], **extra: object) -> SimConfig:
    return SimConfig(pools=pools, policy=PolicyShape(**VLLM_POLICY), task=StringTask(preamble=VLLM_PREAMBLE),
                     warmstart_steps=150, **extra)  # type: ignore[arg-type]


def pool_report(report: dict[str, float], pool: str, key: str) -> float:
    return report[f"mismatch/pool={pool}/{key}"]


@pytest.fixture(scope="module")
def sim():
    """The module's one warm start (half of its time on 2 cores): three bf16 pools, a high
    learning rate so weights move; from step 2 one pool's syncs are skipped and another's skip
    the prefix-cache reset. Their engines start with it, on the weights before any update."""
    pools = (vllm_pool("ok", "bf16", prompts=3),
             vllm_pool("skip", "bf16", prompts=3, faults=(FaultSpec("stop_sync", 2),)),
             vllm_pool("noreset", "bf16", prompts=3, faults=(FaultSpec("sync_no_reset", 2),)))
    simulation = Simulation(config(pools, learning_rate=3e-3))
    yield simulation
    simulation.close()


@pytest.fixture(scope="module")
def probe(sim, tmp_path_factory):
    """Every format answers the same prompts once, on the warm-started weights (no update yet:
    ``faulted`` runs after this); the fp32 trainer scores; the collector reports."""
    assert sim.trainer.version == 0
    pools = (vllm_pool("fp32", "fp32"), vllm_pool("fp16", "fp16"), vllm_pool("bf16", "bf16"),
             vllm_pool("int8", "int8"), vllm_pool("fp8", "fp8_e4m3"), vllm_pool("int4", "int4"),
             vllm_pool("topp", "bf16", top_p=0.8), vllm_pool("raw", "bf16", logprobs_mode="raw_logprobs"))
    gen = torch.Generator().manual_seed(11)
    episodes = sim.config.task.sample(PROBE_EPISODES, gen, sim.config.alphabet)
    batch = sim.probe(pools, episodes, seed=3)
    engines = sim.probe_engine_info
    with MismatchCollector(tmp_path_factory.mktemp("probe") / "run", pools={p.name: p.metadata() for p in pools}) as c:
        report = c.log_step(0, batch)
    return report, engines


def test_k3_orders_the_formats_and_fp32_is_rounding(probe):
    report, _ = probe
    k3 = {p: pool_report(report, p, "k3_kl") for p in ("fp32", "fp16", "bf16", "int8", "fp8", "int4")}
    # the order is fp32 < fp16 < bf16 < int8 < fp8 < int4; int8 is left out of the chain
    # but for its floor: its level depends on the CPU's oneDNN kernel. On an AVX2 CPU the per-layer
    # error is 5-7x the W8A8 format's own (measured against exact fp32 products), which puts int8 at
    # int4's level; on an AVX-512 VNNI CPU int8 measured 0.96x bf16 and 0.22x int4 (4.12e-4; 4.31e-4, 1.86e-3)
    assert k3["fp32"] < k3["fp16"] < k3["bf16"] < k3["fp8"], k3
    assert 10 * k3["fp16"] < k3["int8"], k3                  # 380x here: an 8-bit format, not fp16
    assert k3["fp8"] < k3["int4"], k3
    assert k3["fp32"] < 1e-9, k3                        # same weights, fp32 both sides: rounding only
    assert pool_report(report, "fp32", "abs_log_ratio/max") < 1e-3
    assert k3["bf16"] > 1e3 * k3["fp32"]


def test_truncated_pool_matches_the_renormalised_trainer(probe):
    report, _ = probe
    # vLLM's processed log-probs are renormalised over the kept set; an unrenormalised comparison
    # would shift every token by -log(kept mass), ~0.1 or more at top_p 0.8
    assert pool_report(report, "topp", "k3_kl") < 10 * pool_report(report, "bf16", "k3_kl") + 1e-6
    assert abs(pool_report(report, "topp", "k1_kl")) < 0.01
    assert pool_report(report, "topp", "support_mismatch_fraction") < 0.02


def test_engines_report_what_they_applied(probe):
    _, engines = probe
    assert engines["fp32"]["dtype"] == "float32" and engines["fp32"]["quantized_layers"] == 0
    assert engines["bf16"]["dtype"] == "bfloat16" and engines["bf16"]["quantization"] == "none"
    assert engines["int8"]["quantization"] == "compressed-tensors" and engines["int8"]["quantized_layers"] > 0
    assert engines["fp8"]["quantization"] == "fp8_per_channel" and engines["fp8"]["quantized_layers"] > 0
    assert engines["int8"]["smoothing"] == "none"                    # SmoothQuant is opt-in
    int4 = engines["int4"]
    if int4["checkpoint"] == "int4":                                 # this CPU's build has the W4A16 kernel
        assert int4["quantization"] == "compressed-tensors" and int4["quantized_layers"] > 0, int4
    else:                                                            # it has not: said so, not hidden
        assert int4["checkpoint"] == "int4_dequantized" and int4["quantization"] == pool_module.INT4_FALLBACK, int4
        assert int4["quantized_layers"] == 0 and "wna16" in int4["engine_refused"], int4
    assert {p: e["logprobs_mode"] for p, e in engines.items() if e["logprobs_mode"] != "processed_logprobs"} \
        == {"raw": "raw_logprobs"}


def test_raw_logprobs_at_a_temperature_below_1_fire_the_sharpness_gate(probe, sim):
    """vLLM's default log-probs are of the temperature-1 distribution, whatever it sampled at: at the
    simulator's temperature (below 1) the trainer, which scores at that temperature, is sharper than
    what the pool reports, and the sharpness gate fires on that pool's first step; the pools whose
    log-probs are of what they sampled, every format among them, stay below the threshold."""
    from mismatch_monitor.alerts.definitions import SHARPNESS_SHIFT

    report, _ = probe
    assert sim.config.temperature < 1.0
    contrast = {p: pool_report(report, p, "sharpness/contrast_t")
                for p in ("fp32", "fp16", "bf16", "int8", "fp8", "int4", "topp", "raw")}
    threshold = SHARPNESS_SHIFT.condition.threshold
    assert contrast["raw"] > threshold, contrast
    assert not any(v > threshold for p, v in contrast.items() if p != "raw"), contrast   # NaN: unresolved
    assert pool_report(report, "raw", "sharpness/top_rho_shift") > 0 > pool_report(
        report, "raw", "sharpness/low_rho_shift")


@pytest.fixture(scope="module")
def faulted(sim, probe, tmp_path_factory):
    """Six steps of ``sim`` (after the probe, which reads the weights before any update); the
    skipped and the unreset pools are both resynced before step 4."""
    reports, versions = [], []
    with MismatchCollector(tmp_path_factory.mktemp("faults") / "run", pools=sim.pool_metadata()) as c:
        for out in sim.run(6):
            reports.append(c.log_step(out.step, out.batch))
            versions.append(out.batch.policy_version)
            if out.step == 3:
                sim.resync("skip")
                sim.resync("noreset")
    return reports, list(sim.sync_events)


def test_faults_show_in_their_pool_only_and_resync_restores(faulted):
    reports, _ = faulted
    k3 = [{p: pool_report(r, p, "k3_kl") for p in ("ok", "skip", "noreset")} for r in reports]
    for step in (0, 1):                                  # healthy: all three at bf16 level
        assert max(k3[step].values()) < 20 * min(k3[step].values()) + 1e-6, k3[step]
    for step in (2, 3):                                  # faults on: those two pools only
        assert k3[step]["skip"] > 20 * k3[step]["ok"], k3[step]
        assert k3[step]["noreset"] > 5 * k3[step]["ok"], k3[step]
    # no order between steps 2 and 3: the skipped pool's k3 is near 1 nat at both, where which
    # step's prompts read higher is sampling noise (an AMX CPU gave 1.082 then 1.072); that it
    # skipped both syncs is checked on the events below
    # step 4 samples right after the resync: a real reload (and cache reset) of the current weights
    assert k3[4]["skip"] < 20 * k3[4]["ok"] + 1e-6, k3[4]
    assert k3[4]["noreset"] < 20 * k3[4]["ok"] + 1e-6, k3[4]


def test_sync_events_name_what_each_pool_received(faulted):
    _, events = faulted
    kinds = {(e["step"], e["pool"]): e["kind"] for e in events}
    assert kinds[(1, "ok")] == "sync" and kinds[(2, "ok")] == "sync"
    assert kinds[(2, "skip")] == kinds[(3, "skip")] == "sync_skipped" and kinds[(4, "skip")] == "resync"
    assert kinds[(2, "noreset")] == "sync_no_cache_reset" and kinds[(4, "noreset")] == "resync"
    assert kinds[(5, "noreset")] == "sync_no_cache_reset"


def toy_policy():
    from mismatch_monitor.sim.policy import build_model, model_config
    from mismatch_monitor.sim.tokenizer import CharTokenizer

    tok = CharTokenizer("abcdefgh")
    cfg = model_config(PolicyShape(**VLLM_POLICY), tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in build_model(cfg).state_dict().items()}
    episodes = StringTask().sample(4, torch.Generator().manual_seed(0), tok.alphabet)
    return tok, cfg, state, episodes


def test_a_smoothed_int8_checkpoint_serves_and_is_recorded(monkeypatch):
    tok, cfg, state, episodes = toy_policy()
    monkeypatch.setattr(vllm_smoothquant, "ALPHA", 0.5)
    sampler = pool_module.VllmPoolSampler(vllm_pool("int8", "int8"), cfg, tok)
    try:
        sampler.load(state, 0, "int8")
        out = sampler.rollout(episodes, temperature=0.9, max_new_tokens=6, seed=0)
        assert all(torch.isfinite(r.sampler_logprobs).all() and r.sampler_logprobs.numel() for r in out)
        smoothing = sampler.engine_info["smoothing"]
        assert smoothing["method"] == "SmoothQuant" and smoothing["alpha"] == 0.5 and smoothing["scaled_tensors"] == 10
        assert sampler.engine_info["quantized_layers"] > 0
    finally:
        sampler.close()


def test_a_sync_that_breaks_the_weights_is_loud_and_int8_syncs_by_restart(monkeypatch):
    """reload_weights of a compressed-tensors int8 checkpoint gives NaN log-probs on the CPU, or
    finite ones that differ from a fresh engine's on the same weights: the pool must say so at
    the sync when its probe sees NaN, and the restart sync int8 takes must give the fresh
    engine's log-probs."""
    tok, cfg, state, episodes = toy_policy()
    spec = vllm_pool("int8", "int8")
    sampler = pool_module.VllmPoolSampler(spec, cfg, tok)
    try:
        sampler.load(state, 0, "int8")
        first = sampler.rollout(episodes, temperature=0.9, max_new_tokens=6, seed=0)
        sampler.load(state, 1, "int8")                  # the restart sync
        again = sampler.rollout(episodes, temperature=0.9, max_new_tokens=6, seed=0)
        assert all(torch.equal(a.sampler_logprobs, b.sampler_logprobs) for a, b in zip(first, again))
        assert sampler.engine_info["sync"] == "engine restart"
        restart = pool_module.RESTART_ON_SYNC
        monkeypatch.setattr(pool_module, "RESTART_ON_SYNC", frozenset())
        try:
            sampler.load(state, 2, "int8")
        except RuntimeError as exc:
            assert re.search(r"non-finite log-prob\(s\) of \d+ probed .* after reload_weights", str(exc)), exc
        else:
            # the NaN does not come every time: after other engines ran in the process the reload
            # has given finite log-probs, equal to the restart's in one run and different from
            # them (the same weights: silently wrong) in another, and once a probe that passed
            # followed by a rollout with NaN log-probs. No probe after reload_weights can vouch
            # for this format: that is why int8 takes the restart sync
            assert "int8" in restart
    finally:
        sampler.close()


def test_the_load_probe_fits_a_context_shorter_than_the_vocabulary():
    """The probe reads every token id: with 28 ids and a 16-position context it must split them
    over several prompts, not fail the load as a format this CPU cannot run."""
    from mismatch_monitor.sim.policy import build_model, model_config
    from mismatch_monitor.sim.tokenizer import CharTokenizer

    tok = CharTokenizer("abcdefghijklmnopqrst")
    cfg = model_config(PolicyShape(**dict(VLLM_POLICY, max_positions=16)), tok.vocab_size, tok.pad_id,
                       tok.bos_id, tok.eos_id)
    assert cfg.vocab_size + 1 > cfg.max_position_embeddings
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in build_model(cfg).state_dict().items()}
    sampler = pool_module.VllmPoolSampler(vllm_pool("bf16", "bf16"), cfg, tok)
    try:
        sampler.load(state, 1, "bf16")
    finally:
        sampler.close()
