"""EAGLE's draft head (nanoserve/spec/eagle.py, eagle_proposer.py, tools/train_eagle.py) in the
engine.

The oracles are outside the head: the target alone (greedy tokens and logprobs, token for token),
and at T > 0 the target's exact joint law of its first three tokens computed from its logits (χ²,
1,500 seeded requests). Greedy equality holds on the torch and cpu backends, batch 4, block size 4,
under preemption, with prefix-cache hits (whose positions have no features here: the head drafts
from the rest) and n = 2 forks. The trained head accepts more than Medusa's chain; controls: the
head fed zero features accepts far less (it reads the target's features), and keeping the head's
sampled drafts without the min(1, p/q) test breaks the law.
"""

from __future__ import annotations

import json

import pytest
import torch
from chi2 import goodness_of_fit
from test_medusa_tree import _joint_law3

from nanoserve import LLM, SamplingParams
from nanoserve.errors import CheckpointError, NanoserveError
from nanoserve.spec.eagle import load_eagle
from nanoserve.spec.eagle_proposer import EagleProposer
from nanoserve.tools.train_eagle import eagle_accuracy, init_head

PROMPTS = ["ROMEO:\nWhat light through yonder", "To be, or not to be",
           "First Citizen:\nBefore we proceed any further,",
           "KING"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)


def _llm(head, gamma=3, **kw) -> LLM:
    return LLM("demo", block_size=4, speculative="eagle", speculative_model=str(head),
               num_speculative_tokens=gamma,
               speculative_adaptive=False, **kw)


def _tokens_and_logprobs(out):
    o = out.outputs[0]
    return o.token_ids, torch.tensor([lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)])


def _check_equal(got, want):
    for a, b in zip(got, want):
        (ta, la), (tb, lb) = _tokens_and_logprobs(a), _tokens_and_logprobs(b)
        assert ta == tb
        assert torch.allclose(la, lb, atol=1e-4)


def _tokens_per_step(outs) -> float:
    stats = [o.outputs[0].spec_stats for o in outs]
    return sum(s.num_emitted_tokens for s in stats) / sum(s.num_steps for s in stats)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equals_the_target_alone_and_accepts_more_than_medusa(
    eagle_trained, medusa_trained, backend
):
    want = LLM("demo", block_size=4, attention_backend=backend).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    outs = _llm(eagle_trained[0], attention_backend=backend).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    _check_equal(outs, want)
    medusa = LLM("demo", block_size=4, speculative="medusa",
                 speculative_model=str(medusa_trained[0]),
                 num_speculative_tokens=3, speculative_adaptive=False, attention_backend=backend)
    chain = _tokens_per_step(medusa.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert _tokens_per_step(outs) > max(1.8, chain), (_tokens_per_step(outs), chain)


def test_preemption_prefix_hits_and_forks(eagle_trained):
    """A 40-block pool (preemption); a prompt whose prefix is in the cache (those positions have no
    features
    here: the head drafts from the rest); n = 2 (a fork's prompt features are its parent's): still
    the target's tokens, and every block and every feature let go of at the end."""
    one, llm = LLM("demo", block_size=4, num_blocks=40), _llm(eagle_trained[0], num_blocks=40)
    _check_equal(llm.generate(PROMPTS, GREEDY, use_tqdm=False),
                 one.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    longer = [PROMPTS[2] + " hear me speak."]
    hit = llm.generate(longer, GREEDY, use_tqdm=False)
    assert hit[0].num_cached_tokens > 0
    _check_equal(hit, one.generate(longer, GREEDY, use_tqdm=False))
    two = SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True)
    got = llm.generate(PROMPTS[:1], two, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [
        c.token_ids for c in one.generate(PROMPTS[:1], two, use_tqdm=False)[0].outputs
    ]
    bm = llm.engine.block_allocator
    assert bm.num_free_blocks() == bm.num_blocks and not llm.engine.spec.proposer.features
    assert not llm.engine.spec.proposer.tracks


def test_the_head_reads_the_targets_features(eagle_trained, monkeypatch):
    """The control: the same head fed zero features instead of the target's accepts far less."""
    base = _tokens_per_step(_llm(eagle_trained[0]).generate(PROMPTS, GREEDY, use_tqdm=False))
    absorb = EagleProposer._absorb

    def zeroed(self, seq_id):
        track = absorb(self, seq_id)
        if track is not None:
            track.feats = torch.zeros_like(track.feats)
        return track
    monkeypatch.setattr(EagleProposer, "_absorb", zeroed)
    blind = _tokens_per_step(_llm(eagle_trained[0]).generate(PROMPTS, GREEDY, use_tqdm=False))
    assert blind < base - 0.5, (blind, base)


def test_training_learns_the_targets_next_token(eagle_trained):
    _, llm, held_out, head = eagle_trained
    untrained = eagle_accuracy(init_head(llm.model), llm.model, held_out)
    trained = eagle_accuracy(head, llm.model, held_out)
    assert untrained < 0.1 and trained > 0.45, (untrained, trained)


@pytest.mark.parametrize("accept_all", [False, True])
def test_sampling_keeps_the_targets_joint_law(eagle_trained, monkeypatch, accept_all):
    settings = dict(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    law = _joint_law3(eagle_trained[1], "ROMEO:\n", SamplingParams(**settings))
    # the control: the head's drafts kept without the min(1, p/q) test (the bonus from p)
    if accept_all:
        def keep(draft, q, p, lengths, generators, check_inputs=True):
            out = torch.full((len(lengths), draft.shape[1] + 1), -1)
            for b, (n, g) in enumerate(zip(lengths, generators)):
                out[b, :n] = draft[b, :n]
                out[b, n] = torch.multinomial(p[b, n].double(), 1, generator=g)
            return out, torch.tensor(lengths)
        monkeypatch.setattr("nanoserve.spec.batch_verify.rejection_sample_batch", keep)
    # budget: every row
    llm = _llm(eagle_trained[0], gamma=2, max_num_seqs=128, max_num_batched_tokens=4096)
    n = 1500
    outs = llm.generate(["ROMEO:\n"] * n,
                        [SamplingParams(**{**settings, "seed": s}) for s in range(n)],
                        use_tqdm=False)
    # tokens 2, 3 from drafts
    assert sum(o.outputs[0].spec_stats.num_draft_tokens for o in outs) > 0.9 * 2 * n
    triples = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    cells = sorted(law)
    counts = torch.tensor([sum(1 for t in triples if t == c) for c in cells], dtype=torch.float64)
    outside = len(triples) - int(counts.sum())
    _, _, pvalue = goodness_of_fit(counts, torch.tensor([law[c] for c in cells]))
    if accept_all:
        assert outside > 0 or pvalue < 1e-6
    else:
        assert outside == 0 and pvalue > 1e-3, (outside, pvalue)


def test_checkpoints_and_settings_are_checked_by_name(eagle_trained, tmp_path):
    head = eagle_trained[0]
    assert set(json.loads((head / "config.json").read_text())) >= {
        "hidden_size",
        "num_attention_heads",
    }
    with pytest.raises(CheckpointError, match="holds no EAGLE head: config.json is missing"):
        load_eagle(tmp_path, 256, 257)
    with pytest.raises(CheckpointError, match="the target has 384 and 257"):
        load_eagle(head, 384, 257)
    with pytest.raises(NanoserveError, match="speculative='eagle' needs speculative_model"):
        LLM("demo", speculative="eagle")
    with pytest.raises(NanoserveError, match="speculative_tree is for speculative='medusa'"):
        LLM("demo", speculative="eagle", speculative_model=str(head), speculative_tree="default")
