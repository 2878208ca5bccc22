"""The online softmax step the attention kernels share, and Gemma 2's soft-capped scores.

FlashAttention's loop (kernels/flash_attention.py) and the paged decode kernel
(kernels/paged_attention.py) fold one tile of keys at a time into a running max m, denominator l
and numerator acc, so the [queries, keys] score matrix never exists: with the tile's scores s,
m' = max(m, rowmax s), l = l·exp(m − m') + rowsum exp(s − m'), acc = acc·exp(m − m') +
exp(s − m')·v. Scores are in log2 units (the scale · log2 e is folded in), so exp is exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_scores(s, cap):
    """Scores in log2 units, s = x·log2 e -> c·tanh(x / c)·log2 e (tanh(y) = ±(1 − e)/(1 + e), e =
    exp(−2|y|) ≤ 1)."""
    y = s * (0.6931471805599453 / cap)  # x / c
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return (cap * 1.4426950408889634) * tl.where(y >= 0, t, -t)


@triton.jit
def online_softmax_step(q, kT, v, valid, m_i, l_i, acc, qk_scale, SOFTCAP: tl.constexpr,
                        UPCAST: tl.constexpr,
                        MASKED: tl.constexpr):
    """Fold one key tile into (m, l, acc). Scores are in log2 units: qk_scale = sm_scale·log2(e).
    MASKED = False: every score of the tile counts (`valid` is ignored), so no mask is applied."""
    if UPCAST:
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kT, input_precision="ieee") * qk_scale  # BLOCK_M, BLOCK_N
    if SOFTCAP > 0:  # a compile-time constant: the kernel without a cap is the kernel it always was
        s = softcap_scores(s, SOFTCAP)
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # BLOCK_M
    # A row with every key masked so far has m_new = -inf; subtract 0 instead so that
    # exp2(-inf - m) is 0, not exp2(-inf + inf) = NaN. (Unmasked, every score is finite: m_new is
    # too.)
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # BLOCK_M
    # BLOCK_M     rescales what was accumulated under the old max
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])  # BLOCK_M, BLOCK_N
    l_i = l_i * alpha + tl.sum(p, 1)  # BLOCK_M
    # BLOCK_M, BLOCK_D
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
