"""The controlled-acceptance proposer (nanoserve/tools/controlled_draft.py): speculative decoding at
a chosen α, for benchmarks of the machinery.

On the demo model, greedy, γ = 4 fixed: the tokens equal the plain run's at every α (speculation
is lossless whatever the drafts), and the engine's own statistics see the α that was set: at 1
every draft is accepted, at 0 none (a useless draft: each step still emits the target's token), at
0.7 the estimate lies within three binomial standard deviations of 0.7 over the coins it checked
(the draws are seeded: the same run every time). A prompt that was not recorded gets no drafts.
"""

from __future__ import annotations

import math

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.tools.controlled_draft import (
    ControlledDraft,
    record_continuations,
    use_controlled_draft,
)

PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32], [82, 79, 77, 69, 79, 58, 10]]
NEW = 40


@pytest.fixture(scope="module")
def recorded():
    llm = LLM("demo", dtype="float32")
    return record_continuations(llm, PROMPTS, NEW)


def _speculate(recorded, alpha, prompts=PROMPTS):
    llm = LLM("demo", dtype="float32", speculative="ngram", num_speculative_tokens=4,
              speculative_adaptive=False, speculative_cost=0.0)
    use_controlled_draft(llm, recorded, alpha, seed=3)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _totals(outs):
    stats = [o.outputs[0].spec_stats for o in outs]
    accepted = sum(s.num_accepted_tokens for s in stats)
    rejections = sum(s.num_rejections for s in stats)
    return accepted, rejections, sum(s.num_steps for s in stats)


@pytest.mark.parametrize("alpha", [1.0, 0.7, 0.0])
def test_tokens_are_the_plain_runs_and_acceptance_is_alpha(recorded, alpha):
    outs = _speculate(recorded, alpha)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == recorded[tuple(prompt)]
    accepted, rejections, steps = _totals(outs)
    checked = accepted + rejections
    if alpha == 1.0:
        assert rejections == 0 and accepted > 0 and steps < len(PROMPTS) * NEW / 2
    elif alpha == 0.0:
        assert accepted == 0 and rejections > 0
    else:
        sigma = math.sqrt(alpha * (1 - alpha) / checked)
        assert abs(accepted / checked - alpha) <= 3 * sigma, (accepted, checked)


def test_an_unrecorded_prompt_gets_no_drafts(recorded):
    out = _speculate(recorded, 1.0, prompts=[[65, 66, 67]])[0]
    assert out.outputs[0].spec_stats.num_draft_tokens == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        ControlledDraft({}, 1.5, 100)
    with pytest.raises(ValueError, match="needs an engine built with speculative='ngram'"):
        use_controlled_draft(LLM("demo", dtype="float32"), {}, 0.5)


def test_a_sequence_off_its_recording_gets_no_more_drafts(recorded):
    """A recording that differs from what the target writes (at token 10 here) stops drafting for
    that sequence from there on, and says how often; the tokens stay the target's."""
    prompt = tuple(PROMPTS[0])
    wrong = dict(recorded)
    wrong[prompt] = list(recorded[prompt])
    wrong[prompt][10] = (wrong[prompt][10] + 1) % 257
    llm = LLM("demo", dtype="float32", speculative="ngram", num_speculative_tokens=4,
              speculative_adaptive=False, speculative_cost=0.0)
    draft = use_controlled_draft(llm, wrong, 1.0)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out = llm.generate([list(prompt)], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == recorded[prompt]
    assert draft.diverged > 0 and out.spec_stats.num_accepted_tokens <= 10
