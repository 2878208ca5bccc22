"""Multi-head latent attention's absorbed decode in plain torch: the reference of
kernels/mla_decode.py, and the two products around it.

**MLA** (DeepSeek-V2, 2024; HF's `DeepseekV3Attention`). Instead of keys and values per head, a
layer caches per token one compressed latent c (`kv_lora_rank` = r values, after its RMSNorm)
and one rotated RoPE key k_pe (`qk_rope_head_dim` = d_rope values) that every head shares. Head h
*expands* them: its key is [W_UK[h] · c ; k_pe] and its value W_UV[h] · c, where W_UK [H, d_nope,
r] and W_UV [H, d_v, r] are the two halves of HF's `kv_b_proj` (rows per head: d_nope key rows,
then d_v value rows). Its query is [q_nope ; q_pe] (d_nope + d_rope values, q_pe rotated).

**Absorbed.** A score needs only dot products, so W_UK moves onto the query once per step instead
of onto every cached key: q_nope · (W_UK[h] c) = (W_UK[h]ᵀ q_nope) · c = q_lat · c. Likewise
W_UV leaves the sum over keys: Σ_j p_j (W_UV[h] c_j) = W_UV[h] (Σ_j p_j c_j). So decode attention
runs in the latent space, every head reading the same latent "KV head" (MQA there):

    q_lat = absorb_query(q_nope, W_UK)                     # B, H, r
    s_j   = scale · (q_lat · c_j + q_pe · k_pe_j)          # per head, key j
    o_lat = Σ_j softmax(s)_j · c_j                         # B, H, r
    out   = expand_output(o_lat, W_UV)                     # B, H, d_v

The scale is the expanded head's, 1/√(d_nope + d_rope) (times DeepSeek's YaRN mscale² where its
config asks), never 1/√r: the caller passes it. RoPE must stay off the latent: a rotation
between q_nope and W_UK c would depend on the key's position, and no single W_UK[h]ᵀ q could be
folded then. That is why the RoPE part is a separate, shared key (the *decoupled* RoPE key).

**The pool.** Per layer `kv_cache` [num_blocks, block_size, 1, r + d_rope]: token t of sequence
b in block `block_tables[b, t // block_size]` at offset `t % block_size`, holding c (the first r
values) then k_pe (the last d_rope). Taught in notebooks/21_kv_cache_by_architecture.ipynb;
exercise 24 writes these three functions.
"""

from __future__ import annotations

import torch


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, d_nope], w_uk [H, d_nope, r] -> q_lat [B, H, r] = W_UK[h]ᵀ · q_nope[b, h]."""
    return torch.einsum("bhd,hdr->bhr", q_nope, w_uk)


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """Decode attention over a paged latent cache, one sequence at a time, fp32 math.

    q_lat [B, H, r], q_pe [B, H, d_rope]; kv_cache [num_blocks, block_size, 1, r + d_rope];
    block_tables [B, max_blocks], context_lens [B]. Sequence b sees keys 0 .. context_lens[b] − 1.
    Returns o_lat [B, H, r] in q_lat's dtype: the softmax-weighted sum of the latents.
    """
    B, H, r = q_lat.shape
    bs = kv_cache.shape[1]
    flat = kv_cache.flatten(0, 2)  # slots, r + d_rope
    out = torch.empty_like(q_lat)  # B, H, r
    for b in range(B):
        pos = torch.arange(int(context_lens[b]), device=q_lat.device)  # L
        slots = block_tables[b, pos // bs].long() * bs + pos % bs  # L
        c = flat[slots, :r].float()  # L, r
        k_pe = flat[slots, r:].float()  # L, d_rope
        scores = (q_lat[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * sm_scale  # H, L
        out[b] = (scores.softmax(dim=-1) @ c).to(q_lat.dtype)  # H, r
    return out


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, r], w_uv [H, d_v, r] -> each head's attention output [B, H, d_v] = W_UV[h] ·
    o_lat[b, h]."""
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
