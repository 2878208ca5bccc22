"""W8A8: int8 weights *and* int8 activations, multiplied as integers.

Weight-only int8 (rtn.py, bits = 8) still multiplies in floating point: it saves memory, not
arithmetic. With both operands in int8 the product runs on integer units (int8 tensor cores give
twice fp16's throughput) and accumulates exactly in int32:

    x ≈ q_x · s_x   one scale per token (row of x), computed on the fly: s_x = max|x_t| / 127
    W ≈ q_w · s_w   one scale per output channel (row of W), computed once: s_w = max|W_n| / 127
    y = x·Wᵀ ≈ (q_x · q_wᵀ) ⊙ (s_x s_wᵀ)       the int32 product, then one float multiply per output

The scales sit outside the sum over K, which is what lets the integer GEMM run unscaled. Per-token
and per-channel are the granularities that keep that true ("vector-wise", LLM.int8 section 3.1).
The weak point is the activation grid: one outlier feature of 60 in a row of values near 1 makes
s_x = 60/127 and rounds the rest to a handful of levels — what LLM.int8 (llm_int8.py) computes apart
and SmoothQuant (smoothquant.py) moves into the weights.

**Which activation scale.** max|x_t| / 127, codes in [−127, 127], is vLLM's convention (its
per-token int8 kernel) and the papers': the grid is symmetric and the largest |x| lands on ±127
exactly. compressed-tensors' reference forward, which transformers runs for llmcompressor's W8A8
checkpoints, divides by 127.5 instead (the range [−128, 127] is 255 steps wide) and clamps: a grid
0.4 % finer whose largest positive value is clipped by half a step. nanoserve follows vLLM, the
engine these checkpoints are made to be served by. tests/test_compressed_tensors.py checks each
layer against both definitions (nanoserve = vLLM's to float rounding, transformers =
compressed-tensors' exactly, their gap the whole per-layer difference) and shows that what is left
of the logits' difference once the convention is swapped is rounding: float round-off upstream
moving an activation across a code boundary.

On a CUDA GPU (sm_80+) the layer runs kernels/int8_matmul.py, the integer GEMM with the scales
applied in its epilogue. Elsewhere `int8_mm` multiplies with `torch._int_mm` (int8 × int8 → int32 on
CPU; on CUDA it needs more than 16 rows and K, N multiples of 8, so a decode-sized batch is padded
to 17 rows); `int8_mm_ref` is the exact integer reference (float64 holds every partial sum: |q| ≤
127, K < 2^38). Taught in notebooks/13_w8a8.ipynb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
MIN_SCALE = 1e-8  # an all-zero row keeps a finite scale (its codes are 0)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per row: x [..., K] -> q int8 [..., K], s fp32 [...] (a row: a
    token of an activation, or an output channel of a weight)."""
    s = (x.detach().abs().amax(-1).float() / QMAX).clamp(min=MIN_SCALE)  # ...
    q = (x.float() / s[..., None]).round().clamp(-QMAX, QMAX).to(torch.int8)
    return q, s


def int8_mm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer product of int8 a [M, K] and int8 b [N, K]: int32 [M, N] = a · bᵀ (via float64,
    exact)."""
    return (a.double() @ b.double().T).to(torch.int32)


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 a [M, K] · int8 b [N, K]ᵀ -> int32 [M, N], with torch._int_mm (exactly
    `int8_mm_ref`)."""
    M, K = a.shape
    if a.device.type == "cuda":
        N = b.shape[0]
        if K % 8 or N % 8:
            return int8_mm_ref(a, b)  # cuBLASLt's int8 GEMM needs K and N multiples of 8
        if M <= 16:  # ... and more than 16 rows: pad, multiply, drop the padding
            return torch._int_mm(F.pad(a, (0, 0, 0, 17 - M)), b.T)[:M]
    return torch._int_mm(a, b.T)  # b.T: [K, N], column-major, as cuBLASLt wants it


def fused_kernel(device: torch.device) -> bool:
    """Whether W8A8 runs kernels/int8_matmul.py here: a CUDA GPU with int8 tensor cores (sm_80+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


class W8A8Linear(nn.Module):
    """y = x · Wᵀ + b with W int8 per output channel and x quantized to int8 per token at every
    call."""

    host_sync = False  # whether a forward reads device values on the host (no CUDA graph then)

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"weight must be int8 [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() != self.out_features or (
            bias is not None and bias.shape != (self.out_features,)
        ):
            raise ValueError("weight_scale must hold one scale per output channel "
                             f"({self.out_features}) and bias be [{self.out_features}], got "
                             f"{tuple(weight_scale.shape)} and "
                             f"{None if bias is None else tuple(bias.shape)}")
        self.register_buffer("weight", weight)  # N, K int8
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))  # N fp32
        self.register_buffer("bias", bias)  # N or None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> W8A8Linear:
        q, s = quantize_int8(linear.weight)  # N, K; N
        return cls(q, s, None if linear.bias is None else linear.bias.detach().clone(), **kwargs)

    def scaled_product(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """The int8 GEMM of per-token codes xq [T, K] (scales xs [T]) with the weights, rescaled:
        fp32 [T, N]."""
        return int8_mm(xq, self.weight).float() * xs[:, None] * self.weight_scale[None, :]

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]  # N, K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, xs = quantize_int8(x.reshape(-1, self.in_features))  # T, K int8; T
        # the Triton GEMM: scales, bias and cast in its epilogue, one pass
        if fused_kernel(x.device):
            from ..kernels.int8_matmul import w8a8_matmul

            y = w8a8_matmul(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype)  # T, N
            return y.view(*shape[:-1], self.out_features)
        y = self.scaled_product(xq, xs)  # T, N
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        """The same in float: dequantize both operands, multiply (equal up to float rounding)."""
        xq, xs = quantize_int8(x.reshape(-1, self.in_features))
        y = F.linear(xq.double() * xs.double()[:, None], self.dequantized_weight().double(),
                     None if self.bias is None else self.bias.double())
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                "W8A8 int8 (per channel × per token)")
