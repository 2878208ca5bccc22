"""`AttentionMetadata`: everything the attention backends need to know about one forward, built
on the host and moved to the device once (vLLM's name for the same idea).

Which slot each new token goes to, which blocks each row reads, how long each row's context
is — the model runner knows all of it before the forward starts (it built those tensors from
the sequences). Deriving the rest on the device inside the forward (which rows are real, which
blocks are fresh, the longest context) would read device values back to the host: a
synchronisation per layer, and something a CUDA graph cannot capture. So every derived value is
computed here, on CPU tensors, and the backends only ever consume device tensors and host ints.

    slot_mapping  [B, T]  where each new token's K/V goes (−1: padding, not written)
    block_tables  [B, M]  each row's blocks in logical order
    context_lens  [B]     tokens of each row in the cache once this step's are written
    src, dst      [N]     the N real tokens: their index in the B·T rows, and their slot
    fresh_blocks  [F]     blocks receiving their first token (offset 0) this step
    cu_seqlens    [B+1]   int32, real new tokens per row, packed back to back
    prefix_lens   [B]     int32, tokens cached before this step
    max_context, max_query_len, decode   host values: the longest context, the most new tokens
                          in a row, and whether every row has one
    no_prefix             host value: no row has tokens cached before this step (prefills
                          from scratch)
    buckets               [(rows, num_blocks)]: rows grouped by the blocks their context needs,
                          rounded up to a ladder of sizes (`bucket_size`; the torch backend
                          gathers each group to its own length, not every row to the longest)
    attn_mask     [B, T, M·block_size] or None: which gathered keys each new token sees, when a row
                          holds a token tree (speculative verification; spec/tree_sampler.py) rather
                          than a run of consecutive positions; None: causal by position
                          (torch backend)
    tree_bits     [N] int64 or None: the same for the Triton kernel, per real token, bit j = it sees
                          its row's new token j (−1 in a chain row); None: no tree this step
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from itertools import accumulate

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    fresh_blocks: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_lens: torch.Tensor
    max_context: int
    decode: bool
    max_query_len: int = 1
    no_prefix: bool = False
    buckets: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    attn_mask: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor,
              block_size: int, buckets: bool = True, attn_mask: torch.Tensor | None = None,
              tree_bits: torch.Tensor | None = None) -> AttentionMetadata:
        """From the three CPU tensors of a step (the model runner's), every value the backends use
        (the length buckets only with `buckets`: the torch backend reads them, the kernels do not;
        none with a tree's `attn_mask`, which spans the longest row's keys). Derived in Python from
        the host lists: for a decode step's few rows that is cheaper than a dozen small tensor ops
        (benchmarks/RESULTS.md)."""
        B, T = slot_mapping.shape
        rows, lens = slot_mapping.tolist(), context_lens.tolist()  # B × T, B (host values)
        # N
        src = [i * T + j for i, row in enumerate(rows) for j, slot in enumerate(row) if slot >= 0]
        dst = [slot for row in rows for slot in row if slot >= 0]  # N
        num_new = [sum(slot >= 0 for slot in row) for row in rows]  # B
        wants_buckets = buckets and attn_mask is None
        return cls(slot_mapping, block_tables, context_lens, host_tensor(src), host_tensor(dst),
                   fresh_blocks=host_tensor([d // block_size for d in dst if d % block_size == 0]),
                   cu_seqlens=host_tensor(accumulate(num_new, initial=0), dtype=torch.int32),
                   prefix_lens=host_tensor((n_ctx - n for n_ctx, n in zip(lens, num_new)),
                                           dtype=torch.int32),
                   max_context=max(lens, default=1), decode=T == 1 and len(dst) == B,
                   max_query_len=max(num_new, default=1), no_prefix=lens == num_new,
                   buckets=length_buckets(lens, block_size) if wants_buckets else [],
                   attn_mask=attn_mask, tree_bits=tree_bits)

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same metadata with its tensors on `device` (host→device copies only; itself on the
        CPU)."""
        if torch.device(device).type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        moved["buckets"] = [(rows.to(device, non_blocking=True), n) for rows, n in self.buckets]
        return AttentionMetadata(**moved)


def host_tensor(values: Iterable[int], shape: tuple[int, ...] | None = None,
                dtype=torch.long) -> torch.Tensor:
    """A CPU tensor (int64 or int32) of the ints in `values`, flat or in `shape`: a view over a C
    array (array.array), faster than torch.tensor on a Python list, which converts element by
    element (a step's tables hold thousands at a large batch; benchmarks/RESULTS.md)."""
    buf = array("q" if dtype == torch.long else "i", values)
    # (it keeps buf alive)
    flat = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
    return flat if shape is None else flat.view(shape)


BUCKETS_PER_DOUBLING = 16  # bucket sizes between n and 2n (1: powers of two)


def bucket_size(num_blocks: int, per_doubling: int = BUCKETS_PER_DOUBLING) -> int:
    """num_blocks rounded up to the bucket ladder: exact up to per_doubling, then per_doubling
    evenly spaced sizes in each (2^k, 2^(k+1)] (4: 5, 6, 7, 8, 10, 12, 14, 16, 20, ...; 16: every
    count up to 32 blocks, then 34, 36, ...). A row gathered to its bucket wastes < 1/per_doubling
    of it."""
    top = 1 << max(num_blocks - 1, 0).bit_length()  # the power of two ≥ num_blocks
    unit = max(top // (2 * per_doubling), 1)
    return -(-max(num_blocks, 1) // unit) * unit


def length_buckets(context_lens: torch.Tensor | list[int], block_size: int,
                   per_doubling: int = BUCKETS_PER_DOUBLING) -> list[tuple[torch.Tensor, int]]:
    """Rows grouped by the blocks their context needs, rounded up to the bucket ladder
    (`bucket_size`): [(rows, blocks)]. A group gathered to its own length wastes < 1/per_doubling of
    it on padding; all rows gathered to the longest waste up to (longest − shortest) / longest (most
    of it, with a long straggler). More buckets mean more, smaller gathers and SDPA calls, yet on
    the 256-request peer workload 16 per doubling beat 1, 2, 4 and 8 (benchmarks/RESULTS.md)."""
    # B (host values)
    lens = context_lens.tolist() if isinstance(context_lens, torch.Tensor) else context_lens
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lens):
        groups.setdefault(bucket_size(-(-n // block_size), per_doubling), []).append(row)
    return [(host_tensor(rows), n) for n, rows in sorted(groups.items())]
