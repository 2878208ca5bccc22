"""The model runner: one batched forward over several sequences, on the paged KV cache.

The scheduler decides *which* sequences run and *how many* new tokens each computes (a whole
prompt, a prefill chunk, or one decode token); the block allocator has already given them
slots. This file turns that decision into tensors — the only place where Sequences meet the
model:

    input_ids, positions  [B, T]   new tokens per row, right-padded to the longest
    slot_mapping          [B, T]   where each new token's K/V goes (−1: padding, not written)
    block_tables          [B, M]   each row's blocks, padded with its own first block (masked); a block
                                   given back by a sliding window reads as the row's last (masked too)
    context_lens          [B]      tokens in the cache once this step's are written

and returns each row's next-token logits (the logits of its last new token). `prepare` builds all
of it on the host and moves it once (`AttentionMetadata`); `execute` is the forward on device
tensors only, with no read back to the host — what a CUDA graph captures (engine/cuda_graph.py).

It is pure: sequences in, logits out. It reads each sequence's tokens, block table and
num_computed_tokens and writes nothing of theirs; the forward's K/V goes into the KV pool, and
the caller tells the scheduler what was computed (`Scheduler.advance`). Taught in notebooks/02_*.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from ..kv.cache import PagedKVCache
from ..kv.metadata import AttentionMetadata, host_tensor
from ..models.onednn import use_onednn_linears
from ..spec.rejection_sampler import MAX_SPECULATIVE_TOKENS
from ..spec.tree_sampler import ancestor_bits, tree_attention_mask, tree_positions
from .block import slots
from .cpu_allocator import advise_on_allocator
from .sequence import NULL_BLOCK, Sequence

PREFILL_SLACK = 1.25  # a prefill forward computes at most this × its real tokens (the rest: padding)
MAX_VERIFY_LOGITS = 1 + MAX_SPECULATIVE_TOKENS  # a verification row returns at most this many logits


def forward_groups(num_new: list[int], num_logits: list[int], slack: float = PREFILL_SLACK) -> list[list[int]]:
    """The rows of one step, split into forwards: the decode rows (1 new token) together, the
    verification rows (a few logits each) together, then the prefill rows longest first, a new
    forward whenever padding to the group's longest row would exceed `slack` × its real tokens. On
    the 256-request peer workload one forward for all prefills computed 1.72× the real tokens.
    Prefill rows that return every position's logits (prompt logprobs) are grouped the same way
    apart from the others, so a [B, K, V] logits tensor is never padded to one long row's K."""
    def kind(n: int, m: int) -> int:  # 0 decode, 1 verify, 2 prefill, 3 prefill with all its logits
        return 0 if n == 1 else 2 if m == 1 else 1 if m <= MAX_VERIFY_LOGITS else 3
    kinds = [kind(n, m) for n, m in zip(num_new, num_logits)]
    groups = [[i for i, g in enumerate(kinds) if g == want] for want in (0, 1)]
    for want in (2, 3):
        current: list[int] = []
        for i in sorted((i for i, g in enumerate(kinds) if g == want), key=lambda i: -num_new[i]):
            width = num_new[current[0]] if current else num_new[i]  # longest first: the first row's length
            if current and (len(current) + 1) * width > slack * (sum(num_new[j] for j in current) + num_new[i]):
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
    return [g for g in groups if g]


