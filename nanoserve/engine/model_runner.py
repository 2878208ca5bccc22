"""The model runner: one batched forward over several sequences, on the paged KV cache.

The scheduler decides *which* sequences run and *how many* new tokens each computes (a whole
prompt, a prefill chunk, or one decode token); the block allocator has already given them
slots. This file turns that decision into tensors — the only place where Sequences meet the
model:

    input_ids, positions  [B, T]   new tokens per row, right-padded to the longest
    slot_mapping          [B, T]   where each new token's K/V goes (−1: padding, not written)
    block_tables          [B, M]   each row's blocks, padded with its own first block (masked);
                                   a block given back by a sliding window reads as the row's
                                   last (masked too); a row under KV eviction lists its live
                                   blocks only
    context_lens          [B]      tokens in the cache once this step's are written (evicted
                                   ones not counted)

and returns each row's next-token logits (the logits of its last new token). `prepare` builds all
of it on the host and moves it once (kv/metadata.py); `execute` is the forward on device
tensors only, with no read back to the host — what a CUDA graph captures (engine/cuda_graph.py).

It is pure: sequences in, logits out. It reads each sequence's tokens, block table and
num_computed_tokens and writes nothing of theirs; the forward's K/V goes into the KV pool, and
the caller tells the scheduler what was computed (`Scheduler.advance`). Taught in notebooks/02_*.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from enum import IntEnum
from itertools import chain

import torch

from ..config import MAX_SPECULATIVE_TOKENS
from ..extension_points import extension
from ..kv.cache import PagedKVCache
from ..kv.metadata import CommonAttentionMetadata, host_tensor
from .block import slots
from .sequence import NULL_BLOCK, Sequence

# a prefill forward computes at most this × its real tokens (the rest: padding)
PREFILL_SLACK = 1.25
# a verification row returns at most this many logits
MAX_VERIFY_LOGITS = 1 + MAX_SPECULATIVE_TOKENS


class RowKind(IntEnum):
    """What a row of a step computes; rows of one kind share forwards, in this order."""

    DECODE = 0  # one new token
    VERIFY = 1  # a few new tokens, a logit for each (speculative verification)
    PREFILL = 2  # a prompt or a chunk of it, one logit
    PREFILL_ALL_LOGITS = 3  # a prompt chunk that returns every position's logits (prompt logprobs)


def row_kind(num_new: int, num_logits: int) -> RowKind:
    """The kind of a row that computes `num_new` tokens and returns `num_logits` logits."""
    if num_new == 1:
        return RowKind.DECODE
    if num_logits == 1:
        return RowKind.PREFILL
    if num_logits <= MAX_VERIFY_LOGITS:
        return RowKind.VERIFY
    return RowKind.PREFILL_ALL_LOGITS


def forward_groups(num_new: list[int], num_logits: list[int],
                   slack: float = PREFILL_SLACK) -> list[list[int]]:
    """The rows of one step, split into forwards: the decode rows together, the verification rows
    together, then the prefill rows longest first, a new forward whenever padding to the group's
    longest row would exceed `slack` × its real tokens (one forward for every prefill can compute
    far more padding than tokens). Prefill rows that return every position's logits are grouped
    the same way apart from the others, so a [B, K, V] logits tensor is never padded to one long
    row's K."""
    kinds = [row_kind(n, m) for n, m in zip(num_new, num_logits)]
    groups = [[i for i, kind in enumerate(kinds) if kind == want]
              for want in (RowKind.DECODE, RowKind.VERIFY)]
    for want in (RowKind.PREFILL, RowKind.PREFILL_ALL_LOGITS):
        rows = [i for i, kind in enumerate(kinds) if kind == want]
        rows.sort(key=lambda i: -num_new[i])  # longest first
        groups += split_by_padding(rows, num_new, slack)
    return [g for g in groups if g]


def split_by_padding(rows: list[int], num_new: list[int], slack: float) -> list[list[int]]:
    """`rows`, longest first, cut into groups whose padded size (rows × the first row's length)
    stays within `slack` × their real tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in rows:
        width = num_new[current[0]] if current else num_new[i]  # longest first: the first row's
        padded = (len(current) + 1) * width
        if current and padded > slack * (sum(num_new[j] for j in current) + num_new[i]):
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    return groups


@dataclass
class ForwardInputs:
    """One forward's inputs, on the device: token ids and positions [B, T], which positions' logits
    to return [B, K], and the attention metadata (nanoserve/kv/metadata.py)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_index: torch.Tensor
    meta: CommonAttentionMetadata  # the attention backend's own (kv/metadata.py)


