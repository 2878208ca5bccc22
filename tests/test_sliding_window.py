"""Sliding-window attention through the whole engine, and the KV blocks it gives back.

A Mistral-style model attends, in every layer, to the `window` newest keys only. So once a block's
last key is more than window − 1 positions behind every future query, no one reads it again and the
block allocator gives it back to the pool (`free_out_of_window`): a long generation holds
O(window) blocks, not O(length). Proof, with transformers' MistralForCausalLM (window 8) as the
oracle for the tokens:
- greedy tokens with freeing == without freeing == HF generate, through continuous batching,
  chunked prefill, prefix caching, parallel samples and both attention backends;
- the blocks a generating sequence holds stay ≤ ceil(window / block_size) + 1 after every step (its
  window's keys span at most that many blocks; a prompt is allocated whole, then trimmed);
- the pool is whole at the end (every block free, invariants hold);
- negative control: a runner that reads the given-back entries as they are (−1) fails loudly.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sequence import NULL_BLOCK
from nanoserve.kv import KVCache
from nanoserve.models.loader import load_model

# the "mistral-window" checkpoint of testdata.hf_configs: a window of 8 in both layers
WINDOW, BS = 8, 4
# 6, 23 and 13 tokens: one prefilled in chunks
PROMPTS = [[3, 17, 42, 5, 99, 7], list(range(20, 43)), [9] * 13]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(hf_checkpoints, free: bool = True, **kwargs) -> LLM:
    llm = LLM(str(hf_checkpoints["mistral-window"][0]), dtype="float32", device="cpu",
              block_size=BS,
              max_num_batched_tokens=16, **kwargs)
    assert llm.engine.config.kv_window == WINDOW
    if not free:
        llm.block_allocator.sliding_window = None  # keep every block: the plain paged cache
    return llm


def _run(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], int]:
    """Step the engine to the end; (tokens per prompt, most blocks a sequence held after a step,
    once past its prompt)."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    tokens, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [o.token_ids for o in out.outputs]
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                most = max(most, sum(b != NULL_BLOCK for b in seq.block_table))
    bm = llm.block_allocator
    assert bm.num_free_blocks() == bm.num_blocks  # the pool is whole again
    bm.check_invariants()
    return [tokens[i] for i in ids], most


def test_windowed_gather_equals_the_whole_table(hf_checkpoints, monkeypatch):
    """The torch backend gathers only the blocks a window reaches (shifting positions by the first
    one's start); the logits equal those of gathering every row's whole table, up to float
    rounding."""
    from nanoserve.kv.torch_backend import CacheView

    def logits():
        model, cfg, _ = load_model(hf_checkpoints["mistral-window"][0], dtype="float32",
                                   device="cpu")
        ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
        cache = KVCache(cfg, 2, 40, block_size=4)
        with torch.no_grad():
            return torch.cat(
                [model(ids[:, :13], cache=cache)]
                + [model(ids[:, t : t + 1], cache=cache) for t in range(13, 40)], 1,
            )

    windowed = logits()
    monkeypatch.setattr(CacheView, "_window_tables", lambda self, window, positions: None)
    assert (windowed - logits()).abs().max() <= 1e-5


