"""Medusa's token tree in the engine (speculative_tree: spec/tree_sampler.py and its tree_mask,
spec_decode.SpecDecoder._accept_tree), on the demo model with conftest's trained heads.

Greedy: the output equals the target's own greedy output token for token (γ = 1 and 3, batch > 1,
block size 4, preemption, n = 2, prefix-cache hits; the torch, cpu and triton backends), with more
tokens accepted per step than the chain of top-1 drafts, and with accepted paths that leave the
first branch (so the K/V move ran). The logprob of every emitted token equals the target's own at
that position (to 1e-4): each accepted node was scored seeing its ancestors only. Controls: a causal
mask in place of the tree mask, and a K/V move that does nothing, each break that equality.
T > 0: the joint law of the first three tokens through the public API is the target's, by χ² (the
second and third come from one tree verification); the control — always accept the first child —
fails it.
"""

from __future__ import annotations

import pytest
import torch
from chi2 import goodness_of_fit

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sampler import probs_from_logits
from nanoserve.errors import NanoserveError
from nanoserve.kv.cache import PagedKVCache
from nanoserve.spec import tree_sampler
from nanoserve.spec.tree_sampler import DEFAULT_TREE

PROMPTS = ["ROMEO:\nWhat light through yonder", "To be, or not to be",
           "First Citizen:\nBefore we proceed any further,",
           "KING"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)


def _llm(heads, tree="default", gamma=3, **kw) -> LLM:
    return LLM("demo", block_size=4, speculative="medusa", speculative_model=str(heads),
               num_speculative_tokens=gamma,
               speculative_adaptive=False, speculative_tree=tree, attention_backend="torch", **kw)


@pytest.fixture(scope="module")
def plain():
    """The target alone: {prompt: (token ids, each one's logprob)}."""
    outs = LLM("demo", block_size=4, attention_backend="torch").generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    return {p: _tokens_and_logprobs(o) for p, o in zip(PROMPTS, outs)}


def _tokens_and_logprobs(out):
    o = out.outputs[0]
    return o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]


def _check_equal(outs, plain, prompts=PROMPTS):
    for p, out in zip(prompts, outs):
        tokens, lps = _tokens_and_logprobs(out)
        assert tokens == plain[p][0]
        assert torch.allclose(torch.tensor(lps), torch.tensor(plain[p][1]), atol=1e-4), p


@pytest.fixture
def moves(monkeypatch):
    """Counts the K/V moves of accepted paths (copy_slots calls)."""
    calls = []
    real = PagedKVCache.copy_slots

    def counted(self, src, dst):
        calls.append(len(src))
        real(self, src, dst)
    monkeypatch.setattr(PagedKVCache, "copy_slots", counted)
    return calls


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_tree_equals_target_alone_and_accepts_more_than_the_chain(
    medusa_trained, plain, moves, gamma
):
    heads = medusa_trained[0]
    outs = _llm(heads, gamma=gamma).generate(PROMPTS, GREEDY, use_tqdm=False)
    _check_equal(outs, plain)
    tree = [o.outputs[0].spec_stats for o in outs]
    chain = [
        o.outputs[0].spec_stats
        for o in _llm(heads, None, gamma).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    per_step = lambda stats: (
        sum(s.num_accepted_tokens for s in stats) / sum(s.num_steps for s in stats)
    )
    assert per_step(tree) > per_step(chain) > 0, (per_step(tree), per_step(chain))
    assert moves, "no accepted path left the first branch: the K/V move was never exercised"


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_greedy_tree_on_the_other_backends(medusa_trained, plain, moves, backend):
    """The Triton kernels read the tree as bits per query (flash_attention's tree_bits; interpreted
    here); the cpu backend (the CPU default) verifies through the torch path. Both equal the target
    alone."""
    llm = LLM("demo", block_size=4, speculative="medusa", speculative_model=str(medusa_trained[0]),
              num_speculative_tokens=3, speculative_adaptive=False, speculative_tree="default",
              attention_backend=backend)
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS[:2], short, use_tqdm=False)
    for p, out in zip(PROMPTS[:2], outs):
        tokens, lps = _tokens_and_logprobs(out)
        assert tokens == plain[p][0][:16]
        assert torch.allclose(torch.tensor(lps), torch.tensor(plain[p][1][:16]), atol=1e-4), p
    assert moves and sum(o.outputs[0].spec_stats.num_accepted_tokens for o in outs) > 0


def test_tree_with_preemption_samples_and_prefix_hits(medusa_trained, plain):
    llm = _llm(medusa_trained[0], num_blocks=40, max_num_seqs=8)
    prompts = PROMPTS + PROMPTS[:2]  # the repeats hit the prefix cache
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    _check_equal(outs, plain, prompts)
    two = llm.generate(PROMPTS[0],
                       SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [plain[PROMPTS[0]][0][:12]] * 2
    # every block back, the bookkeeping whole, the Medusa state let go of
    bm = llm.engine.block_allocator
    assert bm.num_free_blocks() == bm.num_blocks and not llm.engine.spec.proposer.hidden
    bm.check_invariants()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_slots_moves_every_layers_keys_values_and_scales(kv_cache_dtype):
    from nanoserve.models.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=32, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=32, max_position_embeddings=64)
    cache = PagedKVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu",
                         attention_backend="torch", kv_cache_dtype=kv_cache_dtype)
    pools = [p for p in (cache.k, cache.v, cache.k_scale, cache.v_scale) if p is not None]
    for p in pools:
        p.copy_(torch.randint(-100, 100, p.shape).to(p.dtype))
    before = [p.clone().view(p.shape[0], 16, *p.shape[3:]) for p in pools]  # layers, slots, ...
    # node 4 of a tree rooted at slot 1 accepted first, then node 8
    cache.copy_slots([5, 9], [1, 2])
    assert len(pools) == (4 if kv_cache_dtype == "int8" else 2)
    for p, old in zip(pools, before):
        now = p.view_as(old)
        assert torch.equal(now[:, 1], old[:, 5]) and torch.equal(now[:, 2], old[:, 9])
        keep = [s for s in range(16) if s not in (1, 2)]
        assert torch.equal(now[:, keep], old[:, keep])