class ModelRunner:
    """The model and its paged KV pool; `run` is one batched forward over the scheduled
    sequences."""

    def __init__(self, model, num_blocks: int, block_size: int,
                 attention_backend: str | None = None,
                 kv_cache_dtype: str = "auto", kv_config=None, kv_layers: range | None = None):
        self.model = model
        self.config = model.config
        cpu_runtime = extension("cpu_runtime")  # models/onednn.py, engine/cpu_allocator.py
        self.onednn_off = cpu_runtime.use_onednn_linears(model)  # CPU GEMMs in oneDNN, or why not
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cpu":
            largest = max(t.numel() * t.element_size() for t in model.parameters())
            cpu_runtime.advise_on_allocator(largest)  # glibc's malloc; pages under the weights
        # kv_config, kv_layers: one rank's share of the heads, or of the layers (parallel/)
        self.kv = PagedKVCache(kv_config or self.config, num_blocks, block_size, self.dtype,
                               self.device, attention_backend, kv_cache_dtype=kv_cache_dtype,
                               layers=kv_layers)
        self.attention_backend = self.kv.attention_backend  # "torch", "triton" or "cpu" (kv/)
        if self.attention_backend == "triton":  # its layers as one kernel each where they can
            extension("triton_layers").use_triton_layers(model)
        self.block_size = block_size
        self.graphs = None  # CudaGraphRunner once use_cuda_graphs() ran: decode steps replay graphs
        # context managers each forward runs inside, made from its sequences (the LoRA adapters'
        # slots, set before and cleared after: lora/serving.py)
        self.around_forward: list[Callable[[list[Sequence]], AbstractContextManager]] = []
        # called after each forward with (seqs, num_new, num_logits): what an extension reads of it
        # (Medusa's and EAGLE's proposers keep the model's hidden states: spec/medusa.py,
        # eagle_proposer.py)
        self.after_forward: list[Callable] = []
        # tokens sampled but still on the device (async scheduling's step in flight, a draft
        # model's last draft): `prepare` puts them where their sequences hold a placeholder
        # (engine/late_tokens.py)
        self.late_tokens = None

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                        max_verify_tokens: int = 1) -> str | None:
        """Capture decode CUDA graphs (engine/cuda_graph.py), and verification graphs for rows of
        up to `max_verify_tokens` tokens when that is > 1 (speculative decoding: 1 + γ); returns
        why not when they cannot serve this runner (no CUDA, or the torch attention backend), else
        None."""
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if self.attention_backend != "triton":
            return ("CUDA graphs need the triton attention backend (the torch one zeroes a "
                    "varying set of blocks)")
        if self.around_forward:  # a graph replays the forward alone, not what wraps it
            return ("each forward runs inside an extension's context (around_forward: e.g. "
                    "per-request LoRA adapters, whose slots change per step)")
        if self.model.keep_hidden:
            return "draft heads read each step's hidden states (Medusa, EAGLE) eagerly"
        # e.g. quant/llm_int8.py
        if any(getattr(m, "host_sync", False) for m in self.model.modules()):
            return ("a layer reads device values on the host every call (LLM.int8's outlier "
                    "features)")
        if self.kv.v_in_k is not None:  # MLA's latent cache: only decode steps run a kernel
            max_verify_tokens = 1  # (verification runs eagerly, on the torch path)
        self.graphs = extension("cuda_graphs").CudaGraphRunner(self, max_num_seqs, max_model_len,
                                                               max_verify_tokens)
        self.graphs.capture()
        return None

    def prepare(self, seqs: list[Sequence], num_new: list[int], num_logits: list[int],
                trees: list | None = None) -> ForwardInputs:
        """Build the step's tensors on the host, then move them to the device once; row i computes
        tokens num_computed .. num_computed + num_new[i] − 1 and returns its last num_logits[i]
        logits. trees[i], when given and not None: row i's new tokens are a token tree (their
        parents, node 0 the first new token), at positions by depth and each seeing its ancestors
        only (`tree_mask`)."""
        T, bs = max(num_new), self.block_size
        read_tables = [attended_block_table(s) for s in seqs]  # an evicting row's: live blocks only
        M = max(len(table) for table in read_tables)
        ids, pos, slot_rows, tables, lens = [], [], [], [], []
        # Python lists, one tensor each: O(tokens)
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            start, pad = seq.num_computed_tokens, T - n
            ids.append(seq.token_ids[start:start + n] + [0] * pad)
            tree = None if trees is None else trees[i]
            row_pos = row_positions(start, n, tree)
            pos.append(row_pos + [row_pos[-1]] * pad)  # padding looks at real keys
            # −1: not written
            slot_rows.append(slots(seq.block_table, start, start + n, bs) + [-1] * pad)
            tables.append(padded_block_table(read_tables[i], M))
            # keys in its cache, evicted ones gone (kernels align causality by kv_len − q_len)
            lens.append(start + n - seq.num_evicted_blocks * bs)
        B, K = len(seqs), max(num_logits)
        flat = chain.from_iterable  # rows of Python lists into one host tensor each (host_tensor)
        input_ids = host_tensor(flat(ids), (B, T))
        positions = host_tensor(flat(pos), (B, T))
        slot_mapping = host_tensor(flat(slot_rows), (B, T))
        block_tables = host_tensor(flat(tables), (B, M))
        context_lens = host_tensor(lens)  # B
        logit_index = host_tensor(logit_positions(num_new, num_logits, K), (B, K))
        common = CommonAttentionMetadata.build(slot_mapping, block_tables, context_lens)
        meta = self.kv.build_metadata(common, trees)  # the backend's own (kv/metadata.py)
        input_ids = self._to_device(input_ids)
        if self.late_tokens is not None:  # some rows' newest token is known on the device only
            self.late_tokens.fill(input_ids, seqs, num_new)
        return ForwardInputs(input_ids, self._to_device(positions), self._to_device(logit_index),
                             meta.to(self.device))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, inputs: ForwardInputs) -> torch.Tensor:
        """The forward itself, on device tensors only: logits [B, K, V] (float32). Nothing in it
        reads a device value back to the host (tests/test_no_host_sync.py), so a CUDA graph can
        capture it."""
        view = self.kv.bind(inputs.meta)
        logits = self.model(inputs.input_ids, inputs.positions, cache=view,
                            logit_index=inputs.logit_index)
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
        # without num_logits: [B, V], each group's rows copied in at once (not B row views + a cat)
        full = None
        for rows in forward_groups(num_new, k):
            group_seqs = [seqs[i] for i in rows]
            group_new = [num_new[i] for i in rows]
            group_logits = [k[i] for i in rows]
            group_trees = None  # only when some row of the group is a token tree
            if trees and any(trees[i] is not None for i in rows):
                group_trees = [trees[i] for i in rows]
            if max(group_new) == 1 and self.graphs is not None and self.graphs.fits(len(rows)):
                inputs = self.prepare(group_seqs, group_new, group_logits)
                logits = self.graphs.run(inputs)  # a pure decode group: replay its graph
            elif group_trees is None and self._replays_verification(group_new, group_logits):
                inputs = self.prepare(group_seqs, group_new, group_logits)
                logits = self.graphs.run_verify(inputs)  # every position's logits, by graph
            elif group_trees is not None:
                logits = self._forward(group_seqs, group_new, group_logits, trees=group_trees)
            else:
                logits = self._forward(group_seqs, group_new, group_logits)
            if num_logits is None and rows == list(range(len(seqs))):
                return logits[:, 0]  # one group, every row in order: no copy  (B, V)
            if num_logits is None:
                full = logits.new_empty(len(seqs), logits.shape[-1]) if full is None else full
                full.index_copy_(0, torch.tensor(rows, device=full.device), logits[:, 0])
                continue
            for i, row in zip(rows, logits):
                out[i] = row[: k[i]]
        return out if num_logits is not None else full

    def _replays_verification(self, num_new: list[int], num_logits: list[int]) -> bool:
        """Whether a group of rows that each return every new token's logits (speculative
        verification) has a graph to replay."""
        return (self.graphs is not None and num_new == num_logits
                and self.graphs.fits_verify(len(num_new), max(num_new)))

    def _forward(self, seqs: list[Sequence], num_new: list[int], num_logits: list[int],
                 trees=None) -> torch.Tensor:
        """logits [B, K, V] of each row's last num_logits new tokens (K = max; shorter rows repeat
        their last)."""
        with ExitStack() as stack:
            for context in self.around_forward:
                stack.enter_context(context(seqs))
            logits = self.execute(self.prepare(seqs, num_new, num_logits, trees))
        for hook in self.after_forward:
            hook(seqs, num_new, num_logits)
        return logits


