"""The speculative controller (spec/controller.py): its clock, StepCosts, and the γ it chooses.

Timings are fed in by hand, so nothing here depends on the machine's speed; the engine test only
checks that the engine feeds the clock (every estimate gets measured) and that greedy output stays
the target's.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import SpeculativeConfig
from nanoserve.spec.controller import (
    PROBE_BUDGET,
    SampleState,
    SpecController,
    StepCosts,
    expected_tokens,
)
from nanoserve.spec.rejection_sampler import expected_tokens_per_step


def test_prior_until_measured_then_ratios_of_the_moving_averages():
    costs = StepCosts(prior_draft_cost=0.09)
    assert costs.draft_cost() == 0.09 and costs.verify_cost() == 1.0 and costs.wants_plain_step()
    costs.record_draft(0.6, forwards=2)  # 0.3 s per forward
    assert costs.draft_cost() == 0.09  # no plain step timed yet: still the prior
    costs.record_step(speculative=False, seconds=0.5)
    costs.record_step(speculative=True, seconds=0.75)
    assert costs.draft_cost() == pytest.approx(0.6) and costs.verify_cost() == pytest.approx(1.5)
    assert costs.step_cost(4) == pytest.approx(1.5 + 4 * 0.6) and costs.step_cost(0) == 1.0
    # moving average, weight 0.2: 0.8 · 0.5 + 0.2 · 1.0
    costs.record_step(speculative=False, seconds=1.0)
    assert costs.plain_s == pytest.approx(0.6)


def test_a_one_call_proposer_pays_its_call_once_whatever_gamma():
    """n-gram lookup and Medusa's heads draft all γ tokens in one call: a step costs v + c, not v +
    c·γ."""
    for one_call, want in ((False, 1.5 + 4 * 0.6), (True, 1.5 + 0.6)):
        costs = StepCosts(0.09, one_call=one_call)
        costs.record_draft(0.3, forwards=1)
        costs.record_step(speculative=False, seconds=0.5)
        costs.record_step(speculative=True, seconds=0.75)
        assert costs.step_cost(4) == pytest.approx(want) and costs.step_cost(0) == 1.0
    ngram = LLM("demo", speculative="ngram").engine.spec.controller.costs
    draft = LLM("demo", speculative_model="demo-draft").engine.spec.controller.costs
    assert ngram.one_call and not draft.one_call


def test_a_plain_step_is_asked_for_again_after_recalibrate_every_speculative_steps():
    costs = StepCosts(0.1, recalibrate_every=5)
    costs.record_step(False, 1.0)
    for _ in range(4):
        costs.record_step(True, 1.0)
        assert not costs.wants_plain_step()
    costs.record_step(True, 1.0)
    assert costs.wants_plain_step()
    costs.record_step(False, 1.0)
    assert not costs.wants_plain_step()


def test_pinned_costs_time_nothing():
    costs = StepCosts(0.09, pinned=0.25)
    costs.record_step(False, 1.0)
    costs.record_step(True, 100.0)
    costs.record_draft(100.0, 1)
    assert (
        costs.draft_cost() == 0.25 and costs.verify_cost() == 1.0 and not costs.wants_plain_step()
    )


def _controller(draft_s: float, verify_s: float, plain_s: float, **cfg) -> SpecController:
    spec = SpecController(SpeculativeConfig("ngram", num_speculative_tokens=4, **cfg),
                          prior_draft_cost=0.09)
    spec.costs.draft_s, spec.costs.verify_s, spec.costs.plain_s = draft_s, verify_s, plain_s
    return spec


def _gamma_after(spec: SpecController) -> int:
    """γ for a sample whose rates have settled at α = 2/3 at every position (each draft kept with
    that chance)."""
    return spec.best_gamma([2 / 3] * 4)


def test_each_position_keeps_its_own_rate_and_untested_positions_keep_theirs():
    """4 drafted, 2 kept: positions 1 and 2 were kept, position 3 rejected, position 4 never tested
    (it is not a failure). Each tested rate moves 1/8 of the way to its outcome; the engine's
    running rates too."""
    spec = _controller(0.1, 1.0, 1.0)
    st = SampleState(gamma=4, alphas=[0.8] * 4)
    spec.observe(st, 4, 2)
    assert st.alphas == pytest.approx([0.825, 0.825, 0.7,
                                       0.8]) and spec.alphas == pytest.approx(st.alphas)


def test_expected_tokens_follow_the_conditional_rates():
    """E(γ) = 1 + α_1 + α_1·α_2 + …: equal to Leviathan's (1 − α^(γ+1)) / (1 − α) when every α_i =
    α. Medusa-like rates (later drafts kept more often once the earlier were) give more than one
    pooled α would: with the heads' measured costs (c = 0.18, v = 1.41: RESULTS.md) the controller
    keeps γ = 3 where the pooled α = 0.30 it used to estimate switched them off."""
    assert expected_tokens([0.6] * 5, 5) == pytest.approx(expected_tokens_per_step(0.6, 5))
    assert expected_tokens([0.5, 1.0, 0.0], 3) == pytest.approx(1 + 0.5 + 0.5)
    spec = _controller(draft_s=0.18, verify_s=1.41, plain_s=1.0)
    spec.costs.one_call = True  # the heads draft every position in one call
    assert spec.best_gamma([0.45, 0.6, 0.7, 0.7]) >= 3
    # the pooled estimate: off
    assert max(expected_tokens_per_step(0.30, g) / 1.59 for g in range(1, 5)) < 1


def test_measured_costs_switch_off_what_the_parameter_ratio_would_keep():
    """The demo pair on a CPU: α ≈ 2/3, a draft forward ≈ 0.6 of a target step and a verification
    1.2 (the issue's figures): E(α, γ) / (v + c·γ) < 1 for every γ, so the measured controller
    decodes plainly. The negative control is the old controller, c = 0.09 and v = 1 (pinned): it
    speculates, with γ = 4."""
    assert max(expected_tokens_per_step(2 / 3, g) / (1.2 + 0.6 * g) for g in range(1, 5)) < 1
    assert _gamma_after(_controller(draft_s=0.6, verify_s=1.2, plain_s=1.0)) == 0
    assert _gamma_after(_controller(0.6, 1.2, 1.0, cost=0.09)) == 4
    # a cheap draft (a GPU with graphed draft steps, say: c = 0.05, v = 1.1) pays at the same α
    assert _gamma_after(_controller(draft_s=0.05, verify_s=1.1, plain_s=1.0)) == 4


def test_a_switched_off_sample_probes_so_rarely_that_probes_cost_at_most_the_budget():
    """The GPU pass's useless draft: v = 5.2, c = 3.4 (eager verification and draft against a
    graphed step). A probe costs v + c − 1 = 7.6 extra steps, so probes come every 7.6 /
    PROBE_BUDGET ≈ 253 plain steps, not 16."""
    spec = _controller(draft_s=3.4, verify_s=5.2, plain_s=1.0)
    # what choose_gamma reads of a sequence
    seq = type("Seq", (), {"seq_id": 0, "__len__": lambda self: 10})()
    spec.state(seq).gamma = 0  # switched off
    params, calls = SamplingParams(temperature=0), 0
    while spec.choose_gamma(seq, params, 1000, 10_000) == 0:
        calls += 1
    assert calls + 1 >= (5.2 + 3.4 - 1) / PROBE_BUDGET and calls < 300
    # a probe costs 0.05: the floor, probe_interval
    cheap = _controller(draft_s=0.05, verify_s=1.0, plain_s=1.0)
    cheap.state(seq).gamma, calls = 0, 0
    while cheap.choose_gamma(seq, params, 1000, 10_000) == 0:
        calls += 1
    assert calls + 1 == cheap.config.probe_interval


def test_the_engine_feeds_the_clock_and_greedy_output_stays_the_targets():
    """Measured by default: after a generation the draft forward, the verification and the plain
    step all have estimates (the first decode step ran plainly to time one), and the tokens are the
    target's own."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("demo").generate(["ROMEO:", "JULIET:"], params, use_tqdm=False)
    llm = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=3)
    outs = llm.generate(["ROMEO:", "JULIET:"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    costs = llm.engine.spec.controller.costs
    assert costs.measuring and None not in (costs.draft_s, costs.verify_s, costs.plain_s)
    assert costs.draft_cost() > 0 and costs.verify_cost() > 0
    fixed = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=3,
                speculative_adaptive=False)
    fixed.generate(["ROMEO:"], params, use_tqdm=False)
    # a fixed γ needs no clock: no plain step was forced
    assert fixed.engine.spec.controller.costs.plain_s is None


def test_a_new_sample_starts_from_the_engines_running_acceptance():
    """After a useless draft's rejections, the next request's sample starts switched off (it probes
    later) instead of paying γ = 4 steps to learn what the engine already saw; the negative control
    is a fresh controller."""
    spec = _controller(draft_s=0.1, verify_s=1.0, plain_s=1.0)
    first = SampleState(gamma=4)
    for _ in range(20):
        spec.observe(first, 4, 0)  # every draft rejected: α shrinks by 7/8 a verification
    seq = type("Seq", (), {"seq_id": 1, "__len__": lambda self: 10})()
    assert spec.alphas[0] < spec.config.min_acceptance and spec.state(seq).gamma == 0
    fresh = _controller(draft_s=0.1, verify_s=1.0, plain_s=1.0)
    assert fresh.state(seq).gamma == 4


def test_failed_probes_double_the_wait_and_a_good_one_resets_it():
    # cheap: the wait is probe_every, not the budget's
    spec = _controller(draft_s=0.01, verify_s=1.0, plain_s=1.0)
    seq = type("Seq", (), {"seq_id": 0, "__len__": lambda self: 10})()
    st, params, waits = spec.state(seq), SamplingParams(temperature=0), []
    st.alphas, st.gamma = [0.0] * 4, 0
    for _ in range(3):
        calls = 1
        while spec.choose_gamma(seq, params, 1000, 10_000) == 0:
            calls += 1
        waits.append(calls)
        spec.observe(st, 1, 0)  # the probe's draft is rejected
    assert waits == [16, 32, 64] and spec.probe_every == 128
    while st.gamma == 0:  # now every probe's draft is accepted: α climbs back over min_acceptance
        while spec.choose_gamma(seq, params, 1000, 10_000) == 0:
            pass
        spec.observe(st, 1, 1)
    # the probe that switched it on reset the wait
    assert spec.probe_every == spec.config.probe_interval