def test_freeing_blocks_changes_no_token_and_matches_hf(hf_checkpoints):
    hf = hf_checkpoints["mistral-window"][1]
    freed, held = _run(_llm(hf_checkpoints), PROMPTS)
    kept, held_all = _run(_llm(hf_checkpoints, free=False), PROMPTS)
    assert freed == kept
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, freed):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                              do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out[0] == ref
    # O(window) blocks, against O(length) without freeing
    assert held <= math.ceil(WINDOW / BS) + 1 < held_all
    assert held_all == math.ceil((23 + 40 - 1) / BS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_parallel_samples_prefix_hits_and_backends(hf_checkpoints, backend):
    """n = 2 forks share blocks (each fork gives back its own references); the second call's prompt
    hits the prefix cache; the Triton kernels start reading at the window, never at a given-back
    block."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True)
    runs = []
    for free in (True, False):
        llm = _llm(hf_checkpoints, free, attention_backend=backend)
        first, held = _run(llm, PROMPTS[:2], params)
        # 4 full blocks in common with the first call
        second, _ = _run(llm, [PROMPTS[1][:16] + [5, 6]], params)
        assert llm.block_allocator.stats.hits >= 4
        runs.append((first, second))
        if free:
            assert held <= math.ceil(WINDOW / BS) + 1
    assert runs[0] == runs[1]


@pytest.mark.parametrize("backend,error", [("torch", "index out of range"),
                                           ("cpu", "block_tables hold block ids outside 0 .. 511")])
def test_a_runner_that_reads_given_back_entries_fails(hf_checkpoints, monkeypatch, backend, error):
    """Negative control: the torch backend's windowed gather starts past the given-back entries; on
    its whole-table path (a window no shorter than the table) it reads them, and without the model
    runner's substitution the −1 entries reach the gather (an index out of range there; the request
    fails alone, with that error). The cpu backend checks a decode step's table before its kernel
    runs, and names the bad ids."""
    from nanoserve.engine import model_runner
    from nanoserve.errors import RequestFailedError
    from nanoserve.kv.torch_backend import CacheView

    llm = _llm(hf_checkpoints, attention_backend=backend)
    # nothing equals it: −1 goes through as is
    monkeypatch.setattr(model_runner, "NULL_BLOCK", object())
    # the whole table
    monkeypatch.setattr(CacheView, "_window_tables", lambda self, window, positions: None)
    with pytest.raises(RequestFailedError, match=error):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)


def test_speculative_decoding_with_a_window_changes_no_token(hf_checkpoints):
    """n-gram drafts verified over the window; the rollback moves num_computed_tokens back before
    the allocator gives blocks back (Scheduler.postprocess), so a rejected draft never costs a
    needed block."""
    plain, _ = _run(_llm(hf_checkpoints), PROMPTS)
    llm = _llm(hf_checkpoints, speculative="ngram", num_speculative_tokens=3, speculative_cost=0.0)
    spec, held = _run(llm, PROMPTS)
    assert spec == plain
    # + the γ draft tokens' slots during a verification
    assert held <= math.ceil(WINDOW / BS) + 1 + 3


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("name",
                         ["mistral-window", "qwen3-window", "gemma2", "gemma3", "smollm3", "olmo2", "phi3"])
def test_quantized_windowed_models_run_through_the_engine(hf_checkpoints, tmp_path, name, method):
    """int4 on the dense linears (q/k norms and windows untouched; AWQ folds into Gemma's MLP input
    norm, pre_feedforward_layernorm, as 1 + w): the GPTQ-format checkpoint reloads to the same
    logits as the packed in-memory model, and the engine's greedy tokens (paged; blocks given back
    when every layer slides) equal greedy decoding by full forwards of that model (test_quant_awq
    checks the folding itself)."""
    from nanoserve.models.loader import load_model
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import replace_linears, save_quantized

    path = hf_checkpoints[name][0]
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    calib = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    res = quantize_model(model, calib, QuantizeConfig(method=method, group_size=16), progress=False)
    out = save_quantized(model, res, tmp_path / "q", tokenizer_from=path)
    reloaded, _, _ = load_model(out, dtype="float32", device="cpu")
    packed = replace_linears(model, res.qweights)
    x = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x), packed(x))
        ids = list(PROMPTS[0])
        for _ in range(24):  # greedy by full forwards: no cache, no blocks
            ids.append(int(reloaded(torch.tensor([ids]))[0, -1].argmax()))
    llm = LLM(str(out), dtype="float32", device="cpu", block_size=BS)
    got = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)
    assert got[0].outputs[0].token_ids == ids[len(PROMPTS[0]):]


def test_a_block_whose_parent_left_the_window_unhashed_never_enters_the_prefix_cache():
    """Window 4 = block size, and a speculative step that accepts 2 drafts: block 1 leaves the
    window before it was ever hashed, so block 2 has no chain to hash. Hashed as if it began a
    prompt, it would hand its K/V (of positions 8..11, after other tokens) to any prompt starting
    with the same 4 tokens: a wrong answer."""
    from nanoserve.engine.block_allocator import BlockAllocator
    from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
    from nanoserve.engine.sequence import Sequence

    alloc = BlockAllocator(16, 4, True, sliding_window=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), alloc, 64)
    seq = Sequence(list(range(100, 106)))
    sched.add(seq)
    sched.schedule()
    sched.advance(seq, 6)
    sched.postprocess(seq, [106], False)
    for token in (107, 108, 109):  # decode steps
        sched.schedule()
        sched.advance(seq, 1)
        sched.postprocess(seq, [token], False)
    sched.schedule()
    start = len(seq)
    sched.extend(seq, [110, 111])  # two drafts, both accepted
    sched.rollback(seq, start, start + 2)
    sched.postprocess(seq, [110, 111, 112], False)
    assert seq.block_table[:2] == [NULL_BLOCK, NULL_BLOCK]
    # not cached: its parent was given back unhashed
    assert alloc.blocks[seq.block_table[2]].hash is None
    assert alloc._prefix_hits(Sequence([108, 109, 110, 111, 1, 2])) == []
    alloc.check_invariants()


def test_no_prefix_hit_on_blocks_computed_after_a_speculative_step(tmp_path):
    """End to end, window 4 = block size, n-gram drafts: prompts made of any later 4 tokens of the
    first request must get no prefix-cache hit (their K/V there was computed after other tokens);
    before the fix some did, and their logits missed transformers' by 4.5e-2. The first block, a
    true prefix, still hits."""
    import transformers
    from testdata import tiny_hf_checkpoint

    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4,
                                     num_key_value_heads=2, sliding_window=4, vocab_size=257,
                                     max_position_embeddings=256)
    tiny_hf_checkpoint(cfg, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4, speculative="ngram",
              num_speculative_tokens=4,
              speculative_cost=0.0)
    first = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]
    out = llm.generate([first], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)
    tokens = first + out[0].outputs[0].token_ids
    one = SamplingParams(temperature=0, max_tokens=1)
    # the true prefix
    assert llm.generate([tokens[:4] + [1]], one, use_tqdm=False)[0].num_cached_tokens == 4
    for i in range(4, len(tokens) - 4, 4):
        if tokens[i:i + 4] != tokens[:4]:
            got = llm.generate([tokens[i:i + 4] + [1]], one, use_tqdm=False)[0]
            assert got.num_cached_tokens == 0, (i, tokens[i:i + 4])
