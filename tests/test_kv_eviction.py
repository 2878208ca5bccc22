"""KV-cache eviction (engine/kv_eviction.py): StreamingLLM and SnapKV through the whole engine.

The oracle is the model run over the whole token sequence by a plain torch attention with an
explicit mask (`MaskView`): query p, computed in a step that started at s, sees key j ≤ p when j's
block is a sink block or one of the W full blocks before s's block or later — sinks plus a recent
window, at the original positions. Proofs:
- StreamingLLM: every prompt and generated token's log-probability equals the masked reference
  (fp32, |Δ| ≤ 1e-4) and the greedy tokens equal its argmax, on sequences 4× past the budget, with
  chunked prefill, batched with requests that do not evict — theirs equal the full causal
  reference (isolation) — on the torch, triton (interpreter) and CPU backends;
- evicted blocks go back to the pool: an evicting sequence holds ≤ S + W + 1 blocks after each
  decode step, the free count says so, and the pool is whole at the end;
- SnapKV keeps exactly the blocks chosen from transformers' own attention probabilities
  (output_attentions) by the definition, and decodes like the reference masked to them;
- prefix caching: only blocks computed before the first eviction are published; a full-cache
  request after an evicting one with the same prompt equals a fresh engine;
- refused inputs name the value; a sliding-window model is refused.
Negative controls: the reference without sinks, the engine without sinks, a query position offset
by the evicted tokens (StreamingLLM's re-numbering applied to the queries only), a SnapKV reference
that picks the most recent blocks, and an allocator that keeps publishing after an eviction — each
must fail the check it guards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams
from nanoserve.config.kv_eviction import KVEvictionConfig
from nanoserve.engine.sequence import NULL_BLOCK, Sequence
from nanoserve.errors import NanoserveError
from nanoserve.models.loader import load_model

BS = 4
STREAMING = KVEvictionConfig("streaming", kv_budget=16, num_sink_tokens=4)  # S = 1, W = 3 blocks
S_BLOCKS, W_BLOCKS = 1, 3
EVICTING_PROMPT = [(7 * i + 3) % 200 + 1 for i in range(34)]
OTHER_PROMPTS = [list(range(20, 33)), [9, 4, 11, 5, 2, 8, 6]]
MAX_TOKENS = 30  # 64 tokens in all: 4× the budget
TOL = 1e-4  # fp32 engine vs fp32 reference (measured ≤ 1e-5)


def _params(eviction=None, max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          prompt_logprobs=0, kv_eviction=eviction)


class MaskView:
    """The reference attention: SDPA over the T tokens' own K/V with an explicit [T, T] mask."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # B, H, T, D
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)

    def advance(self, n):
        pass


def streaming_mask(T: int, step_starts: list[int], sink_blocks: int, window_blocks: int):
    """From the definition: query p (computed in the step that started at s) sees key j ≤ p when
    j's block is a sink or is no older than W blocks before s's block."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for p in range(T):
        s = max(x for x in step_starts if x <= p)
        for j in range(p + 1):
            mask[p, j] = j // BS < sink_blocks or j // BS >= s // BS - window_blocks
    return mask


def reference_logprobs(model, tokens: list[int], mask: torch.Tensor) -> torch.Tensor:
    """log_softmax of the model's logits [T, V] over `tokens` with attention `mask`."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids, torch.arange(len(tokens))[None], cache=MaskView(mask))[0]
    return logits.float().log_softmax(-1)


