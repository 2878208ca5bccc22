"""Attention metadata: everything the attention backends need to know about one forward, built on
the host and moved to the device once (vLLM's names for the same idea).

Which slot each new token goes to, which blocks each row reads, how long each row's context
is — the model runner knows all of it before the forward starts (it built those tensors from
the sequences). Deriving the rest on the device inside the forward (which rows are real, which
blocks are fresh, the longest context) would read device values back to the host: a
synchronisation per layer, and something a CUDA graph cannot capture. So every derived value is
computed here, on CPU tensors, and the backends only ever consume device tensors and host ints.

Two layers, as in vLLM: `CommonAttentionMetadata` holds what every backend reads, and each backend
builds its own metadata from it (`CacheView.build_metadata`; the torch backend's
`TorchAttentionMetadata` adds length buckets and a tree mask, the Triton backend's adds the
kernels' prefix lengths and tree bits). The common part:

    slot_mapping  [B, T]  where each new token's K/V goes (−1: padding, not written)
    block_tables  [B, M]  each row's blocks in logical order
    context_lens  [B]     tokens of each row in the cache once this step's are written
    cu_seqlens    [B+1]   int32, real new tokens per row, packed back to back (vLLM's
                          query_start_loc)
    src, dst      [N]     the N real tokens: their index in the B·T rows, and their slot
    max_context, max_query_len, decode   host values: the longest context, the most new tokens
                          in a row, and whether every row has one
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from itertools import accumulate

import torch


@dataclass
class CommonAttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    max_context: int
    max_query_len: int
    decode: bool

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor) -> CommonAttentionMetadata:
        """From the three CPU tensors of a step (the model runner's), the values every backend
        uses. Derived in Python from the host lists: for a decode step's few rows that is cheaper
        than a dozen small tensor ops (benchmarks/RESULTS.md)."""
        B, T = slot_mapping.shape
        rows = slot_mapping.tolist()  # B × T (host values)
        lens = context_lens.tolist()  # B
        src = [i * T + j for i, row in enumerate(rows) for j, slot in enumerate(row) if slot >= 0]
        dst = [slot for row in rows for slot in row if slot >= 0]  # N
        num_new = [sum(slot >= 0 for slot in row) for row in rows]  # B
        cu_seqlens = host_tensor(accumulate(num_new, initial=0), dtype=torch.int32)
        return cls(slot_mapping, block_tables, context_lens, cu_seqlens,
                   src=host_tensor(src), dst=host_tensor(dst), max_context=max(lens, default=1),
                   max_query_len=max(num_new, default=1), decode=T == 1 and len(dst) == B)

    def as_kwargs(self) -> dict:
        """Its fields by name (the same tensors, not copies): what a backend's metadata is built
        from (`CacheView.build_metadata`)."""
        return {f.name: getattr(self, f.name) for f in fields(CommonAttentionMetadata)}

    def query_lens(self) -> list[int]:
        """Each row's real new tokens (host values; the metadata is still on the CPU)."""
        starts = self.cu_seqlens.tolist()
        return [end - start for start, end in zip(starts, starts[1:])]

    def to(self, device: torch.device | str):
        """The same metadata (of the same class) with its tensors on `device` (host→device copies
        only; itself on the CPU)."""
        if torch.device(device).type == "cpu":
            return self
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = value.to(device, non_blocking=True)
        return replace(self, **moved)


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
