"""Checkpoint formats for quantized linears: GPTQ "v1" (AutoGPTQ) and AutoAWQ GEMM, packed into
int32.

A quantizer (nanoserve/quant/rtn.py, gptq.py, awq.py) ends with integers and floats per linear
of in-features K and out-features N, cut along K into G groups. This module only *stores* them:

    codes  [N, K]  ints 0 .. 2^bits − 1      (out × in, the nn.Linear weight layout)
    zeros  [N, G]  integer zero points        (the real zero: W = (code − zero) · scale)
    scales [N, G]  floats
    g_idx  [K]     group of each input row    (k // group_size, or a permutation of that: act-order)

so that W[n, k] = (codes[n, k] − zeros[n, g_idx[k]]) · scales[n, g_idx[k]]. The two formats
below are how checkpoints on the Hub lay these out; both put several codes in one int32 word,
field i of a word at bits [bits·i, bits·i + bits).

**GPTQ v1** (AutoGPTQ; what the GPTQ loaders of exllama, vLLM and transformers read), 32/bits codes
per word:

    qweight int32 [K·bits/32, N]   packed along K: row k of column n → word k // (32/bits), field k
                                   % (32/bits)
    qzeros  int32 [G, N·bits/32]   packed along N the same way, storing zero − 1
    scales  fp16  [G, N]
    g_idx   int32 [K]

The "− 1" is a historical quirk every v1 reader undoes with "+ 1": symmetric 4-bit zeros 8 are
stored as 7, so a qzeros word reads 0x77777777. It also means v1 holds zero points 1 .. 2^bits,
not 0 .. 2^bits − 1: a zero of 0 would be stored as −1, which does not fit in a field (written
unchecked, its sign bits spill into the neighbouring fields). A min-max quantizer gives zero 0 to a
group whose weights are all ≥ 0; `pack_gptq` refuses it rather than write a checkpoint that readers
would misread. GPTQModel's "v2" format drops the offset for this reason (`pack_gptq_v2_zeros`;
gptqmodel reads an asymmetric grid in v1 only from files it wrote itself). Only 2, 4 and 8 bits
divide 32: 3-bit codes straddle word boundaries and are not handled.

**AutoAWQ GEMM**, 4-bit only, 8 codes per word, packed along N:

    qweight int32 [K, N/8]   codes of columns 8j .. 8j+7 of row k, interleaved
    qzeros  int32 [G, N/8]   same interleave, the real zero (no offset)
    scales  fp16  [G, N]

The interleave puts column AWQ_ORDER[i] in field i, AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]: codes
0..7 along N pack to 0x75316420, not 0x76543210. (AutoAWQ's CUDA kernel, after FasterTransformer,
masks a word with 0x000F000F to get fields 0 and 4 into the two fp16 halves of a register, then
fields 1 and 5, and so on: with this order each such pair is two neighbouring columns.) AWQ has no
act-order, so groups are k // group_size.

Everything here is plain torch on whatever device the tensors live on. `dequantize_*` give
W [N, K] in fp32 (exact: a code difference below 2^9 times an fp16 scale fits fp32's 24 bits),
the reference for the fused kernel in kernels/dequant_matmul.py. Taught in
notebooks/07_int4_kernel.ipynb.
"""

from __future__ import annotations

import torch

