"""Exercise 24: multi-head latent attention's absorbed decode (DeepSeek-V2/V3), in plain torch.

Your versions of nanoserve/kernels/mla_decode_ref.py's `absorb_query`, `mla_decode_ref` and
`expand_output`, with the same names and signatures. Taught in
notebooks/21_kv_cache_by_architecture.ipynb, section 5 ("Decoupled RoPE and the absorbed
decode"). Check your work with

    make exercises EX=ex24        # or: .venv/bin/pytest tests/exercises -m ex24 --impl exercises

MLA caches per token one latent c (r values) and one RoPE key k_pe (d_rope values) that all H
heads share. Expanded, head h's key is [W_UK[h] · c ; k_pe] and its value W_UV[h] · c, with
W_UK [H, d_nope, r] and W_UV [H, d_v, r]; its query is [q_nope ; q_pe]. Absorbed, W_UK moves onto
the query once and W_UV onto the output once, and attention runs on the latents themselves:

    q_lat[b, h] = W_UK[h]ᵀ · q_nope[b, h]                       # [B, H, r]
    s_j         = sm_scale · (q_lat · c_j + q_pe · k_pe_j)      # key j of the sequence
    o_lat[b, h] = Σ_j softmax(s)_j · c_j                        # [B, H, r]
    out[b, h]   = W_UV[h] · o_lat[b, h]                         # [B, H, d_v]

The latent pool is kv_cache [num_blocks, block_size, 1, r + d_rope]: token t of sequence b sits in
block block_tables[b, t // block_size] at offset t % block_size, its first r values c, the last
d_rope k_pe. Sequence b sees keys 0 .. context_lens[b] − 1. The tests compare your three functions
with standard attention over keys and values expanded per head.
"""

from __future__ import annotations

import torch


# ----------------------------------------------------------------------------- exercise 24
def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, d_nope], w_uk [H, d_nope, r] -> q_lat [B, H, r]."""
    raise NotImplementedError(
        "Exercise 24.1: a score is a dot product, so the matrix that would expand every cached "
        "latent into a key can move onto the query instead, once per head, transposed (roughly 1 "
        "line; see notebooks/21_kv_cache_by_architecture, section 5, 'Decoupled RoPE and the "
        "absorbed decode'; more: make hint EX=ex24 N=2)")


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """Decode attention over the paged latent pool -> o_lat [B, H, r] in q_lat's dtype."""
    raise NotImplementedError(
        "Exercise 24.2: gather each sequence's tokens through its block table, split each into "
        "its latent and its RoPE key, add the two score parts, scale, softmax over the keys, and "
        "sum the latents themselves with those weights: every head reads the same latents "
        "(roughly 10 lines; see notebooks/21_kv_cache_by_architecture, section 5, 'Decoupled "
        "RoPE and the absorbed decode'; more: make hint EX=ex24 N=2)")


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, r], w_uv [H, d_v, r] -> each head's output [B, H, d_v]."""
    raise NotImplementedError(
        "Exercise 24.3: the weighted sum of latents is still in the latent space; each head's "
        "value matrix takes it to that head's output, once per step instead of once per cached "
        "token (roughly 1 line; see notebooks/21_kv_cache_by_architecture, section 5, 'Decoupled "
        "RoPE and the absorbed decode'; more: make hint EX=ex24 N=2)")