def engine_logprobs(out) -> tuple[list[int], list[float]]:
    """(all tokens, the chosen token's logprob at positions 1 .. T−1) of a finished request."""
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    chosen = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    chosen += [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
    return tokens, chosen


def max_error(ref: torch.Tensor, tokens: list[int], chosen: list[float]) -> float:
    want = ref[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    return (want - torch.tensor(chosen)).abs().max().item()


def run_engine(llm: LLM, prompts, params):
    """Step to the end; (outputs by prompt, step starts per request id, most live blocks an
    evicting sequence held after a decode step)."""
    engine = llm.engine
    steps: dict[str, list[int]] = {}
    inner = engine.scheduler.schedule

    def schedule():
        out = inner()
        for seq in out.seqs:
            steps.setdefault(seq.request_id, []).append(seq.num_computed_tokens)
        return out

    engine.scheduler.schedule = schedule
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    done, most = {}, 0
    bm = llm.block_allocator
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        held = 0
        for seq in engine.scheduler.running:
            held += sum(b != NULL_BLOCK for b in seq.block_table)
            if seq.kv_eviction is not None and seq.num_computed_tokens > seq.num_prompt_tokens:
                most = max(most, sum(b != NULL_BLOCK for b in seq.block_table))
        assert bm.num_free_blocks() == bm.num_blocks - held  # evicted blocks are free
    assert bm.num_free_blocks() == bm.num_blocks
    bm.check_invariants()
    engine.scheduler.schedule = inner
    return [done[i] for i in ids], [steps[i] for i in ids], most


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    path = str(hf_checkpoints["llama-gqa"][0])
    model = load_model(path, "float32", "cpu")[0]
    return path, model


def _llm(path, backend="torch", **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=16,
               attention_backend=backend, enable_prefix_caching=False, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_streaming_equals_the_masked_reference_and_leaves_others_alone(llama, backend):
    path, model = llama
    llm = _llm(path, backend)
    prompts = [EVICTING_PROMPT] + OTHER_PROMPTS
    params = [_params(STREAMING)] + [_params()] * len(OTHER_PROMPTS)
    outs, steps, most = run_engine(llm, prompts, params)
    assert len(steps[0]) > 2 and steps[0][1] % 16 == 0  # chunked prefill ran
    tokens, chosen = engine_logprobs(outs[0])
    T = len(tokens)
    assert T >= 4 * STREAMING.kv_budget
    ref = reference_logprobs(model, tokens, streaming_mask(T, steps[0], S_BLOCKS, W_BLOCKS))
    assert max_error(ref, tokens, chosen) <= TOL
    P = len(EVICTING_PROMPT)
    assert ref[P - 1:T - 1].argmax(-1).tolist() == tokens[P:]  # greedy, token for token
    assert most <= S_BLOCKS + W_BLOCKS + 1  # the budget, plus the block being filled
    # negative control: the same reference without the sink block is far from the engine
    no_sinks = reference_logprobs(model, tokens, streaming_mask(T, steps[0], 0, W_BLOCKS))
    assert max_error(no_sinks, tokens, chosen) > 1e-2
    # isolation: the requests that do not evict equal the full causal reference
    for out in outs[1:]:
        tokens, chosen = engine_logprobs(out)
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        assert max_error(reference_logprobs(model, tokens, causal), tokens, chosen) <= TOL


def test_no_sinks_and_renumbered_queries_change_the_engine_output(llama, monkeypatch):
    path, model = llama
    llm = _llm(path)
    base, steps, _ = run_engine(llm, [EVICTING_PROMPT], [_params(STREAMING)])
    tokens, chosen = engine_logprobs(base[0])
    mask = streaming_mask(len(tokens), steps[0], S_BLOCKS, W_BLOCKS)
    assert max_error(reference_logprobs(model, tokens, mask), tokens, chosen) <= TOL
    # no sinks: plain truncation to a window of 4 blocks
    window_only = KVEvictionConfig("streaming", kv_budget=16, num_sink_tokens=0)
    other = run_engine(llm, [EVICTING_PROMPT], [_params(window_only)])[0][0]
    assert engine_logprobs(other)[1] != pytest.approx(chosen, abs=1e-3)
    # queries at positions re-numbered by the evicted tokens (keys keep theirs): RoPE disagrees
    runner = llm.engine.runner
    prepare = runner.prepare

    def renumbered(seqs, num_new, num_logits, trees=None):
        inputs = prepare(seqs, num_new, num_logits, trees)
        for i, seq in enumerate(seqs):
            inputs.positions[i] -= seq.num_evicted_blocks * BS
        return inputs

    monkeypatch.setattr(runner, "prepare", renumbered)
    shifted = run_engine(llm, [EVICTING_PROMPT], [_params(STREAMING)])[0][0]
    assert max_error(reference_logprobs(model, tokens, mask), tokens,
                     engine_logprobs(shifted)[1]) > 1e-3


def snapkv_reference_blocks(hf_model, prompt, sink_blocks, budget_blocks, window, recent=False):
    """SnapKV from its definition on transformers' attention probabilities: the last `window`
    queries' probabilities summed over layers, heads and queries, per full block; keep the sinks,
    the window's blocks, and the best others up to `budget_blocks` full blocks. `recent`: the
    wrong variant that keeps the latest blocks instead of the best-scored ones."""
    hf_model.set_attn_implementation("eager")
    with torch.no_grad():
        att = hf_model(torch.tensor([prompt]), output_attentions=True).attentions
    P = len(prompt)
    scores = sum(a[0, :, P - window:, :].sum((0, 1)) for a in att)  # P
    full = P // BS
    block_scores = scores[:full * BS].view(full, BS).sum(-1)
    forced = set(range(sink_blocks)) | set(range((P - window) // BS, -(-P // BS)))
    others = [i for i in range(full) if i not in forced]
    room = budget_blocks - len([i for i in forced if i < full])
    if recent:
        best = others[-room:]
    else:
        best = sorted(others, key=lambda i: -block_scores[i].item())[:room]
    return sorted(forced | set(best))


def test_snapkv_keeps_the_blocks_the_reference_scores_pick(hf_checkpoints, llama):
    path, model = llama
    hf_model = hf_checkpoints["llama-gqa"][1]
    config = KVEvictionConfig("snapkv", kv_budget=24, num_sink_tokens=4, observation_window=6)
    prompt = EVICTING_PROMPT + [5, 9, 2, 7, 1, 3]  # 40 tokens, 10 blocks; budget: 6 blocks
    llm = _llm(path)
    engine = llm.engine
    rid = engine.add_request(prompt, _params(config, max_tokens=12))
    kept = None
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        seqs = [s for s in engine.scheduler.running if s.request_id == rid]
        if kept is None and seqs and seqs[0].num_computed_tokens >= len(prompt):
            kept = [i for i, b in enumerate(seqs[0].block_table[:10]) if b != NULL_BLOCK]
    want = snapkv_reference_blocks(hf_model, prompt, 1, 6, 6)
    assert kept == want and len(kept) == 6
    assert kept != snapkv_reference_blocks(hf_model, prompt, 1, 6, 6, recent=True)  # control
    # decoding reads exactly those blocks: the reference masks the evicted ones from position P on
    tokens, chosen = engine_logprobs(outs[0])
    T, P = len(tokens), len(prompt)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in set(range(P // BS)) - set(kept):
        mask[P:, i * BS:(i + 1) * BS] = False
    assert max_error(reference_logprobs(model, tokens, mask), tokens, chosen) <= TOL


def test_prefix_cache_publishes_only_blocks_computed_before_the_first_eviction(llama,
                                                                              monkeypatch):
    path, _ = llama
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = EVICTING_PROMPT + list(range(40, 56))  # 50 tokens
    evicting = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                              kv_eviction=STREAMING)
    fresh = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=16)
    want = fresh.generate([prompt], [plain], use_tqdm=False)[0]

    def second_request(llm):
        llm.generate([prompt], [evicting], use_tqdm=False)
        return llm.generate([prompt], [plain], use_tqdm=False)[0]

    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=16)
    got = second_request(llm)
    # chunks of 16: the first two saw every key (nothing was evicted before them): 8 blocks
    assert got.num_cached_tokens == 32
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    got_lp = [next(iter(d.values())).logprob for d in got.outputs[0].logprobs]
    want_lp = [next(iter(d.values())).logprob for d in want.outputs[0].logprobs]
    assert got_lp == pytest.approx(want_lp, abs=TOL)
    # negative control: an allocator that keeps publishing after an eviction serves K/V computed
    # over an evicted cache as if it were the full prefix's
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=16)
    bad = second_request_with_leak(llm, prompt, evicting, plain, monkeypatch)
    assert bad.num_cached_tokens > 32
    bad_lp = [next(iter(d.values())).logprob for d in bad.outputs[0].logprobs]
    assert bad_lp != pytest.approx(want_lp, abs=1e-3)


def second_request_with_leak(llm, prompt, evicting, plain, monkeypatch):
    """The evicting request with an allocator that never sees the eviction when it publishes (the
    model runner still drops the evicted blocks), then the full-cache request."""
    allocator = llm.block_allocator
    mark = allocator.mark_computed

    def leaky(seq):
        with monkeypatch.context() as m:
            m.setattr(Sequence, "num_evicted_blocks", property(lambda self: 0))
            mark(seq)

    monkeypatch.setattr(allocator, "mark_computed", leaky)
    llm.generate([prompt], [evicting], use_tqdm=False)
    monkeypatch.undo()
    return llm.generate([prompt], [plain], use_tqdm=False)[0]


@pytest.mark.parametrize("kwargs, name", [
    (dict(policy="lru"), "policy"), (dict(kv_budget=0), "kv_budget"),
    (dict(num_sink_tokens=-1), "num_sink_tokens"), (dict(observation_window=0),
                                                    "observation_window")])
def test_bad_configs_are_refused_by_name(kwargs, name):
    with pytest.raises(NanoserveError, match=name):
        KVEvictionConfig(**kwargs)


def test_a_budget_without_room_past_the_sinks_and_a_window_model_are_refused(hf_checkpoints,
                                                                             llama):
    config = KVEvictionConfig("streaming", kv_budget=7, num_sink_tokens=4)
    with pytest.raises(NanoserveError, match="kv_budget=7"):
        config.blocks(4)  # 1 whole block, all of it sinks
    llm = _llm(llama[0])
    with pytest.raises(NanoserveError, match="kv_budget=7"):
        llm.engine.add_request([1, 2, 3], _params(config))
    window = LLM(str(hf_checkpoints["mistral-window"][0]), dtype="float32", device="cpu",
                 block_size=BS)
    with pytest.raises(NanoserveError, match="sliding-window"):
        window.engine.add_request([1, 2, 3], _params(STREAMING))
