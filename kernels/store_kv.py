"""`store_kv`: write a step's new keys and values into their slots of the paged KV pools.

k, v [N, Hkv, D] go to slots `slot_mapping` [N] (−1 = padding, not written) of the pools
[num_blocks, block_size, Hkv, D] (the layout: nanoserve/kv/cache.py). One program per token;
`store_kv_ref` is the same in plain torch. With a quantized pool (`kv_cache_dtype` int8 / fp8_e4m3 /
fp8_e5m2) the program quantizes its token first, one fp16 scale per kv head into k_scale, v_scale
[num_blocks, block_size, Hkv] (kernels/kv_quant.py, bit for bit as nanoserve/kv/quant.py); int4
packs two codes a byte and writes a scale and a minimum per group of values. Taught in
notebooks/04_attention_kernels.ipynb and 12_kv_cache_quantization.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checks import check_pools, check_slot_mapping, pool_head_dim
from .configs import DTYPES
from .kv_quant import INT4, group_size, qmax, quantize_int4_rows, quantize_rows


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None,
                 kv_cache_dtype="auto") -> None:
    """Plain torch: write k, v [N, Hkv, D] into slots `slot_mapping` [N] of the pools (−1: skip)."""
    from ..kv.quant import kv_quant

    nb, bs = k_cache.shape[:2]
    keep = slot_mapping >= 0  # N
    slots = slot_mapping[keep]  # n real tokens
    quant = kv_quant(kv_cache_dtype)
    for x, pool, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = x[keep]  # n, Hkv, D
        if quant is not None:
            rows, s = quant.quantize(rows)  # n, Hkv, D codes (int4: D/2 bytes); n, Hkv (, D/G)
            scales.view(nb * bs, *scales.shape[2:])[slots] = s
        pool.view(nb * bs, *pool.shape[2:])[slots] = rows


@triton.jit
def _store_int4(x, rows, Scales, slot, n_kv_heads, head_dim, H_PAD: tl.constexpr,
                D_PAD: tl.constexpr, GROUP: tl.constexpr):
    """One token's heads x [H_PAD, D_PAD] (fp32) into an int4 pool: D / 2 bytes from each head's row
    start `rows` [H_PAD, 1]; 2 · D / GROUP scales and minima at (slot · Hkv + head) · 2 · D / GROUP
    in Scales."""
    codes, scales = quantize_int4_rows(x, GROUP)  # H_PAD, D_PAD/2; H_PAD, 2·D_PAD/GROUP
    offs_h = tl.arange(0, H_PAD)[:, None]  # H_PAD, 1
    offs_b = tl.arange(0, D_PAD // 2)[None, :]  # 1, D_PAD/2
    tl.store(rows + offs_b, codes, mask=(offs_h < n_kv_heads) & (offs_b < head_dim // 2))
    n_scales = 2 * (head_dim // GROUP)
    offs_s = tl.arange(0, 2 * (D_PAD // GROUP))[None, :]  # 1, 2·D_PAD/GROUP
    tl.store(Scales + (slot * n_kv_heads + offs_h) * n_scales + offs_s, scales,
             mask=(offs_h < n_kv_heads) & (offs_s < n_scales))


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, K_scale, V_scale, slot_mapping,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    n_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, KV_QUANT: tl.constexpr,
    QMAX: tl.constexpr, GROUP: tl.constexpr,
):
    i = tl.program_id(0)  # one program per new token
    slot = tl.load(slot_mapping + i).to(tl.int64)
    # Padding exits here rather than joining the mask as `& (slot >= 0)`: Triton's interpreter
    # broadcasts a scalar comparison with its operands' integer dtype, so that mask would reach
    # tl.load as int32, not bool, which Triton ≥ 3.9 refuses ("mask has unsupported dtype").
    if slot < 0:
        return
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < n_kv_heads) & (offs_d[None, :] < head_dim)  # H_PAD, D_PAD
    # (padding reads 0: it must not count in a quantized head's max|x|)
    k = tl.load(
        K + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0
    )
    v = tl.load(
        V + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0
    )
    kc = (
        K_cache + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch
        + offs_d[None, :]
    )
    vc = (
        V_cache + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch
        + offs_d[None, :]
    )
    if KV_QUANT == 0:
        tl.store(kc, k, mask=mask)  # bit copy: no arithmetic, so bf16 is fine in the interpreter
        tl.store(vc, v, mask=mask)
    elif KV_QUANT == INT4:  # two codes a byte, a scale and a minimum per GROUP values
        k_rows = K_cache + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch
        v_rows = V_cache + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch
        _store_int4(k.to(tl.float32), k_rows, K_scale, slot, n_kv_heads, head_dim, H_PAD, D_PAD,
                    GROUP)
        _store_int4(v.to(tl.float32), v_rows, V_scale, slot, n_kv_heads, head_dim, H_PAD, D_PAD,
                    GROUP)
    else:
        # 8 bits per value and one scale per head, at slot · Hkv + head in the [.., block_size, Hkv]
        # scales
        k_codes, k_s = quantize_rows(k.to(tl.float32), KV_QUANT, QMAX)  # H_PAD, D_PAD; H_PAD
        v_codes, v_s = quantize_rows(v.to(tl.float32), KV_QUANT, QMAX)
        tl.store(kc, k_codes, mask=mask)
        tl.store(vc, v_codes, mask=mask)
        tl.store(K_scale + slot * n_kv_heads + offs_h, k_s, mask=offs_h < n_kv_heads)
        tl.store(V_scale + slot * n_kv_heads + offs_h, v_s, mask=offs_h < n_kv_heads)


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None,
             kv_cache_dtype="auto") -> None:
    """Write k, v [N, Hkv, D] into the pools [num_blocks, block_size, Hkv, D] at `slot_mapping` [N].

    kv_cache_dtype "int8" / "fp8_e4m3" / "fp8_e5m2": quantize them first, codes into the pools
    (int8, or FP8 bits in uint8) and one fp16 scale per token and kv head into k_scale, v_scale
    [num_blocks, block_size, Hkv]. "int4": pools [num_blocks, block_size, Hkv, D / 2] of packed
    codes, scales [num_blocks, block_size, Hkv, 2 · D / group] (each group's scale and minimum:
    nanoserve/kv/quant.py).
    """
    quant = check_pools(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype)
    nb, bs, Hkv = k_cache.shape[:3]
    D = pool_head_dim(k_cache, kv_cache_dtype)  # (int4 pools: D / 2 bytes a row)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (Hkv, D):
        raise ValueError(f"k, v must be [N, {Hkv}, {D}] like the pools, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.dtype != v.dtype or (k.dtype != k_cache.dtype and not quant) or k.dtype not in DTYPES:
        raise ValueError(f"k, v dtypes {k.dtype}, {v.dtype} differ from the pools' {k_cache.dtype}")
    check_slot_mapping(slot_mapping, k.shape[0], nb * bs)
    if k.shape[0] == 0:
        return
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    if not quant:  # dummies: the KV_QUANT = 0 kernel never reads them
        k_scale = v_scale = slot_mapping
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        Hkv, D,
        BLOCK_SIZE=bs, H_PAD=triton.next_power_of_2(Hkv), D_PAD=triton.next_power_of_2(D),
        KV_QUANT=quant,
        QMAX=qmax(kv_cache_dtype) if quant else 0.0, GROUP=group_size(kv_cache_dtype, D),
    )
