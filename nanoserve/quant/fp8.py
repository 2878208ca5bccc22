"""FP8 weights (e4m3), alone (W8A16) or with FP8 activations (W8A8-FP8).

An FP8-e4m3 number has 4 exponent bits and 3 mantissa bits (largest 448): its error is *relative*,
≤ 2⁻⁴ of each value, where int8's is absolute, s/2 for every value of a group. So one scale per
tensor is usually enough for FP8 weights (vLLM's default); one per output channel is finer.

    W ≈ fp8(W / s_w) · s_w     s_w = max|W| / 448, per tensor or per output channel
    x ≈ fp8(x / s_x) · s_x     W8A8-FP8: s_x per token, computed at every call (dynamic)

Checkpoints (compressed_tensors.py) bring three more layouts of the same numbers:

- **block weights** (DeepSeek-V3's scheme): one s_w per tile of bn × bk weights, weight_scale
  [⌈N/bn⌉, ⌈K/bk⌉] (the last tiles may be short);
- **per-token-group activations** (`activations="group"`, its partner): one dynamic s_x per run of
  `act_group_size` inputs of a token, s_x [T, K/g];
- **a static activation scale** (`activations="static"`): one s_x for every token, calibrated
  offline and read from the file (`input_scale`), x ≈ fp8(clamp(x / s_x, ±448)) · s_x.

On Hopper and Ada GPUs (sm_89+) per-token activations with per-tensor or per-channel weights run in
FP8 on tensor cores, `torch._scaled_mm` with the two scales applied to its fp32 accumulator; every
other case (the CPU, older GPUs, block and group scales, a static scale) dequantizes and multiplies
in the activations' dtype: the same numbers (the activations rounded to FP8 and back when they are
FP8 too), no speed-up. Taught in notebooks/13_w8a8.ipynb.
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
# None: W8A16; the rest quantize the activations to FP8 (module docstring)
ACTIVATIONS = (None, "token", "group", "static")
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
    """y = x · Ŵᵀ + b with Ŵ in FP8-e4m3 and its scales (per tensor, channel or block);
    activations rounded to FP8 unless `activations` is None."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: str | None = "token", *, block: tuple[int, int] | None = None,
                 act_group_size: int | None = None, input_scale: torch.Tensor | None = None):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS} (None: W8A16; 'token' / "
                             "'group': dynamic scales per token / per group of a token's inputs; "
                             f"'static': the input_scale), got {activations!r}")
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.block = None if block is None else (int(block[0]), int(block[1]))
        _check_weight_scale(weight_scale, self.out_features, self.in_features, self.block)
        if (activations == "group") != (act_group_size is not None) or (
            act_group_size is not None and (act_group_size < 1 or self.in_features % act_group_size)
        ):
            raise ValueError("act_group_size goes with activations='group' and must divide "
                             f"in_features={self.in_features}, got {act_group_size!r} with "
                             f"activations={activations!r}")
        if (activations == "static") != (input_scale is not None) or (
            input_scale is not None and input_scale.numel() != 1
        ):
            raise ValueError("input_scale (one value) goes with activations='static', got "
                             f"{None if input_scale is None else tuple(input_scale.shape)} with "
                             f"activations={activations!r}")
        self.activations = activations
        self.act_group_size = act_group_size
        self.register_buffer("weight", weight)  # N, K float8_e4m3fn
        # N, 1 or 1, 1 fp32; block: ⌈N/bn⌉, ⌈K/bk⌉
        scale = weight_scale.float()
        self.register_buffer("weight_scale", scale if self.block else scale.reshape(-1, 1))
        self.register_buffer("input_scale",
                             None if input_scale is None else input_scale.float().reshape(1, 1))
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
        s = self.weight_scale  # N, 1 or 1, 1
        if self.block is not None:  # one scale per tile, repeated over its rows and columns
            bn, bk = self.block
            s = s.repeat_interleave(bn, 0)[: self.out_features]  # N, ⌈K/bk⌉
            s = s.repeat_interleave(bk, 1)[:, : self.in_features]  # N, K
        return (self.weight.to(torch.float32) * s).to(dtype)  # N, K

    def fake_quantize_input(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [T, K] rounded to FP8 with this layer's activation scales and back, in fp32."""
        T, K = x2.shape
        if self.activations == "static":
            s = self.input_scale  # 1, 1
            return (x2.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32) * s
        rows = x2 if self.activations == "token" else x2.reshape(-1, self.act_group_size)
        xq, xs = quantize_fp8(rows, per_row=True)  # T, K or T·K/g, g; one scale per row
        return (xq.to(torch.float32) * xs).reshape(T, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # T, K
        y = None
        if (
            self.activations == "token"
            and self.block is None
            and scaled_mm_supported(x.device)
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
        ):
            y = self._scaled_mm(x2)
        # dequantize, multiply in the activations' dtype (FP8 activations: rounded to FP8 and back)
        if y is None:
            if self.activations is not None:
                x2 = self.fake_quantize_input(x2).to(x.dtype)
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
        if self.block is not None:
            scale = f"per {self.block[0]}x{self.block[1]} block"
        else:
            scale = "per channel" if self.weight_scale.numel() > 1 else "per tensor"
        act = {None: "W8A16", "token": "W8A8, activations per token",
               "group": f"W8A8, activations per token and group of {self.act_group_size}",
               "static": "W8A8, activations per tensor (static scale)"}[self.activations]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"FP8-e4m3 {scale}, {act}")


def _check_weight_scale(weight_scale: torch.Tensor, N: int, K: int,
                        block: tuple[int, int] | None) -> None:
    """One scale (per tensor) or N (per channel); with a block [bn, bk], [⌈N/bn⌉, ⌈K/bk⌉]."""
    if block is None and weight_scale.numel() not in (1, N):
        raise ValueError(f"weight_scale must hold one scale (per tensor) or {N} (per channel), got "
                         f"{tuple(weight_scale.shape)}")
    if block is not None:
        bn, bk = block
        want = (-(-N // bn), -(-K // bk)) if bn > 0 and bk > 0 else None
        if want is None or tuple(weight_scale.shape) != want:
            raise ValueError(f"block={block}: weight_scale must be [⌈N/bn⌉, ⌈K/bk⌉] = {want} for "
                             f"weight [{N}, {K}], got {tuple(weight_scale.shape)}")
