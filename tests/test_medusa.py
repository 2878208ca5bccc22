"""Medusa heads (nanoserve/spec/medusa.py, tools/train_medusa.py) on the demo model.

Training: heads trained on the demo's own samples must guess held-out tokens t + 2, t + 3 far more
often than untrained heads (the negative control: the demo's LM head, guessing t + 1 again). The
checkpoint is Medusa's layout and loads back to the same logits; heads for another model are refused
by name.
Engine: greedy speculative output equals the target's greedy output token for token (γ = 1 and 3,
batch > 1, block size 4, with preemption, n = 2 and prefix-cache hits), with drafts actually
accepted. At T > 0 the joint law of the first two tokens through the public API is the target's, by
χ², with the exact law computed from the target; the control: accepting every draft (no rejection)
fails the same test.
"""

from __future__ import annotations

import pytest
import torch
from chi2 import goodness_of_fit

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sampler import probs_from_logits
from nanoserve.errors import CheckpointError, NanoserveError
from nanoserve.spec.medusa import MedusaHeads, load_medusa, save_medusa
from nanoserve.tools.train_medusa import head_accuracy, hidden_states, init_heads

PROMPTS = ["ROMEO:\nWhat light through yonder", "To be, or not to be",
           "First Citizen:\nBefore we proceed any further,",
           "KING"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def trained(medusa_trained):
    """(heads dir, demo LLM, held-out ids, trained heads): conftest's 3 heads, 300 steps on 128
    sequences."""
    return medusa_trained


@pytest.fixture(scope="module")
def plain():
    llm = LLM("demo", block_size=4)
    return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


def test_trained_heads_guess_far_better_than_untrained_ones(trained):
    _, llm, held_out, heads = trained
    h = hidden_states(llm.model, held_out)
    after = head_accuracy(heads, h, held_out)
    # the control: the LM head guessing t + 1
    before = head_accuracy(init_heads(llm.model, 3), h, held_out)
    assert all(a > 2.5 * b and a > 0.12 for a, b in zip(after, before)), (after, before)
    assert after[0] > after[2]  # the nearer token is easier to guess


def test_checkpoint_is_medusas_layout_and_loads_back(trained, tmp_path):
    path, llm, held_out, heads = trained
    from safetensors.torch import load_file

    keys = set(load_file(str(path / "medusa_lm_head.safetensors")))
    assert keys == {f"{i}.{k}" for i in range(3) for k in ("0.linear.weight", "0.linear.bias",
                                                           "1.weight")}
    back = load_medusa(path, 256, 257)
    h = torch.randn(5, 256)
    with torch.no_grad():
        assert torch.equal(back(h), heads(h))
    with pytest.raises(CheckpointError, match="trained for another model"):
        load_medusa(path, 384, 257)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_medusa(tmp_path, 256, 257)
    save_medusa(MedusaHeads(256, 100, 2), tmp_path / "other")
    with pytest.raises(NanoserveError, match="could not be loaded|trained for another model"):
        LLM("demo", speculative="medusa", speculative_model=str(tmp_path / "other"))


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_medusa_equals_target_alone(trained, plain, gamma):
    llm = LLM("demo", block_size=4, speculative="medusa", speculative_model=str(trained[0]),
              num_speculative_tokens=gamma, speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs)} == plain
    stats = [o.outputs[0].spec_stats for o in outs]
    assert (
        sum(s.num_accepted_tokens for s in stats) > 0.2 * sum(s.num_draft_tokens for s in stats) > 0
    )
    assert llm.engine.block_allocator.num_free_blocks() == llm.engine.block_allocator.num_blocks


def test_medusa_with_preemption_samples_and_prefix_hits(trained, plain):
    llm = LLM("demo", block_size=4, num_blocks=40, max_num_seqs=8, speculative="medusa",
              speculative_model=str(trained[0]), num_speculative_tokens=3,
              speculative_adaptive=False)
    # the repeats hit the prefix cache
    outs = llm.generate(PROMPTS + PROMPTS[:2], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert [o.token_ids for o in outs] == [plain[p] for p in PROMPTS + PROMPTS[:2]]
    two = llm.generate(PROMPTS[0],
                       SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [plain[PROMPTS[0]][:12]] * 2
    assert not llm.engine.spec.proposer.hidden  # every sequence's hidden rows were let go


def test_medusa_needs_its_heads_and_fits_their_count(trained):
    with pytest.raises(NanoserveError, match="speculative_model=<the Medusa heads' directory>"):
        LLM("demo", speculative="medusa")
    with pytest.raises(NanoserveError,
                       match="num_speculative_tokens=4 but the Medusa heads .* predict 3"):
        LLM("demo", speculative="medusa", speculative_model=str(trained[0]),
            num_speculative_tokens=4)


def _joint_law(llm: LLM, prompt: str, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the target alone at `params`, exactly: p(x1) from the prompt, p(x2 | x1) for
    every x1."""
    ids = llm.encode_prompt(prompt)
    p1 = probs_from_logits(llm.logits(ids)[-1:], params.temperature, params.top_k,
                           params.top_p)[0].double()
    law = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = probs_from_logits(llm.logits(ids + [x1])[-1:], params.temperature, params.top_k,
                               params.top_p)[0]
        for x2 in p2.nonzero().flatten().tolist():
            law[(x1, x2)] = p1[x1].item() * p2[x2].item()
    return law


def _first_two(trained, params, n):
    llm = LLM("demo", speculative="medusa", speculative_model=str(trained[0]),
              num_speculative_tokens=1,
              speculative_adaptive=False, max_num_seqs=256)
    outs = llm.generate(["ROMEO:\n"] * n,
                        [SamplingParams(**{**params, "seed": s}) for s in range(n)], use_tqdm=False)
    stats = [o.outputs[0].spec_stats for o in outs]
    return [tuple(o.outputs[0].token_ids[:2]) for o in outs], stats


@pytest.mark.parametrize("accept_all", [False, True])
def test_sampling_keeps_the_targets_joint_law(trained, monkeypatch, accept_all):
    settings = dict(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    law = _joint_law(trained[1], "ROMEO:\n", SamplingParams(**settings))
    if accept_all:  # the control: keep every draft, draw only the bonus token from p
        def accept_every_draft(draft, q, p, lengths, generators, check_inputs=True):
            out = torch.full((len(lengths), draft.shape[1] + 1), -1)
            for b, (n, g) in enumerate(zip(lengths, generators)):
                out[b, :n] = draft[b, :n]
                out[b, n] = torch.multinomial(p[b, n], 1, generator=g)
            return out, torch.tensor(lengths)
        monkeypatch.setattr("nanoserve.spec.batch_verify.rejection_sample_batch",
                            accept_every_draft)
    pairs, stats = _first_two(trained, settings, 2000)
    # the second token came from verifications
    assert sum(s.num_draft_tokens for s in stats if s) > 1000
    cells = sorted(law)
    counts = torch.tensor([sum(1 for pair in pairs if pair == c) for c in cells],
                          dtype=torch.float64)
    # pairs the target's law cannot give (a token outside top-k)
    outside = len(pairs) - int(counts.sum())
    _, _, pvalue = goodness_of_fit(counts, torch.tensor([law[c] for c in cells]))
    if accept_all:
        assert outside > 0 or pvalue < 1e-6
    else:
        assert outside == 0 and pvalue > 1e-3, (outside, pvalue)
