"""KV-cache eviction on the paged cache: StreamingLLM's sinks + recent window, and SnapKV.

A request with `SamplingParams(kv_eviction=KVEvictionConfig(...))` (config/kv_eviction.py) keeps a
bounded part of its K/V. Decisions are per block: an evicted block's entry in the block table
becomes NULL_BLOCK and the block goes back to the pool (`BlockAllocator.evict`). Taught in
notebooks/20_kv_eviction.ipynb; exercise 23.

**StreamingLLM** (Xiao et al. 2023). Softmax attention parks mass on the first tokens whatever they
say ("attention sinks"); a window that drops them breaks the model, one that keeps them does not.
After each step, with t tokens computed, a sequence keeps

    the sink blocks  0 .. S−1                 S = ⌈num_sink_tokens / block_size⌉  (rounded UP)
    the last W full blocks before the block being filled,  W = ⌊kv_budget / block_size⌋ − S
    the block being filled (t mod block_size tokens), if any

so it never holds more than S + W + 1 blocks between steps (plus the new blocks a prefill chunk
fills; a prompt is allocated whole at admission, as every prompt is). A query computed in a step
that starts at t sees the keys of those blocks and this step's own, causally.

**SnapKV** (Li et al. 2024). One decision when the prompt is done: the last `observation_window`
prompt queries vote with their attention probabilities (summed over layers, heads and the window's
queries, then over the block's keys: the block is the pooling) and the prompt keeps the sink blocks,
the blocks the window's own tokens occupy, and the best-voted others up to ⌊kv_budget / block_size⌋
full blocks. Generated tokens are all kept (SnapKV compresses the prompt). H2O (Zhang et al. 2023)
would re-score every step from accumulated attention, which the flash kernels never materialise;
SnapKV needs one small torch pass: the window's tokens run through the model again over the cached
K/V with an attention that records its probabilities (`ScoringView`).

**Positions.** nanoserve caches keys already rotated (RoPE) or added to (GPT-2's learned positions)
at their original positions, and a new query is rotated at its true position: a kept key keeps its
distance to every query. StreamingLLM's paper instead caches keys before RoPE and re-numbers them
by their slot in the cache, so distances shrink to at most the cache size. Here nothing is
re-numbered: the model runner hands the backends each evicting row's live blocks only
(`model_runner.attended_block_table`) and a context length without the evicted tokens, and every
kernel aligns causality by kv_len − q_len, which stays right; the torch backend's mask uses the
same alignment (torch_backend.cache_positions). No kernel changed.

**Prefix caching.** Blocks registered before a sequence's first eviction saw every key and stay
valid cache entries; once it has evicted, it registers nothing more (BlockAllocator.mark_computed).

**Refused**: a sliding-window model, speculative decoding, async scheduling, parallel ranks, and
SnapKV over a quantized pool (`check_request` names each).
"""

from __future__ import annotations

import math

import torch

from ..config.kv_eviction import KVEvictionConfig
from ..errors import NanoserveError
from .sequence import NULL_BLOCK, Sequence


# ------------------------------------------------------------------ which blocks each policy keeps
def streaming_kept_blocks(num_tokens: int, block_size: int, sink_blocks: int,
                          window_blocks: int) -> list[int]:
    """StreamingLLM's blocks, with `num_tokens` computed: the first `sink_blocks`, the last
    `window_blocks` full blocks, and the block being filled (if the last one is partial)."""
    full = num_tokens // block_size
    kept = list(range(min(sink_blocks, full)))
    kept += range(max(sink_blocks, full - window_blocks), full)
    if num_tokens % block_size:
        kept.append(full)
    return kept


