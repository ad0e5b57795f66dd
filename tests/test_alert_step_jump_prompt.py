"""MismatchStepJump holds two steps: a one-prompt pool's one-step excursion does not fire, a sync
that did not apply (it stays until a resync) fires one step after its onset.

The excursion is the clean MoE run's topp pool (seed 1, steps 10-18, as recorded by
``benchmarks/bench_warning.py --save``): one prompt a step, 8 samples of it; at step 16 every one
of the 8 sequences (14-15 tokens each) has 3-6 tokens above the earlier steps' largest p99 and
1-2 routing-flipped tokens, so neither counting sequences nor leaving out flipped tokens tells it
from a fault; the next step has another prompt and is back at its level.

Runtime: under a second.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pandas as pd

from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.alerts.definitions import STEP_JUMP

TOPP_SEED_1 = """step,mismatch/n_tokens,mismatch/k3_kl,mismatch/abs_log_ratio/p90,mismatch/abs_log_ratio/p99
10,61,4.95635e-05,0.00864989,0.0437111
11,103,6.08529e-05,0.0196401,0.0311119
12,107,0.000173897,0.0275936,0.0523319
13,28,0.000657182,0.0639188,0.113993
14,108,0.000168086,0.0317404,0.0502799
15,104,0.000121045,0.0181301,0.0735245
16,113,0.0100358,0.212226,0.600455
17,66,8.64874e-05,0.0192512,0.0601963
18,47,0.000104104,0.0235136,0.0590043
"""


def recorded() -> pd.DataFrame:
    return pd.read_csv(io.StringIO(TOPP_SEED_1)).assign(pool="topp")


def firings(frame: pd.DataFrame, rule=STEP_JUMP) -> list[int]:
    _, events = AlertEvaluator.replay(frame, rules=(rule,))
    return [e.step for e in events if e.state == "firing"]


def test_the_one_prompt_excursion_does_not_fire():
    frame = recorded()
    # the jump test itself holds at step 16: a rule firing on one step fires there
    assert firings(frame, replace(STEP_JUMP, for_steps=0)) == [16]
    assert firings(frame) == []


def test_the_same_jump_held_a_second_step_fires_one_step_after_onset():
    frame = recorded()
    held = frame[frame["step"] == 16].assign(step=17)
    frame = pd.concat([frame[frame["step"] != 17], held]).sort_values("step", ignore_index=True)
    assert firings(frame) == [17]
