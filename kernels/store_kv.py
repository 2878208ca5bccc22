"""`store_kv`: write a step's new keys and values into their slots of the paged KV pools.

k, v [N, Hkv, D] go to slots `slot_mapping` [N] (−1 = padding, not written) of the pools
[num_blocks, block_size, Hkv, D] (the layout: nanoserve/kv/cache.py). One program per token;
`store_kv_ref` is the same in plain torch. Taught in notebooks/04_attention_kernels.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checks import INT_DTYPES, can_read_values, check_pools


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Plain torch: write k, v [N, Hkv, D] into slots `slot_mapping` [N] of the pools (−1: skip)."""
    nb, bs, Hkv, D = k_cache.shape
    keep = slot_mapping >= 0  # N
    slots = slot_mapping[keep]  # n real tokens
    k_cache.view(nb * bs, Hkv, D)[slots] = k[keep]  # slots, Hkv, D
    v_cache.view(nb * bs, Hkv, D)[slots] = v[keep]


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, slot_mapping,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    n_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
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
    k = tl.load(K + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = K_cache + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = V_cache + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k, mask=mask)  # bit copy: no arithmetic, so bf16 is fine in the interpreter
    tl.store(vc, v, mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [N, Hkv, D] into the pools [num_blocks, block_size, Hkv, D] at `slot_mapping` [N]."""
    check_pools(k_cache, v_cache)
    nb, bs, Hkv, D = k_cache.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (Hkv, D):
        raise ValueError(f"k, v must be [N, {Hkv}, {D}] like the pools, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"k, v dtypes {k.dtype}, {v.dtype} differ from the pools' {k_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in INT_DTYPES:
        raise ValueError(f"slot_mapping must be int32/int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if can_read_values(slot_mapping) and slot_mapping.numel() and (
            slot_mapping.min() < -1 or slot_mapping.max() >= nb * bs):
        raise ValueError(f"slot_mapping holds slots outside −1 .. {nb * bs - 1}")
    if k.shape[0] == 0:
        return
    k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        Hkv, D,
        BLOCK_SIZE=bs, H_PAD=triton.next_power_of_2(Hkv), D_PAD=triton.next_power_of_2(D),
    )