@dataclass
class ForwardInputs:
    """One forward's inputs, on the device: token ids and positions [B, T], which positions' logits
    to return [B, K], and the attention metadata (nanoserve/kv/metadata.py)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_index: torch.Tensor
    meta: AttentionMetadata


class ModelRunner:
    """The model and its paged KV pool; `run` is one batched forward over the scheduled sequences."""

    def __init__(self, model, num_blocks: int, block_size: int, attention_backend: str | None = None,
                 kv_cache_dtype: str = "auto", lora=None, kv_config=None, kv_layers: range | None = None):
        self.model, self.config = model, model.config
        self.onednn_off = use_onednn_linears(model)  # CPU GEMMs through oneDNN (models/onednn.py), or why not
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu":
            largest = max(t.numel() * t.element_size() for t in model.parameters())
            advise_on_allocator(largest)  # glibc's malloc, 4 KiB pages under the weights (engine/cpu_allocator.py)
        self.kv = PagedKVCache(kv_config or self.config, num_blocks, block_size, self.dtype, self.device,
                               attention_backend, kv_cache_dtype=kv_cache_dtype, layers=kv_layers)
        # (kv_config, kv_layers: one rank's share of the heads, or of the layers: nanoserve/parallel/)
        self.attention_backend = self.kv.attention_backend  # "torch", "triton" or "cpu" (see nanoserve/kv/)
        self.block_size = block_size
        self.graphs = None  # CudaGraphRunner once use_cuda_graphs() ran: decode steps replay graphs
        self.lora = lora  # a LoRAManager when the engine serves per-request adapters (lora/serving.py)
        self.hidden: dict[int, torch.Tensor] = {}  # with model.keep_hidden: seq_id -> [K, C] at its latest logits
        self.features: dict[int, list] = {}  # keep_hidden == "all": seq_id -> [(first position, [n, C]), ...]

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> str | None:
        """Capture decode CUDA graphs (engine/cuda_graph.py); returns why not when they cannot serve
        this runner (no CUDA, or the torch attention backend), else None."""
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if self.attention_backend != "triton":
            return "CUDA graphs need the triton attention backend (the torch one zeroes a varying set of blocks)"
        if self.lora is not None:  # its layers are wrapped as adapters arrive, and their slots change per step
            return "per-request LoRA adapters (enable_lora) run eagerly"
        if self.model.keep_hidden:
            return "draft heads read each step's hidden states (Medusa, EAGLE) eagerly"
        if any(getattr(m, "host_sync", False) for m in self.model.modules()):  # e.g. quant/llm_int8.py
            return "a layer reads device values on the host every call (LLM.int8's outlier features)"
        from .cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self, max_num_seqs, max_model_len)
        self.graphs.capture()
        return None

    def prepare(self, seqs: list[Sequence], num_new: list[int], num_logits: list[int],
                trees: list | None = None) -> ForwardInputs:
        """Build the step's tensors on the host, then move them to the device once; row i computes
        tokens num_computed .. num_computed + num_new[i] − 1 and returns its last num_logits[i] logits.
        trees[i], when given and not None: row i's new tokens are a token tree (their parents, node 0 the
        first new token), at positions by depth and each seeing its ancestors only (`tree_mask`)."""
        T, bs = max(num_new), self.block_size
        M = max(len(s.block_table) for s in seqs)
        ids, pos, slot_rows, tables, lens = [], [], [], [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new)):  # Python lists, one tensor each: O(tokens)
            start, pad = seq.num_computed_tokens, T - n
            ids.append(seq.token_ids[start:start + n] + [0] * pad)
            row_pos = list(range(start, start + n)) if trees is None or trees[i] is None else tree_positions(
                trees[i], start)  # a tree's nodes sit at the root's position + their depth
            pos.append(row_pos + [row_pos[-1]] * pad)  # padding looks at real keys
            slot_rows.append(slots(seq.block_table, start, start + n, bs) + [-1] * pad)  # −1: not written
            table = seq.block_table
            if table[0] == NULL_BLOCK:  # blocks out of every sliding window were given back: read a live one, masked
                table = [b if b != NULL_BLOCK else table[-1] for b in table]
            tables.append(table + [table[0]] * (M - len(table)))  # read, then masked
            lens.append(start + n)
        B, K, flat = len(seqs), max(num_logits), chain.from_iterable  # host tensors over C arrays (host_tensor)
        input_ids, positions = host_tensor(flat(ids), (B, T)), host_tensor(flat(pos), (B, T))
        slot_mapping, block_tables = host_tensor(flat(slot_rows), (B, T)), host_tensor(flat(tables), (B, M))
        context_lens = host_tensor(lens)  # B
        logit_index = host_tensor((max(n - max(m - j, 1), 0) for n, m in zip(num_new, num_logits) for j in range(K)),
                                  (B, K))  # row i's last num_logits[i] new tokens: n−m .. n−1 (shorter: repeated)
        kernels = self.attention_backend == "triton"  # a tree: bits per token for the kernel, else a mask for SDPA
        mask = None if trees is None or kernels else tree_mask(trees, num_new, context_lens, T, M * bs)  # B, T, M·bs
        bits = None if trees is None or not kernels else torch.tensor(  # N, in the packed order of the real tokens
            [b for parents, n in zip(trees, num_new) for b in (ancestor_bits(parents) if parents else [-1] * n)])
        meta = AttentionMetadata.build(slot_mapping, block_tables, context_lens, bs, self.kv.needs_buckets(T == 1),
                                       mask, bits)
        to = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return ForwardInputs(to(input_ids), to(positions), to(logit_index), meta.to(self.device))

    @torch.inference_mode()
    def execute(self, inputs: ForwardInputs) -> torch.Tensor:
        """The forward itself, on device tensors only: logits [B, K, V] (float32). Nothing in it reads
        a device value back to the host (tests/test_no_host_sync.py), so a CUDA graph can capture it."""
        view = self.kv.bind(inputs.meta)
        logits = self.model(inputs.input_ids, inputs.positions, cache=view, logit_index=inputs.logit_index)
        return logits.float()  # B, K, V

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] (float32) of one full forward of `ids` without a cache (LLM.logits)."""
        return self.model(torch.tensor([ids], device=self.device))[0].float()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new: list[int], num_logits: list[int] | None = None,
            trees: list | None = None):
        """Forward the new tokens of each sequence; return next-token logits [B, V] (float32).

        With `num_logits`, row i returns the logits of its last num_logits[i] new tokens instead, as
        a list of [num_logits[i], V] tensors (speculative verification scores every draft position).
        With `trees`, row i's new tokens form the token tree trees[i] (its parents; None: a chain).

        The rows run as a few forwards (`forward_groups`): decodes, verifications, then prefills
        of similar lengths. In one [B, T] rectangle every row is padded to the longest (a step
        admitting a 60-token prompt beside 7 decodes would compute 8 × 60 token slots instead of
        67). A packed variable-length attention kernel removes the padding inside attention: the
        triton backend packs the real tokens first (kv.triton_backend.TritonCacheView, notebook 04).
        """
        k = num_logits or [1] * len(seqs)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        full = None  # without num_logits: [B, V], each group's rows copied in at once (not B row views + a cat)
        for rows in forward_groups(num_new, k):
            args = [seqs[i] for i in rows], [num_new[i] for i in rows], [k[i] for i in rows]
            group_trees = [trees[i] for i in rows] if trees else None
            if max(args[1]) == 1 and self.graphs is not None and self.graphs.fits(len(rows)):
                logits = self.graphs.run(self.prepare(*args))  # a pure decode group: replay its graph
            elif group_trees and any(t is not None for t in group_trees):
                logits = self._forward(*args, trees=group_trees)
            else:
                logits = self._forward(*args)
            if num_logits is None and rows == list(range(len(seqs))):
                return logits[:, 0]  # one group, every row in order: no copy  (B, V)
            if num_logits is None:
                full = logits.new_empty(len(seqs), logits.shape[-1]) if full is None else full
                full.index_copy_(0, torch.tensor(rows, device=full.device), logits[:, 0])
                continue
            for i, row in zip(rows, logits):
                out[i] = row[: k[i]]
        return out if num_logits is not None else full

    def _forward(self, seqs: list[Sequence], num_new: list[int], num_logits: list[int], trees=None) -> torch.Tensor:
        """logits [B, K, V] of each row's last num_logits new tokens (K = max; shorter rows repeat their last)."""
        if self.lora is not None:  # each row's adapter into a slot, and each row's slot into the LoRA layers
            self.lora.set_batch([s.lora_int_id for s in seqs], self.device)
        try:
            logits = self.execute(self.prepare(seqs, num_new, num_logits, trees))
        finally:
            if self.lora is not None:
                self.lora.clear()
        if self.model.keep_hidden == "all":  # every new token's, kept until read (EAGLE's head reads them)
            for i, (seq, n) in enumerate(zip(seqs, num_new)):
                chunk = (seq.num_computed_tokens, self.model.last_hidden[i, :n].clone())  # n, C
                self.features.setdefault(seq.seq_id, []).append(chunk)
        elif self.model.keep_hidden:  # each row's hidden states where its logits are (Medusa heads read them)
            for i, (seq, m) in enumerate(zip(seqs, num_logits)):
                self.hidden[seq.seq_id] = self.model.last_hidden[i, :m]  # m, C
        return logits


def tree_mask(trees: list, num_new: list[int], context_lens: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """bool [B, T, S]: which of the S gathered keys each new token sees. A chain row: its own context, causally
    (a padding query sees its row's last real token's); a tree row: the cached prefix, then its ancestors
    (tree_sampler.tree_attention_mask) — never a sibling's branch."""
    mask = torch.zeros(len(num_new), T, S, dtype=torch.bool)
    for b, (parents, n, ctx) in enumerate(zip(trees, num_new, context_lens.tolist())):
        prefix = ctx - n
        if parents is None:
            seen = torch.arange(S)[None, :] <= (prefix + torch.arange(T).clamp(max=n - 1))[:, None]  # T, S
            mask[b] = seen
        else:
            mask[b, :n, :prefix + n] = tree_attention_mask(parents, prefix)
            mask[b, n:] = mask[b, n - 1]
    return mask
