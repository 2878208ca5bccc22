"""Speculative decoding inside the continuous engine (docs/TESTING.md §B, engine level).

The sampler's law is proven in test_speculative_core.py on toy Markov chains; here the same
algorithm runs on real models, paged caches and the scheduler. Oracles: plain greedy decoding of
the target (`LLM` without speculation) — speculative greedy must equal it token for token, for
γ ∈ {1, 3, 5}, batch 1 and > 1, block size 4 so drafts and rollbacks cross block boundaries, with
the demo pair (draft model) and with n-gram lookup; a draft identical to the target must be
accepted always (γ + 1 tokens per step). After every test both block pools are whole.
Negative control: a rollback that keeps the rejected drafts' K/V computed breaks the equality.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.spec import spec_decode
from nanoserve.spec.batch_verify import verify_batch

PROMPTS = ["ROMEO:\nWhat light through yonder", "To be, or not to be",
           "First Citizen:\nBefore we proceed any further,",
           "KING"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _whole(llm: LLM) -> None:
    """Every block back in the target's pool and, with a draft model, in the draft's."""
    e = llm.engine
    assert not e.scheduler.running and not e.scheduler.waiting
    bm = e.block_allocator
    assert bm.num_free_blocks() == bm.num_blocks
    bm.check_invariants()
    if e.spec is not None and hasattr(e.spec.proposer, "block_allocator"):
        dbm = e.spec.proposer.block_allocator
        assert dbm.num_free_blocks() == dbm.num_blocks and not e.spec.proposer.seqs
        dbm.check_invariants()
    if e.spec is not None:  # finished sequences let go of their controller state too
        assert not e.spec.controller.states


@pytest.fixture(scope="module")
def plain():
    """Greedy tokens of the target alone, per prompt (the oracle)."""
    llm = LLM("demo", block_size=4)
    return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_draft_model_equals_target_alone(plain, gamma):
    llm = LLM("demo", block_size=4, speculative_model="demo-draft", num_speculative_tokens=gamma,
              speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # batch > 1
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs)} == plain
    _whole(llm)  # the draft's pool too: a request that finished let go of its draft sequence
    single = llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0]  # batch 1
    assert single.token_ids == plain[PROMPTS[2]]
    stats = [o.outputs[0].spec_stats for o in outs]
    assert all(s is not None and s.num_steps > 0 for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    assert 0 < accepted < drafted  # a real draft: some accepted, some not
    assert all(1 <= s.tokens_per_step <= gamma + 1 for s in stats)
    _whole(llm)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_ngram_equals_target_alone(plain, gamma):
    llm = LLM("demo", block_size=4, speculative="ngram", num_speculative_tokens=gamma,
              speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs)} == plain
    _whole(llm)


def test_draft_identical_to_target_is_always_accepted():
    gamma = 3
    llm = LLM("demo", block_size=4, speculative_model="demo", num_speculative_tokens=gamma,
              speculative_adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=1 + 4 * (gamma + 1), ignore_eos=True)
    out = llm.generate(["ROMEO:"], params, use_tqdm=False)[0]
    s = out.outputs[0].spec_stats
    assert s.num_accepted_tokens == s.num_draft_tokens  # α = 1
    # the first token is plain, then 4 × (γ + 1)
    assert s.num_steps == 4 and s.tokens_per_step == gamma + 1
    _whole(llm)


def test_sampling_is_seeded_and_blocks_return():
    """With the controller's cost pinned (speculative_cost), γ follows α alone, so a seed fixes the
    tokens; the measured default lets the machine's speed choose γ, and with it which random draws a
    sample consumes."""
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=30, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM("demo", block_size=4, speculative_model="demo-draft", num_speculative_tokens=4,
                  speculative_cost=0.1)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        _whole(llm)
    assert runs[0] == runs[1]
    assert all(len(t) == 30 for t in runs[0])


def test_preemption_and_n_samples_with_speculation(plain):
    """A pool too small for the batch: sequences are preempted mid-speculation and recomputed; the
    greedy tokens still equal the target alone's. Two samples of one prompt share its blocks."""
    llm = LLM("demo", block_size=4, num_blocks=40, max_num_seqs=8, speculative_model="demo-draft",
              num_speculative_tokens=4, speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs)} == plain
    two = llm.generate(PROMPTS[0],
                       SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [plain[PROMPTS[0]][:12]] * 2
    _whole(llm)


def test_abort_mid_generation_frees_both_pools():
    llm = LLM("demo", block_size=4, speculative_model="demo-draft", num_speculative_tokens=4,
              speculative_cost=0.1)
    e = llm.engine
    rid = e.add_request("ROMEO:", SamplingParams(max_tokens=60, ignore_eos=True))
    e.add_request("JULIET:", SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(4):
        e.step()
    assert e.spec.proposer.seqs, "the draft holds blocks mid-generation"
    e.abort_request(rid)
    while e.has_unfinished_requests():
        e.step()
    _whole(llm)


def test_verification_read_one_position_late_is_caught(plain, monkeypatch):
    """Negative control: verify draft i against the logits of position i + 1 (an off-by-one in the
    verification index) and the greedy output is no longer the target's."""
    def shifted(rows):  # each row's logits: γ+1, V
        for r in rows:
            r.logits = torch.cat([r.logits[1:], r.logits[-1:]])
        return verify_batch(rows)

    monkeypatch.setattr(spec_decode, "verify_batch", shifted)
    llm = LLM("demo", block_size=4, speculative_model="demo-draft", num_speculative_tokens=4,
              speculative_adaptive=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs)} != plain
    _whole(llm)


def test_adaptive_gamma_switches_a_useless_draft_off(hf_checkpoints):
    """Greedy, the demo model with a tiny random model as the draft (α ≈ 0, cheap): it ends up
    speculating on few steps — the switch-off, with rare probes. The demo pair (α ≈ 0.5–0.6, a
    draft 11× smaller) keeps speculating on (nearly) every step. The target as its own draft has
    α = 1 but costs as much as the target: no γ pays, so it is switched off too. The costs are
    pinned (c = 0.1, 0.1, 1: what the parameter ratios say) so the choices depend on α alone, not on
    speed."""
    path, other = str(hf_checkpoints["gpt2"][0]), str(hf_checkpoints["llama-mha"][0])
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    def stats(llm, prompt):
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        _whole(llm)
        return out.spec_stats

    bad = stats(LLM("demo", speculative_model=other, num_speculative_tokens=4,
                    speculative_cost=0.1), "ROMEO:\n")
    # of 80 tokens: mostly plain steps once α is seen to be low
    assert bad.acceptance_rate < 0.2 and bad.num_steps < 16
    good = stats(LLM("demo", speculative_model="demo-draft", num_speculative_tokens=4,
                     speculative_cost=0.1),
                 "ROMEO:\n")
    # ≥ 70 of 80 tokens from speculative steps
    assert good.acceptance_rate > 0.4 and good.num_emitted_tokens >= 70
    itself = stats(LLM(path, speculative_model=path, num_speculative_tokens=4,
                       speculative_cost=1.0), [1, 2, 3])
    assert itself.acceptance_rate == 1.0 and itself.num_emitted_tokens < 30


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_model="demo-draft", num_speculative_tokens=0),
     r"num_speculative_tokens=0 must be an integer"),
    (dict(speculative_model="demo-draft", num_speculative_tokens=17), r"num_speculative_tokens=17"),
    (dict(speculative="lookahead"), r"speculative='lookahead'; allowed: draft, ngram, medusa"),
    (dict(speculative="draft"), r"needs speculative_model"),
    (dict(speculative_model="/nonexistent/draft"), r"could not be loaded"),
    (dict(speculative_model="demo-draft", speculative_cost=-1),
     r"speculative_cost=-1 must be a finite number ≥ 0"),
    (dict(speculative_model="demo-draft", speculative_cost="fast"), r"speculative_cost='fast'"),
])
def test_bad_speculative_settings(kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        LLM("demo", **kwargs)


def test_draft_with_another_vocabulary_is_refused(hf_checkpoints):
    from nanoserve.models.loader import resolve_model_path

    stories = resolve_model_path("demo")  # 257-token byte vocabulary
    with pytest.raises(NanoserveError, match=r"vocabulary \(\d+ tokens\) differs"):
        LLM(str(stories), speculative_model=str(_stories260k()))


def _stories260k():
    from testdata import shared_path

    return shared_path("models", "stories260K", "stories260K.bin")


def test_spec_stats_are_consistent():
    llm = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=3,
              speculative_adaptive=False)
    out = llm.generate("ROMEO:",
                       SamplingParams(temperature=1.0, max_tokens=40, seed=1, ignore_eos=True),
                       use_tqdm=False)[0]
    s = out.outputs[0].spec_stats
    assert s.num_emitted_tokens == s.num_accepted_tokens + s.num_steps  # each step: accepted + 1
    assert s.num_emitted_tokens <= len(out.token_ids)
    assert torch.isclose(torch.tensor(s.acceptance_rate),
                         torch.tensor(s.num_accepted_tokens / s.num_draft_tokens))


def test_cli_generate_with_a_draft_model_matches_plain_greedy():
    import subprocess
    import sys

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "--prompt", "ROMEO:",
                            "--max-tokens", "24",
                            "--temperature", "0", *extra], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r

    spec = run("--speculative-model", "demo-draft", "--num-speculative-tokens", "3")
    assert spec.stdout == run().stdout and "tokens/step=" in spec.stderr
    bad = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "--prompt", "x",
                          "--speculative-model",
                          "demo-draft", "--num-speculative-tokens", "0"], capture_output=True,
                         text=True, timeout=300)
    assert (
        bad.returncode == 2 and "num_speculative_tokens=0" in bad.stderr
        and "Traceback" not in bad.stderr
    )
