"""`flash_attention` (flash_attention.py) in plain torch: one sequence at a time, the whole score
matrix, fp32.

The reference the kernel is tested against (tests/test_kernels_flash.py, exercise 7): the same
arguments, the same masks — bottom-right causal, a sliding window, a soft-cap, a paged prefix read
through the block table, and a token tree's `tree_bits` — and gpt-oss's attention sinks, written as
directly as torch allows.
"""

from __future__ import annotations

import math

import torch

from .checks import check_flash_attention


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        causal: bool = True, sm_scale: float | None = None,
                        block_tables: torch.Tensor | None = None,
                        k_cache: torch.Tensor | None = None,
                        v_cache: torch.Tensor | None = None,
                        context_lens: torch.Tensor | None = None,
                        window: int | None = None, softcap: float | None = None,
                        tree_bits: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`flash_attention` in plain torch: one sequence at a time, the full score matrix, fp32
    math. With `sinks` [H], each head's sink logit is one more softmax column, dropped after."""
    has_prefix = check_flash_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, k_cache, v_cache, context_lens
    )
    H, D = q.shape[1:]
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.zeros_like(q)  # total_q, H, D
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].float()  # Lq, H, D
        kb = k[cu_k[b]:cu_k[b + 1]].float()  # Lk, Hkv, D
        vb = v[cu_k[b]:cu_k[b + 1]].float()  # Lk, Hkv, D
        # gather the P cached tokens through the block table, then put the new ones after
        if has_prefix:
            bs = k_cache.shape[1]
            t = torch.arange(int(context_lens[b]), device=q.device)  # P
            slots = block_tables[b, t // bs].long() * bs + t % bs  # P
            kb = torch.cat([k_cache.flatten(0, 1)[slots].float(), kb])  # P + Lk, Hkv, D
            vb = torch.cat([v_cache.flatten(0, 1)[slots].float(), vb])  # P + Lk, Hkv, D
        Lq, S, Lk = qb.shape[0], kb.shape[0], cu_k[b + 1] - cu_k[b]
        kb = kb.repeat_interleave(group, dim=1)  # S, H, D
        vb = vb.repeat_interleave(group, dim=1)  # S, H, D
        scores = torch.einsum("thd,shd->hts", qb, kb) * scale  # H, Lq, S
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:  # bottom-right: query i sits at position S - Lq + i
            q_pos = torch.arange(S - Lq, S, device=q.device)  # Lq
            k_pos = torch.arange(S, device=q.device)  # S
            hidden = k_pos[None, :] > q_pos[:, None]  # Lq, S
            if window:
                hidden |= k_pos[None, :] <= q_pos[:, None] - window
            # new key j (at S − Lk + j) hidden unless bit j of the query's entry is set
            if tree_bits is not None:
                j = torch.arange(Lk, device=q.device).clamp(max=63)  # Lk
                bits = tree_bits[cu_q[b]:cu_q[b + 1]]  # Lq
                hidden[:, S - Lk:] |= ((bits[:, None] >> j[None, :]) & 1) == 0
            scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # H, Lq, S + 1: the sink's column
            sink = sinks.float()[:, None, None].expand(H, Lq, 1)
            scores = torch.cat([scores, sink], dim=-1)
        # H, Lq, S   (a row with no visible key -> 0; the sink's column dropped)
        probs = scores.softmax(dim=-1).nan_to_num(0.0)[..., :S]
        out[cu_q[b]:cu_q[b + 1]] = torch.einsum("hts,shd->thd", probs, vb).to(q.dtype)  # Lq, H, D
    return out