def row_positions(start: int, n: int, tree: list[int] | None) -> list[int]:
    """The positions of a row's n new tokens: start, start + 1, ...; a token tree's nodes sit at
    the root's position plus their depth (spec/tree_sampler.py)."""
    if tree is None:
        return list(range(start, start + n))
    return extension("token_trees").tree_positions(tree, start)


def attended_block_table(seq: Sequence) -> list[int]:
    """The blocks the attention backends read for `seq`: its table, or for a sequence under a KV
    eviction policy its live blocks in order (the evicted entries dropped, so its cache reads as a
    shorter sequence; positions, hence RoPE, stay the original ones: engine/kv_eviction.py)."""
    if seq.kv_eviction is None:
        return seq.block_table
    return [block for block in seq.block_table if block != NULL_BLOCK]


def padded_block_table(table: list[int], width: int) -> list[int]:
    """A row's block table padded to `width` with its first block (read, then masked). Blocks a
    sliding window gave back (NULL_BLOCK) read as the row's last live block, masked too."""
    row = []
    for block in table:
        row.append(table[-1] if block == NULL_BLOCK else block)
    return row + [row[0]] * (width - len(row))


def logit_positions(num_new: list[int], num_logits: list[int], K: int) -> list[int]:
    """For each row, K positions whose logits it returns: its last num_logits[i] new tokens
    n − m .. n − 1, the last repeated when m < K. Flat, row after row."""
    index = []
    for n, m in zip(num_new, num_logits):
        for j in range(K):
            index.append(max(n - max(m - j, 1), 0))
    return index
