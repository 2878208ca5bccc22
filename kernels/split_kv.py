"""Split-KV (Flash-Decoding, Dao et al. 2023): how many splits fill a GPU, and the exact merge of
their partials.

Decode (kernels/paged_attention.py) has only B·Hkv programs: with a small
batch most of a GPU's SMs would sit idle while a few programs walk long contexts. So the
context is cut into `num_splits` contiguous ranges, each of ⌈⌈len / num_splits⌉ / BLOCK_N⌉
tiles; grid (B, Hkv, num_splits). Split s returns its *partial* result, normalised over its own
keys, and the log-sum-exp of its scores:

    out_s = Σ_{j∈s} exp(x_j − lse_s) v_j,    lse_s = log Σ_{j∈s} exp(x_j)       (x = q·k·scale)

A second small kernel merges them exactly: with lse = logsumexp_s(lse_s),
out = Σ_s exp(lse_s − lse) · out_s. A split whose range is empty (short sequences, or more
splits than tiles) is *neutral*: l = 0, out_s = 0, lse_s = −inf, weight exp(−inf) = 0. Split 0
is never empty (context_lens ≥ 1), so lse is finite. With num_splits = 1 the kernel's single
partial already is the answer and is written straight to `out`. `choose_num_splits` says how
many splits fill a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import INTERPRETER

# key positions per tile in the interpreter (GPU: configs.DECODE)
BLOCK_N = INTERPRETER["decode"].tiles[0]
# choose_num_splits: a split must have work enough (4 · 32 keys) to pay for the merge
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# choose_num_splits fills the GPU twice: on an H100 at 32k context a second wave paid, more did not
# (benchmarks/gpu_tune.py; the sweep is in RESULTS.md)
WAVES = 2


# ----------------------------------------------------------------------------- the reference
def merge_splits_ref(partial_out, partial_lse, out_dtype=torch.float32) -> torch.Tensor:
    """Plain torch: out = Σ_s exp(lse_s − lse) · out_s over partials [B, H, S, D], lse [B, H, S]."""
    weights = partial_lse.softmax(dim=-1)  # B, H, S   (= exp(lse_s − logsumexp_s lse_s))
    return (weights[..., None] * partial_out).sum(dim=2).to(out_dtype)  # B, H, D


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _merge_splits_kernel(
    Part, Lse, Out,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits, head_dim,
    S_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)  # one program per (sequence, query head)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    # S_PAD
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # S_PAD   the max is finite (split 0 is never empty)
    w = w / tl.sum(w, axis=0)  # = exp(lse_s − logsumexp lse); empty splits get exactly 0
    mask = s_mask[:, None] & (offs_d[None, :] < head_dim)
    part = tl.load(
        Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask, other=0.0,
    )  # S_PAD, D_PAD
    out = tl.sum(w[:, None] * part, axis=0)  # D_PAD
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < head_dim)


# ----------------------------------------------------------------------------- the wrappers
def merge_splits(partial_out, partial_lse, out_dtype=torch.float32) -> torch.Tensor:
    """The second phase: merge partials [B, H, S, D] with their lse [B, H, S] into out [B, H, D]."""
    B, H, S, D = partial_out.shape
    if partial_lse.shape != (B, H, S):
        raise ValueError(f"partial_lse must be [{B}, {H}, {S}], got {tuple(partial_lse.shape)}")
    partial_out, partial_lse = partial_out.contiguous(), partial_lse.contiguous()
    out = torch.empty(B, H, D, dtype=out_dtype, device=partial_out.device)  # B, H, D
    _merge_splits_kernel[(B, H)](
        partial_out, partial_lse, out,
        *partial_out.stride()[:3], *partial_lse.stride()[:2], out.stride(0), out.stride(1),
        S, D,
        S_PAD=max(2, triton.next_power_of_2(S)), D_PAD=triton.next_power_of_2(D),
    )
    return out


def choose_num_splits(batch: int, num_heads: int, max_context: int | None,
                      num_sms: int | None = None) -> int:
    """How many KV splits fill the GPU: S = ⌈WAVES · num_sms / (batch · num_heads)⌉, capped.

    batch · num_heads is the number of programs without splitting; pass the number of *kv* heads,
    since one program serves a whole GQA group. One wave of num_sms programs gives every SM one
    program, but a program reads its tiles one after another: a second wave puts more loads in
    flight per SM, and measured on an H100 it paid at long context while further waves bought
    nothing (benchmarks/RESULTS.md). Caps: each
    split keeps ≥ MIN_TILES_PER_SPLIT tiles of BLOCK_N keys (a split shorter than that costs more in
    launch and merge than it saves; None = the longest context is unknown: no such cap), and at most
    MAX_SPLITS. num_sms = None reads it from the current CUDA device; on CPU the answer is 1. Reads
    no
    tensor: no host sync.
    """
    if num_sms is None:
        if not torch.cuda.is_available():
            return 1
        num_sms = torch.cuda.get_device_properties(
            torch.cuda.current_device()
        ).multi_processor_count
    programs = max(1, batch * num_heads)
    fill = -(-WAVES * num_sms // programs)  # ⌈WAVES · num_sms / programs⌉
    by_length = (
        MAX_SPLITS if max_context is None
        else max(1, -(-max_context // BLOCK_N) // MIN_TILES_PER_SPLIT)
    )
    return max(1, min(fill, by_length, MAX_SPLITS))
