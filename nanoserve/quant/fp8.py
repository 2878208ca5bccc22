"""FP8 weights (e4m3), alone (W8A16) or with FP8 activations (W8A8-FP8).

An FP8-e4m3 number has 4 exponent bits and 3 mantissa bits (largest 448): its error is *relative*,
≤ 2⁻⁴ of each value, where int8's is absolute, s/2 for every value of a group. So one scale per
tensor is usually enough for FP8 weights (vLLM's default); one per output channel is finer.

    W ≈ fp8(W / s_w) · s_w     s_w = max|W| / 448, per tensor or per output channel
    x ≈ fp8(x / s_x) · s_x     W8A8-FP8: s_x per token, computed at every call (dynamic)

On Hopper and Ada GPUs (sm_89+) the product runs in FP8 on tensor cores, `torch._scaled_mm` with
the two scales applied to its fp32 accumulator; elsewhere (the CPU, older GPUs) the layer
dequantizes and multiplies in the activations' dtype: the same numbers (the activations rounded to
FP8 and back when they are FP8 too), no speed-up. Taught in
notebooks/13_w8a8.ipynb.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("nanoserve")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALES = ("tensor", "channel")
MIN_SCALE = 1e-12


def quantize_fp8(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (fp8 codes [R, K], fp32 scale [R, 1] per row, or [1, 1] for the whole tensor)."""
    amax = x.detach().abs().amax(-1,
                                 keepdim=True) if per_row else x.detach().abs().amax().reshape(1, 1)
    s = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)  # R, 1 or 1, 1
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


# devices where this torch's _scaled_mm refused row-wise scales
_SCALED_MM_REFUSED: set[str] = set()


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether to try `torch._scaled_mm` (FP8 × FP8) here: CUDA with compute capability 8.9 or
    newer, unless it has refused row-wise scales on this device before (torch < 2.5; some GPU and
    torch pairs)."""
    return (device.type == "cuda" and str(device) not in _SCALED_MM_REFUSED
            and torch.cuda.get_device_capability(device) >= (8, 9))


class FP8Linear(nn.Module):
    """y = x · Ŵᵀ + b with Ŵ in FP8-e4m3 and its scale; activations FP8 per token when
    `activations="token"`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: str | None = "token"):
        super().__init__()
        if activations not in (None, "token"):
            raise ValueError("activations must be None (W8A16) or 'token' (W8A8, dynamic "
                             f"per-token scales), got {activations!r}")
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() not in (1, self.out_features):
            raise ValueError("weight_scale must hold one scale (per tensor) or "
                             f"{self.out_features} (per channel), got {tuple(weight_scale.shape)}")
        self.activations = activations
        self.register_buffer("weight", weight)  # N, K float8_e4m3fn
        # N, 1 or 1, 1 fp32
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1, 1))
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_scale: str = "channel",
                    activations: str | None = "token"):
        if weight_scale not in SCALES:
            raise ValueError(f"weight_scale must be one of {', '.join(SCALES)}, got "
                             f"{weight_scale!r}")
        q, s = quantize_fp8(linear.weight, per_row=weight_scale == "channel")
        return cls(q, s, None if linear.bias is None else linear.bias.detach().clone(), activations)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale).to(dtype)  # N, K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # T, K
        y = None
        if (
            self.activations == "token"
            and scaled_mm_supported(x.device)
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
        ):
            y = self._scaled_mm(x2)
        # dequantize, multiply in the activations' dtype (FP8 activations: rounded to FP8 and back)
        if y is None:
            if self.activations == "token":
                xq, xs = quantize_fp8(x2, per_row=True)
                x2 = (xq.to(torch.float32) * xs).to(x.dtype)
            y = F.linear(x2, self.dequantized_weight(x.dtype))  # T, N
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor | None:
        """FP8 × FP8 on tensor cores, the two scales applied to the fp32 accumulator; None where
        this torch refuses (remembered for the device). Its row-wise-scaled kernel writes bf16: fp16
        and fp32 models get their outputs rounded to bf16 there, which the dequantizing path does
        not do."""
        xq, xs = quantize_fp8(x2, per_row=True)  # T, K fp8; T, 1
        # 1, N   row-wise for any scale
        s_w = self.weight_scale.T.expand(1, self.out_features).contiguous()
        try:
            return torch._scaled_mm(xq, self.weight.T, scale_a=xs, scale_b=s_w,
                                    out_dtype=torch.bfloat16)
        except RuntimeError as e:
            _SCALED_MM_REFUSED.add(str(x2.device))
            logger.warning("torch._scaled_mm refused FP8 with row-wise scales on %s (%s); "
                           "dequantizing instead",
                           x2.device, str(e).splitlines()[0])
            return None

    def extra_repr(self) -> str:
        scale = "per channel" if self.weight_scale.numel() > 1 else "per tensor"
        act = "W8A8, activations per token" if self.activations else "W8A16"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"FP8-e4m3 {scale}, {act}")