def snapkv_kept_blocks(block_scores: list[float], num_prompt_tokens: int, block_size: int,
                       sink_blocks: int, budget_blocks: int, observation_window: int) -> list[int]:
    """SnapKV's prompt blocks: the sinks, the blocks holding the observation window's tokens (the
    last `observation_window` prompt tokens) and the partial last block, then the full blocks
    between them with the highest `block_scores` (one per full block; ties: the earlier block)
    until `budget_blocks` full blocks are kept. Sorted."""
    full = num_prompt_tokens // block_size
    first_observed = max(num_prompt_tokens - observation_window, 0) // block_size
    forced = set(range(min(sink_blocks, full))) | set(range(first_observed, -(-num_prompt_tokens
                                                                               // block_size)))
    candidates = [i for i in range(full) if i not in forced]
    room = max(budget_blocks - sum(i < full for i in forced), 0)
    ranked = sorted(candidates, key=lambda i: (-block_scores[i], i))
    return sorted(forced | set(ranked[:room]))


def blocks_to_evict(seq: Sequence, kept: list[int], num_tokens: int,
                    block_size: int) -> list[int]:
    """seq's full blocks among its first `num_tokens` tokens still held and not in `kept`."""
    keep = set(kept)
    full = num_tokens // block_size
    return [i for i in range(full) if i not in keep and seq.block_table[i] != NULL_BLOCK]


# ------------------------------------------------------------------ SnapKV's scores
class ScoringView:
    """A cache view for one sequence's observation window, run after its prompt: each layer's
    attention reads the sequence's cached K/V (the window's own keys among them: the prefill wrote
    them), writes nothing, and adds its probabilities on every key (summed over heads and queries)
    to `scores` [num_keys]."""

    def __init__(self, kv, block_table: list[int], num_keys: int):
        self.kv, self.num_keys = kv, num_keys
        self.table = torch.tensor(block_table, device=kv.k.device)  # M
        self.scores = torch.zeros(num_keys, dtype=torch.float64, device=kv.k.device)  # P

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor, window: int | None = None, scale: float | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Attend q [1, T, H, D] (the window's queries, at `positions`) over the cached keys,
        causally, recording the probabilities; k, v are in the pool already. Returns [1, T, H,
        D]."""
        pool_k, pool_v = self.kv.layer(layer)  # num_blocks, block_size, Hkv, D
        keys = pool_k[self.table].flatten(0, 1)[:self.num_keys].float()  # P, Hkv, D
        values = pool_v[self.table].flatten(0, 1)[:self.num_keys].float()  # P, Hkv, D
        H, D = q.shape[2], q.shape[3]
        group = H // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # P, H, D
        values = values.repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,phd->htp", q[0].float(), keys)  # H, T, P
        logits = logits * (scale if scale is not None else 1 / math.sqrt(D))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        key_pos = torch.arange(self.num_keys, device=q.device)  # P
        visible = key_pos[None, :] <= positions[0][:, None]  # T, P
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)  # H, T, P
        self.scores += probs.sum((0, 1)).double()
        out = torch.einsum("htp,phd->thd", probs, values)  # T, H, D
        return out[None].to(q.dtype)  # 1, T, H, D

    def advance(self, n: int) -> None:
        """Nothing to track (CausalLM.forward calls it after the blocks)."""


@torch.inference_mode()
def snapkv_key_scores(runner, seq: Sequence, observation_window: int) -> torch.Tensor:
    """[num_prompt_tokens] float64: the attention probability every prompt key gets from the last
    `observation_window` prompt queries, summed over layers, heads and those queries. Runs the
    window's tokens through the model again over seq's cached K/V (nothing is written)."""
    P = seq.num_prompt_tokens
    start = max(P - observation_window, 0)
    device = runner.device
    ids = torch.tensor([seq.token_ids[start:P]], device=device)  # 1, w
    positions = torch.arange(start, P, device=device)[None]  # 1, w
    view = ScoringView(runner.kv, seq.block_table, P)
    runner.model(ids, positions, cache=view, logit_index=torch.zeros(1, 1, dtype=torch.long,
                                                                      device=device))
    return view.scores


def block_sums(key_scores: torch.Tensor, block_size: int) -> list[float]:
    """Per full block, the sum of its keys' scores."""
    full = len(key_scores) // block_size
    return key_scores[:full * block_size].view(full, block_size).sum(-1).tolist()


# ------------------------------------------------------------------ the engine's side
def check_request(config: KVEvictionConfig, engine) -> None:
    """Refuse, by name, an eviction policy this engine cannot honour."""
    config.blocks(engine.block_allocator.block_size)  # the budget against the block size
    reasons = {
        "a sliding-window model (its window already frees blocks; sinks would need a second "
        "mask rule)": engine.config.kv_window is not None,
        "speculative decoding (its rollback would have to restore evicted blocks)":
            engine.spec is not None,
        "async scheduling (decisions are taken between the forward and the update)":
            engine.overlap is not None,
        "tensor or pipeline parallel ranks": engine.workers is not None,
        "SnapKV over a quantized KV pool (its scores read the pool in float)":
            config.policy == "snapkv" and engine.runner.kv.quant is not None,
    }
    for what, refused in reasons.items():
        if refused:
            raise NanoserveError(f"kv_eviction policy={config.policy!r} cannot run with {what}; "
                                 "allowed: policy='none', or an engine without it")


def admit(config: KVEvictionConfig, engine) -> None:
    """A request that evicts, checked (`check_request`); the first one adds the engine's step hook,
    so an engine whose requests never evict runs no per-step eviction code."""
    check_request(config, engine)
    if not any(isinstance(hook, KVEvictionHook) for hook in engine.step_hooks):
        engine.step_hooks.append(KVEvictionHook())


class KVEvictionHook:
    """The engine's step hook (LLMEngine.step_hooks): after each forward, the blocks each evicting
    row gives back, handed to the scheduler (`Scheduler.plan_eviction`), which frees them once the
    step's tokens are computed."""

    def before_forward(self, engine, step) -> None:
        """Nothing: decisions follow the forward."""

    def after_forward(self, engine, step, logits) -> None:
        """Each evicting row's decision, from its computed tokens once this step's are in."""
        bs = engine.block_allocator.block_size
        for seq, n in zip(step.sched.seqs, step.sched.num_new):
            config = seq.kv_eviction
            if config is None or seq.request_id not in engine.requests:
                continue
            num_tokens = seq.num_computed_tokens + n  # computed once this step is
            kept = self.kept_blocks(engine, seq, config, num_tokens, bs)
            if kept is None:
                continue
            evict = blocks_to_evict(seq, kept, num_tokens, bs)
            if evict:
                engine.scheduler.plan_eviction(seq, evict)

    def after_step(self, engine, step) -> None:
        """Nothing to do after sampling."""

    @staticmethod
    def kept_blocks(engine, seq: Sequence, config: KVEvictionConfig, num_tokens: int,
                    bs: int) -> list[int] | None:
        """The blocks the policy keeps with `num_tokens` computed; None: no decision this step."""
        sink_blocks, budget_blocks = config.blocks(bs)
        if config.policy == "streaming":
            return streaming_kept_blocks(num_tokens, bs, sink_blocks, budget_blocks - sink_blocks)
        prompt_done_now = seq.num_computed_tokens < seq.num_prompt_tokens <= num_tokens
        if config.policy != "snapkv" or not prompt_done_now:
            return None
        scores = snapkv_key_scores(engine.runner, seq, config.observation_window)
        return snapkv_kept_blocks(block_sums(scores, bs), seq.num_prompt_tokens, bs, sink_blocks,
                                  budget_blocks, config.observation_window)
