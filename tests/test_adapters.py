"""Framework adapters on batches laid out as each framework lays them out.

One ground truth (samples with prompts, multi-turn responses, tool tokens, per-token log-probs,
advantages, environments and per-position expert routing) is laid out five ways: verl's
left/right-padded DataProto, OpenRLHF's Experience, NeMo-RL's message-log BatchedDataDict,
slime's per-sample lists and prime-rl's packed micro-batch. Each adapter must recover exactly
the trained tokens of every sample, in order, with their turns, advantages, labels and routing,
and the metrics must match a float64 numpy reference. Runtime: < 2 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mismatch_monitor.batch import BatchError, TokenBatch
from mismatch_monitor.collectors.adapters import (nemo_rl_batch, openrlhf_batch, prime_rl_batch,
                                                  slime_batch, verl_batch)
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.metrics import report

torch.set_num_threads(1)
L, K, E = 3, 2, 6   # layers, experts per token, experts


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    trained: list[bool]          # per response token: generated (True) or tool output (False)
    pi: list[float]              # trainer log-prob per response token
    mu: list[float]              # sampler log-prob per response token (tool tokens: 0.0)
    advantage: float
    env: str
    route_s: np.ndarray          # [P + R, L, K] sampler experts per position
    route_t: np.ndarray          # [P + R, L, K] trainer experts per position

    @property
    def turns(self) -> list[int]:
        out, turn, prev = [], -1, False
        for t in self.trained:
            if t and not prev:
                turn += 1
            out.append(turn)
            prev = t
        return out

    def expected(self):
        """(pi, mu, token, turn, flips per layer) of the trained tokens, in order."""
        P = len(self.prompt)
        rows = []
        for r, keep in enumerate(self.trained):
            if keep:
                produced_by = P + r - 1
                flips = [set(self.route_t[produced_by, layer]) != set(self.route_s[produced_by, layer])
                         for layer in range(L)]
                rows.append((self.pi[r], self.mu[r], self.response[r], self.turns[r], flips))
        return rows


def make_samples(seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(5):
        P, segments = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        trained = []
        for s in range(segments):
            trained += [True] * int(rng.integers(1, 5))
            if s < segments - 1:
                trained += [False] * int(rng.integers(1, 4))
        R = len(trained)
        mu = -rng.uniform(0.01, 6, R)
        pi = mu + rng.normal(0, 0.05, R) + (rng.random(R) < 0.1) * rng.normal(0, 2, R)
        route_s = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(P + R)])
        route_t = route_s.copy()
        for pos in range(P + R):
            for layer in range(L):
                if rng.random() < 0.2:
                    route_t[pos, layer, 0] = next(e for e in range(E) if e not in route_s[pos, layer])
        samples.append(Sample(
            prompt=rng.integers(10, 50, P).tolist(), response=rng.integers(50, 99, R).tolist(),
            trained=trained, pi=np.minimum(pi, 0).tolist(), mu=[m if t else 0.0 for m, t in zip(mu, trained)],
            advantage=float(rng.normal()), env=f"env{i % 2}", route_s=route_s, route_t=route_t))
    return samples


SAMPLES = make_samples()
PMAX = max(len(s.prompt) for s in SAMPLES)
RMAX = max(len(s.response) for s in SAMPLES)


def check(batch: TokenBatch, samples: list[Sample], *, turns: bool, routing: bool, env: bool) -> None:
    assert batch.num_sequences == len(samples)
    seq = batch.seq_index.numpy()
    for i, sample in enumerate(samples):
        rows = sample.expected()
        sel = np.nonzero(seq == i)[0]
        assert len(sel) == len(rows), f"sample {i}"
        np.testing.assert_allclose(batch.trainer_logprobs.double().numpy()[sel], [r[0] for r in rows], rtol=1e-6)
        np.testing.assert_allclose(batch.sampler_logprobs.double().numpy()[sel], [r[1] for r in rows], rtol=1e-6)
        assert batch.token_ids.numpy()[sel].tolist() == [r[2] for r in rows]
        if turns:
            assert batch.turn_index.numpy()[sel].tolist() == [r[3] for r in rows]
        if routing:
            for j, token in enumerate(sel):
                for layer in range(L):
                    flipped = set(batch.trainer_experts[token, layer].tolist()) != set(batch.sampler_experts[token, layer].tolist())
                    assert flipped == rows[j][4][layer], (i, j, layer)
        np.testing.assert_allclose(float(batch.advantages[i]), sample.advantage, rtol=1e-6)
        if env:
            assert batch.labels["env"][i] == sample.env
    # metrics against a float64 reference over the ground truth
    truth = [r for s in samples for r in s.expected()]
    lr = np.array([r[0] for r in truth], dtype=np.float64) - np.array([r[1] for r in truth], dtype=np.float64)
    got = report(compute_stats(batch), ())
    assert got["mismatch/n_tokens"].iloc[0] == len(truth)
    np.testing.assert_allclose(got["mismatch/k3_kl"].iloc[0], np.mean(np.expm1(lr) - lr), rtol=1e-5)
    if routing:
        flips = np.array([r[4] for r in truth])
        np.testing.assert_allclose(got["mismatch/routing/flip_rate"].iloc[0], flips.mean())
        np.testing.assert_allclose(got["mismatch/routing/any_layer_flip_fraction"].iloc[0], flips.any(1).mean())


# ----------------------------------------------------------------------------- layouts
def verl_layout(samples: list[Sample]) -> SimpleNamespace:
    B = len(samples)
    prompts = torch.zeros(B, PMAX, dtype=torch.long)                       # left-padded
    responses = torch.zeros(B, RMAX, dtype=torch.long)                     # right-padded
    response_mask = torch.zeros(B, RMAX, dtype=torch.long)
    old, rollout, adv = (torch.zeros(B, RMAX, dtype=torch.float32) for _ in range(3))
    routed_s = torch.zeros(B, PMAX + RMAX, L, K, dtype=torch.long)
    routed_t = torch.zeros(B, PMAX + RMAX, L, K, dtype=torch.long)
    for i, s in enumerate(samples):
        P, R = len(s.prompt), len(s.response)
        prompts[i, PMAX - P:] = torch.tensor(s.prompt)
        responses[i, :R] = torch.tensor(s.response)
        response_mask[i, :R] = torch.tensor(s.trained, dtype=torch.long)
        old[i, :R] = torch.tensor(s.pi)
        rollout[i, :R] = torch.tensor(s.mu)
        adv[i, :R] = s.advantage * torch.tensor(s.trained, dtype=torch.float32)   # advantages * mask
        routed_s[i, PMAX - P:PMAX + R] = torch.from_numpy(s.route_s)
        routed_t[i, PMAX - P:PMAX + R] = torch.from_numpy(s.route_t)
    batch = {"prompts": prompts, "responses": responses, "response_mask": response_mask,
             "input_ids": torch.cat([prompts, responses], 1), "old_log_probs": old,
             "rollout_log_probs": rollout, "advantages": adv, "routed_experts": routed_s}
    return SimpleNamespace(batch=batch, meta_info={"global_steps": 3},
                           non_tensor_batch={"data_source": np.array([s.env for s in samples], dtype=object),
                                             "uid": np.array([str(i) for i in range(B)], dtype=object)},
                           trainer_routing=routed_t)


def test_verl():
    data = verl_layout(SAMPLES)
    batch = verl_batch(data, turns=True, trainer_routed_experts=data.trainer_routing)
    check(batch, SAMPLES, turns=True, routing=True, env=True)
    plain = verl_batch(data.batch, labels={"pool": "vllm-bf16"})          # the TensorDict alone
    assert plain.turn_index is None and plain.trainer_experts is None
    assert set(plain.labels["pool"]) == {"vllm-bf16"} and "env" not in plain.labels


def test_verl_bypass_mode_is_not_reported_as_zero_mismatch():
    data = verl_layout(SAMPLES)
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]           # what bypass mode does
    with pytest.raises(BatchError, match="bypass mode"):
        verl_batch(data)
    missing = dict(data.batch)
    del missing["rollout_log_probs"]
    with pytest.raises(BatchError, match="'rollout_log_probs'.*calculate_log_probs"):
        verl_batch(missing)


def test_openrlhf():
    B = len(SAMPLES)
    sequences = torch.zeros(B, PMAX + RMAX, dtype=torch.long)
    action_mask = torch.zeros(B, RMAX, dtype=torch.bool)
    alp, rlp, adv = (torch.zeros(B, RMAX) for _ in range(3))
    for i, s in enumerate(SAMPLES):
        P, R = len(s.prompt), len(s.response)
        sequences[i, PMAX - P:PMAX] = torch.tensor(s.prompt)
        sequences[i, PMAX:PMAX + R] = torch.tensor(s.response)
        action_mask[i, :R] = torch.tensor(s.trained)
        alp[i, :R], rlp[i, :R] = torch.tensor(s.pi), torch.tensor(s.mu)
        adv[i, :R] = s.advantage
    experience = SimpleNamespace(sequences=sequences, attention_mask=(sequences != 0).long(),
                                 action_mask=action_mask, action_log_probs=alp, rollout_log_probs=rlp,
                                 base_action_log_probs=None, advantages=adv, info={})
    batch = openrlhf_batch(experience, turns=True, labels={"env": [s.env for s in SAMPLES]})
    check(batch, SAMPLES, turns=True, routing=False, env=True)


def test_nemo_rl_excludes_position_zero_and_masked_samples():
    S = PMAX + RMAX
    B = len(SAMPLES) + 1                         # one more sample, dropped by sample_mask
    samples = SAMPLES + [SAMPLES[0]]
    input_ids = torch.zeros(B, S, dtype=torch.long)
    token_mask = torch.zeros(B, S, dtype=torch.long)
    prev, gen, adv = (torch.zeros(B, S) for _ in range(3))
    for i, s in enumerate(samples):
        P, R = len(s.prompt), len(s.response)
        input_ids[i, :P + R] = torch.tensor(s.prompt + s.response)        # right-padded message log
        token_mask[i, P:P + R] = torch.tensor(s.trained, dtype=torch.long)
        prev[i, :P] = -1.0                                                 # trainer scores the prompt too
        prev[i, P:P + R], gen[i, P:P + R] = torch.tensor(s.pi), torch.tensor(s.mu)
        adv[i, :P + R] = s.advantage
    token_mask[0, 0] = 1                         # a trained first position has no log-prob: excluded
    sample_mask = torch.tensor([1.0] * len(SAMPLES) + [0.0])
    data = {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": sample_mask,
            "prev_logprobs": prev, "generation_logprobs": gen, "advantages": adv}
    batch = nemo_rl_batch(data, turns=True, labels={"env": [s.env for s in samples]})
    # the dropped sample keeps its slot but has no tokens; the others are exact
    assert int((batch.seq_index == len(SAMPLES)).sum()) == 0
    kept = TokenBatch.from_flat(batch.trainer_logprobs, batch.sampler_logprobs, seq_ids=batch.seq_index,
                                num_sequences=len(SAMPLES), labels={"env": batch.labels["env"][:-1]},
                                turn_index=batch.turn_index, advantages=batch.advantages[:-1],
                                token_ids=batch.token_ids)
    check(kept, SAMPLES, turns=True, routing=False, env=True)


def test_slime():
    data = {
        "tokens": [torch.tensor(s.prompt + s.response) for s in SAMPLES],
        "response_lengths": [len(s.response) for s in SAMPLES],
        "total_lengths": [len(s.prompt) + len(s.response) for s in SAMPLES],
        "loss_masks": [torch.tensor(s.trained, dtype=torch.int32) for s in SAMPLES],
        "log_probs": [torch.tensor(s.pi) for s in SAMPLES],
        "rollout_log_probs": [list(s.mu) for s in SAMPLES],                 # plain lists work too
        "advantages": [torch.full((len(s.response),), s.advantage) for s in SAMPLES],
        # rows 0..T_i-2: row j is the position that produced token j + 1
        "rollout_routed_experts": [torch.from_numpy(s.route_s[:-1]) for s in SAMPLES],
    }
    trainer_routing = [torch.from_numpy(s.route_t[:-1]) for s in SAMPLES]
    batch = slime_batch(data, turns=True, trainer_routed_experts=trainer_routing,
                        labels={"env": [s.env for s in SAMPLES], "pool": "sglang-fp8"})
    check(batch, SAMPLES, turns=True, routing=True, env=True)


@pytest.mark.parametrize("release", ["older", "newer"])
def test_prime_rl(release):
    ids, pos, mask, inf, tr, adv, envs, routed_s, routed_t, lengths = ([] for _ in range(10))
    for s in SAMPLES:
        P, R = len(s.prompt), len(s.response)
        ids += s.prompt + s.response
        pos += list(range(P + R))
        mask += [False] * P + s.trained
        inf += [0.0] * P + s.mu
        tr += [-0.5] * P + s.pi
        adv += [s.advantage] * (P + R)
        envs += [s.env] * (P + R)
        routed_s.append(torch.from_numpy(s.route_s))
        routed_t.append(torch.from_numpy(s.route_t))
        lengths.append(P + R)
    packed = lambda x, dt=None: torch.tensor(x, dtype=dt).unsqueeze(0)    # noqa: E731  [1, S]
    micro = {"input_ids": packed(ids), "position_ids": packed(pos), "inference_logprobs": packed(inf),
             "routed_experts": torch.cat(routed_s).unsqueeze(0)}
    if release == "older":
        micro.update(loss_mask=packed(mask, torch.bool), advantages=packed(adv))
    else:
        micro.update(advantages=[{"loss": "rl", "values": packed(adv), "mask": packed(mask, torch.bool)}],
                     sequence_lengths=lengths, env_names=envs)
    labels = {"env": [s.env for s in SAMPLES]} if release == "older" else None
    batch = prime_rl_batch(micro, packed(tr), turns=True, labels=labels,
                           trainer_routed_experts=torch.cat(routed_t).unsqueeze(0))
    check(batch, SAMPLES, turns=True, routing=True, env=True)
