"""Exercise 7: a FlashAttention kernel in Triton.

Your version of `flash_attention` in nanoserve/kernels/flash_attention.py, with the same signature:
write a Triton kernel in this file and launch it from `flash_attention`. Taught in
notebooks/04_attention_kernels.ipynb: section 2 (the online softmax, in torch), section 3 ("The
kernel in Triton": a 40-line kernel for one sequence per head) and section 4 (packed sequences, GQA,
the paged prefix). Check your work with

    make exercises EX=ex07        # or: .venv/bin/pytest tests/exercises -m ex07 --impl exercises

Sub-tasks, in the order the tests check them (each step extends the same kernel):
  7.1  one sequence (cu_seqlens = [0, L]), H == Hkv, causal or not, L not a multiple of the tile;
       fp16 in, fp16 out (accumulate in fp32).
  7.2  grouped-query attention: query head h reads kv head h // (H // Hkv); ratios 1, 2 and 4.
  7.3  packed variable lengths: B sequences back to back, sequence b is rows cu[b]:cu[b+1]; fewer
       queries than keys (bottom-right causal: query i sits at position Lk − Lq + i); q, k, v as strided
       views of one buffer, and a head dim (24) that is not a power of two.
  7.4  a paged prefix: P = context_lens[b] tokens already in k_cache/v_cache, read through
       block_tables before the new keys (which sit at positions P..P + Lk − 1). Unused slots of the pool
       hold NaN in the tests: a load that is not masked to t < P poisons the output.
The tests never give a query that sees no key (Lq ≤ P + Lk in every sequence, as in the engine).
Input checks are not part of the exercise: nanoserve.kernels.checks.check_flash_attention does them
if you want.

Triton on a machine without CUDA: kernels run in Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported. The tests do that for you (tests/conftest.py);
in your own scripts set it in the environment, or `import nanoserve` first. The interpreter cannot
compute in bf16 (convert each tile to fp32 straight after its load); tl.dot needs every dimension
≥ 16 on a GPU (tiles of 16 here; BLOCK_D = head dim rounded up to a power of two, at least 16,
masked); each program step costs milliseconds in the interpreter, so keep tiles at 16 × 16 on CPU.

Shapes: total_q / total_k packed tokens, H query heads, Hkv kv heads, D head dim, B sequences.
"""

from __future__ import annotations

import math  # noqa: F401  (you will want them)

import torch
import triton  # noqa: F401
import triton.language as tl  # noqa: F401


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    causal: bool = True, sm_scale: float | None = None,
                    block_tables: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
                    *, block_m: int | None = None, block_n: int | None = None,
                    max_seqlen_q: int | None = None, window: int | None = None,
                    softcap: float | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, kv_cache_dtype: str = "auto",
                    tree_bits: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over packed sequences.  q [total_q, H, D]; k, v [total_k, Hkv, D] -> [total_q, H, D].

    cu_seqlens_q/k [B+1]: cumulative lengths. causal: bottom-right aligned (query i of Lq sits at
    position P + Lk − Lq + i and sees keys 0 .. that position). sm_scale defaults to 1/√D. Optional
    paged prefix: block_tables [B, max_blocks], k_cache/v_cache [num_blocks, block_size, Hkv, D],
    context_lens [B]; token t of sequence b's prefix is k_cache[block_tables[b, t // block_size],
    t % block_size]. block_m/block_n override the tile sizes (16 is right for the interpreter).
    max_seqlen_q: the longest query sequence if the caller knows it (None: read it from
    cu_seqlens_q). window, softcap: a sliding window and a soft-cap of the scores (Mistral, Gemma;
    not part of this exercise, whose tests pass None: the reference shows both). k_scale, v_scale,
    kv_cache_dtype: an 8-bit paged prefix (notebook 12; not part of this exercise either: its tests
    keep the default "auto"). tree_bits: a token tree's mask, one bit per visible new key (notebook
    15; not part of it: its tests pass None). sinks [H]: gpt-oss's learned sink logit per head,
    where the online softmax starts (not part of it: its tests pass None). Output in q's dtype.
    """
    raise NotImplementedError(
        "Exercise 7.1: a program owns a tile of queries and walks the keys tile by tile, keeping a "
        "running maximum, denominator and weighted sum, rescaled when the maximum grows; 7.2: "
        "several query heads share a key/value head; 7.3: packed sequences of different lengths, "
        "the queries the last positions; 7.4: a cached prefix read in place through the block "
        "table before the new keys. The kernel and its launch (roughly 90 lines; see "
        "notebooks/04_attention_kernels, sections 3 'The kernel in Triton' and 4 'From this kernel "
        "to nanoserve.kernels.flash_attention'; more: make hint EX=ex07 N=2)")