GPTQ_BITS = (2, 4, 8)  # the widths that divide a 32-bit word
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field i of an AWQ word holds column AWQ_ORDER[i] of its 8
# column j sits in field AWQ_REVERSE_ORDER[j]
AWQ_REVERSE_ORDER = [AWQ_ORDER.index(i) for i in range(8)]
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# ----------------------------------------------------------------------------- bit fields
def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack ints in 0 .. 2^bits − 1 along `dim`: value i of each run of 32/bits goes to field i of
    one int32."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)  # ..., L
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)  # ..., L/per, per
    shifts = torch.arange(0, 32, bits, device=v.device)  # per
    # ..., L/per   fields do not overlap, so the sum is a bitwise or
    words = (v << shifts).sum(dim=-1)
    # the unsigned word, read as two's complement
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `_pack`: int32 words → int32 fields, `dim` grows by 32/bits."""
    w = words.to(torch.int32).movedim(dim, -1)  # ..., L/per
    shifts = torch.arange(0, 32, bits, device=w.device, dtype=torch.int32)  # per
    # ..., L/per, per   (>> sign-extends; the mask drops it)
    fields = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2).movedim(-1, dim)


# ----------------------------------------------------------------------------- GPTQ v1
def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int) -> dict[str, torch.Tensor]:
    """codes [N, K], zeros [N, G], scales [N, G], g_idx [K] → {qweight, qzeros, scales, g_idx} in
    GPTQ v1 layout."""
    _check_bits(bits)
    N, K, G = _check_unpacked(codes, zeros, scales, bits, zero_range=(1, 1 << bits), what="GPTQ v1",
                              note=" (v1 stores zero − 1 in a field: zero 0 cannot be written)")
    per = 32 // bits
    if K % per or N % per:
        raise ValueError(f"{bits}-bit GPTQ puts {per} codes in a word (qweight along K, qzeros "
                         f"along N): K={K} and N={N} must be multiples of {per}")
    _check_g_idx(g_idx, K, G, check_values=True)
    fp16 = _fp16_scales(scales)
    return {
        "qweight": _pack(codes, bits, dim=1).t().contiguous(),  # K·bits/32, N
        # G, N·bits/32   (v1: zero − 1)
        "qzeros": _pack(zeros.to(torch.int64) - 1, bits, dim=0).t().contiguous(),
        "scales": fp16.t().contiguous(),  # G, N
        "g_idx": g_idx.to(torch.int32).contiguous(),  # K
    }


def pack_gptq_v2_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ v2's qzeros (gptqmodel): zeros [N, G] as they are, 0 .. 2^bits − 1, packed along N like
    v1's (no "− 1") → int32 [G, N·bits/32]. Everything else of a v2 layer is v1's."""
    _check_bits(bits)
    lo, hi = _range(zeros)
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(f"GPTQ v2 zero points must lie in 0 .. {(1 << bits) - 1} at {bits} bits, "
                         f"got {lo} .. {hi}")
    return _pack(zeros.to(torch.int64), bits, dim=0).t().contiguous()  # G, N·bits/32


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor,
                bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ v1 tensors → (codes uint8 [N, K], zeros int32 [N, G], scales [N, G], g_idx int32 [K]).

    zeros are the real zero points (the stored value + 1), 1 .. 2^bits.
    """
    check_gptq(qweight, qzeros, scales, g_idx, bits)
    codes = _unpack(qweight, bits, dim=0).t().to(torch.uint8)  # N, K
    zeros = gptq_zeros(qzeros, bits)  # N, G   1 .. 2^bits
    return codes.contiguous(), zeros, scales.t().contiguous(), g_idx.to(torch.int32)


def gptq_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ v1's qzeros int32 [G, N·bits/32] → the real zero points int32 [N, G] (stored + 1)."""
    return (_unpack(qzeros, bits, dim=1).t() + 1).contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor,
                    bits: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] with W[n, k] = (code[n, k] − zero[n, g_idx[k]]) · scale[n, g_idx[k]], computed in
    fp32."""
    codes, zeros, scales, g_idx = unpack_gptq(qweight, qzeros, scales, g_idx, bits)
    g = g_idx.long()  # K
    return ((codes.int() - zeros[:, g]).float() * scales[:, g].float()).to(dtype)  # N, K


def check_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor,
               bits: int, *, check_values: bool = True) -> tuple[int, int, int]:
    """Validate GPTQ v1 tensors against each other and return (K, N, G); ValueError on any mismatch.

    check_values=False skips the one check that reads tensor values (g_idx in range), e.g. while a
    CUDA graph is being captured.
    """
    _check_bits(bits)
    per = 32 // bits
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dim() != 2 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    K, N = qweight.shape[0] * per, qweight.shape[1]
    G = qzeros.shape[0]
    if qzeros.shape[1] * per != N:
        raise ValueError(f"qzeros must be [G, N·bits/32] = [G, {N * bits / 32:g}] for qweight "
                         f"{tuple(qweight.shape)} at {bits} bits, got {tuple(qzeros.shape)}")
    if scales.shape != (G, N) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float [G, N] = [{G}, {N}] tensor, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if len({t.device for t in (qweight, qzeros, scales, g_idx)}) != 1:
        raise ValueError("qweight, qzeros, scales and g_idx must be on one device")
    _check_g_idx(g_idx, K, G, check_values)
    return K, N, G


# ----------------------------------------------------------------------------- AutoAWQ GEMM
def pack_awq(codes: torch.Tensor, zeros: torch.Tensor,
             scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """codes [N, K], zeros [N, G], scales [N, G] (4-bit, groups k // group_size) → {qweight, qzeros,
    scales}."""
    N, K, G = _check_unpacked(codes, zeros, scales, 4, zero_range=(0, 15), what="AWQ")
    if N % 8:
        raise ValueError(f"AWQ packs 8 output columns in a word: N={N} must be a multiple of 8")
    fp16 = _fp16_scales(scales)
    return {
        "qweight": _pack(_awq_interleave(codes.t()), 4, dim=1),  # K, N/8
        "qzeros": _pack(_awq_interleave(zeros.t()), 4, dim=1),  # G, N/8
        "scales": fp16.t().contiguous(),  # G, N
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors → (codes uint8 [N, K], zeros int32 [N, G], scales [N, G])."""
    _check_awq(qweight, qzeros, scales, group_size)
    codes = _awq_deinterleave(_unpack(qweight, 4, dim=1)).t().to(torch.uint8)  # N, K
    zeros = _awq_deinterleave(_unpack(qzeros, 4, dim=1)).t()  # N, G
    return codes.contiguous(), zeros.contiguous(), scales.t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int,
                   *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] with W[n, k] = (code[n, k] − zero[n, k // group_size]) · scale[n, k // group_size],
    in fp32."""
    codes, zeros, scales = unpack_awq(qweight, qzeros, scales, group_size)
    g = torch.arange(codes.shape[1], device=codes.device) // group_size  # K
    return ((codes.int() - zeros[:, g]).float() * scales[:, g].float()).to(dtype)  # N, K


def _awq_interleave(x: torch.Tensor) -> torch.Tensor:
    """[R, N] → [R, N] with each run of 8 columns in AWQ_ORDER (field order), ready for `_pack`."""
    R, N = x.shape
    return x.reshape(R, N // 8, 8)[..., AWQ_ORDER].reshape(R, N)


def _awq_deinterleave(x: torch.Tensor) -> torch.Tensor:
    R, N = x.shape
    return x.reshape(R, N // 8, 8)[..., AWQ_REVERSE_ORDER].reshape(R, N)


def _check_awq(qweight, qzeros, scales, group_size) -> None:
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dim() != 2 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int ≥ 1, got {group_size!r}")
    G = -(-K // group_size)
    if qzeros.shape != (G, N // 8):
        raise ValueError(f"qzeros must be [⌈K/group_size⌉, N/8] = [{G}, {N // 8}] for K={K}, "
                         f"group_size={group_size}, got {tuple(qzeros.shape)}")
    if scales.shape != (G, N) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float [G, N] = [{G}, {N}] tensor, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if len({t.device for t in (qweight, qzeros, scales)}) != 1:
        raise ValueError("qweight, qzeros and scales must be on one device")


# ----------------------------------------------------------------------------- validation
def _check_bits(bits) -> None:
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits={bits!r} is not supported: GPTQ packing handles {GPTQ_BITS} "
                         "(widths that divide 32; 3-bit codes would straddle int32 words)")


def _check_unpacked(codes, zeros, scales, bits, zero_range, what, note="") -> tuple[int, int, int]:
    """Shapes, dtypes and value ranges of the unpacked side; returns (N, K, G)."""
    if codes.dim() != 2 or codes.dtype not in _INT_DTYPES:
        raise ValueError(f"codes must be an integer [N, K] tensor, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    N, K = codes.shape
    if zeros.dim() != 2 or zeros.shape[0] != N or zeros.dtype not in _INT_DTYPES:
        raise ValueError(f"zeros must be an integer [N, G] = [{N}, G] tensor, got {zeros.dtype} "
                         f"{tuple(zeros.shape)}")
    G = zeros.shape[1]
    if scales.shape != (N, G) or not scales.is_floating_point():
        raise ValueError(f"scales must be a float [N, G] = [{N}, {G}] tensor like zeros, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    lo, hi = _range(codes)  # Python ints: in uint8, 1 << 8 would wrap to 0
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(f"codes must lie in 0 .. {(1 << bits) - 1} at {bits} bits, got {lo} .. "
                         f"{hi}")
    lo, hi = _range(zeros)
    if lo < zero_range[0] or hi > zero_range[1]:
        raise ValueError(f"{what} zero points must lie in {zero_range[0]} .. {zero_range[1]} at "
                         f"{bits} bits{note}, got {lo} .. {hi}")
    return N, K, G


def _range(t: torch.Tensor) -> tuple[int, int]:
    return (int(t.min()), int(t.max())) if t.numel() else (0, 0)


def _fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    fp16 = scales.to(torch.float16)
    if not torch.isfinite(fp16).all():
        raise ValueError("scales must be finite in fp16 (|scale| ≤ 65504), the dtype both formats "
                         "store")
    return fp16


def _check_g_idx(g_idx, K, G, check_values) -> None:
    if g_idx.shape != (K,) or g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"g_idx must be an int32/int64 [K] = [{K}] tensor, got {g_idx.dtype} "
                         f"{tuple(g_idx.shape)}")
    lo, hi = _range(g_idx) if check_values else (0, 0)
    if lo < 0 or hi >= G:
        raise ValueError(f"g_idx must hold groups 0 .. {G - 1}, got {lo} .. {hi}")