@pytest.mark.parametrize("broken", ["causal mask", "no K/V move"])
def test_controls_break_the_equality(medusa_trained, plain, monkeypatch, broken):
    # every tree row treated as a chain: a node sees its siblings' branches
    if broken == "causal mask":
        real = tree_sampler.tree_mask
        monkeypatch.setattr(tree_sampler, "tree_mask", lambda trees,
                            *a: real([None] * len(trees), *a))
    else:
        monkeypatch.setattr(PagedKVCache, "copy_slots", lambda self, src, dst: None)
    outs = _llm(medusa_trained[0]).generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(AssertionError):
        _check_equal(outs, plain)


def test_tree_settings_are_checked_by_name(medusa_trained):
    heads = str(medusa_trained[0])
    with pytest.raises(NanoserveError, match="speculative_tree is for speculative='medusa'"):
        LLM("demo", speculative="ngram", speculative_tree="default")
    with pytest.raises(NanoserveError, match="speculative_tree needs speculative=<method>"):
        LLM("demo", speculative_tree="default")
    for bad, match in [([(0, 0)], "without its parent path"), ([(0,), (0,)], "twice"),
                       ([()], "non-empty"),
                       ([(-1,)], "indices ≥ 0"), ("wide", "list of paths"), ([(0,)] * 0, "1..16")]:
        with pytest.raises(NanoserveError, match=match):
            LLM("demo", speculative="medusa", speculative_model=heads, speculative_tree=bad)
    with pytest.raises(NanoserveError, match="path of length 4 but the Medusa heads predict 3"):
        LLM("demo", speculative="medusa", speculative_model=heads, num_speculative_tokens=3,
            speculative_tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(NanoserveError, match="candidate 300 of a head; the vocabulary has 257"):
        LLM("demo", speculative="medusa", speculative_model=heads, num_speculative_tokens=3,
            speculative_tree=[(0,), (300,)])
    with pytest.raises(NanoserveError, match="triton backend needs kv_cache_dtype='auto'"):
        LLM("demo", speculative="medusa", speculative_model=heads, num_speculative_tokens=3,
            speculative_tree="default", attention_backend="triton", kv_cache_dtype="int8")
    assert DEFAULT_TREE == sorted(DEFAULT_TREE, key=lambda c: (len(c), c))


def _joint_law3(llm: LLM, prompt: str, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) of the target alone at `params`, exactly, from its logits."""
    ids = llm.encode_prompt(prompt)
    law = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, p in law.items():
            probs = probs_from_logits(llm.logits(ids + list(prefix))[-1:], params.temperature,
                                      params.top_k,
                                      params.top_p)[0].double()
            for x in probs.nonzero().flatten().tolist():
                grown[prefix + (x,)] = p * probs[x].item()
        law = grown
    return law


@pytest.mark.parametrize("first_child", [False, True])
def test_sampling_keeps_the_targets_joint_law(medusa_trained, monkeypatch, first_child):
    settings = dict(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    law = _joint_law3(medusa_trained[1], "ROMEO:\n", SamplingParams(**settings))
    # the control: accept the first child at every node, then draw the bonus token from p
    if first_child:
        def first(parents, tokens, p, q, generator=None):
            kids = [
                [c for c in range(1, len(parents)) if parents[c] == u] for u in range(len(parents))
            ]
            u, out, path = 0, [], []
            while kids[u]:
                u = kids[u][0]
                out.append(tokens[u])
                path.append(u)
            return out + [int(torch.multinomial(p[u].double(), 1, generator=generator))], path
        monkeypatch.setattr("nanoserve.spec.spec_decode.tree_rejection_sample", first)
    # budget: every row
    llm = _llm(medusa_trained[0], gamma=2, max_num_seqs=128, max_num_batched_tokens=4096)
    n = 3000
    outs = llm.generate(["ROMEO:\n"] * n,
                        [SamplingParams(**{**settings, "seed": s}) for s in range(n)],
                        use_tqdm=False)
    stats = [o.outputs[0].spec_stats for o in outs]
    # token 2 (and 3) from a 5-node tree
    assert sum(s.num_draft_tokens for s in stats if s) > 0.9 * 5 * n
    triples = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    cells = sorted(law)
    counts = torch.tensor([sum(1 for t in triples if t == c) for c in cells], dtype=torch.float64)
    outside = len(triples) - int(counts.sum())  # triples the target's law cannot give
    _, _, pvalue = goodness_of_fit(counts, torch.tensor([law[c] for c in cells]))
    if first_child:
        assert outside > 0 or pvalue < 1e-6
    else:
        assert outside == 0 and pvalue > 1e-3, (outside, pvalue)
