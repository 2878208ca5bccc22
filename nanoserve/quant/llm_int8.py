"""LLM.int8() (Dettmers et al. 2022): int8 matmul for the ordinary features, float for the outliers.

From about 6.7B parameters on, a few hidden *features* (columns of x, the same ones in nearly every
token and layer) carry values of 20–60 and more while the rest stay near 1. With per-token int8
(int8.py) one such value sets the whole row's scale and the rest round to a few levels. LLM.int8's
*mixed-precision decomposition* splits the product by feature:

    O = { k : max_t |x_tk| > threshold }         the outlier features of this batch (threshold 6.0)
    y = x_{:,O} · W_{:,O}ᵀ   +   int8( x_{:,¬O} ) · int8( W_{:,¬O} )ᵀ
        (float, a few columns)    (vector-wise int8: per token × per output channel, int8.py)

The weight is stored once, in int8 with one scale per output row (bitsandbytes' CB and SCB); the
outlier columns are dequantized for their float product. O depends on the batch: it is found at
every call, from the activations (the paper: ~0.1 % of features, > 99.9 % of the work in int8).
`LLMInt8Linear.forward` is the fast path (one int8 GEMM, one small float GEMM);
`llm_int8_ref` computes the same sum feature by feature. Taught in notebooks/13_w8a8.ipynb.
"""

from __future__ import annotations

import torch

from .int8 import W8A8Linear, quantize_int8

THRESHOLD = 6.0  # the paper's and bitsandbytes' default


class LLMInt8Linear(W8A8Linear):
    """y = x · Wᵀ + b by LLM.int8's decomposition; W held in int8, one scale per output row (as
    W8A8Linear)."""

    host_sync = True  # the outlier columns are found on the host at every call (no CUDA graph)

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 threshold: float = THRESHOLD):
        super().__init__(weight, weight_scale, bias)
        if not threshold > 0:
            raise ValueError("threshold must be > 0 (|x| above it makes a feature an outlier), "
                             f"got {threshold!r}")
        self.threshold = float(threshold)
        # features computed in float by the last call (for the notebook's counts)
        self.last_outliers = 0

    def outlier_features(self, x: torch.Tensor) -> torch.Tensor:
        """The columns of x [T, K] with any |value| above the threshold: indices [n_outliers]."""
        return (x.abs() > self.threshold).any(0).nonzero().flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # T, K
        cols = self.outlier_features(x2)  # n_out
        self.last_outliers = cols.numel()
        # T, K   the outlier columns zeroed: the int8 GEMM skips them
        regular = x2.index_fill(1, cols, 0)
        # T, N   (token scales from the regular features alone)
        y = self.scaled_product(*quantize_int8(regular))
        if cols.numel():
            # N, n_out
            w_out = self.weight.index_select(1, cols).float() * self.weight_scale[:, None]
            y = y + x2.index_select(1, cols).float() @ w_out.T  # T, N   the outliers, in float
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, LLM.int8 "
                f"(threshold {self.threshold})")


def llm_int8_ref(layer: LLMInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The decomposition written out in float64, one input feature at a time: each feature's
    contribution x_k · w_k, taken from the float inputs where k is an outlier, else from their int8
    codes."""
    x2 = x.reshape(-1, layer.in_features).double()  # T, K
    outlier = (x2.abs() > layer.threshold).any(0)  # K
    regular = torch.where(outlier[None, :], 0.0, x2)
    s = (regular.abs().amax(1) / 127).clamp(min=1e-8)  # T   per-token scale of the regular features
    xq = torch.where(outlier[None, :], x2,
                     (regular / s[:, None]).round().clamp(-127, 127) * s[:, None])
    w = layer.weight.double() * layer.weight_scale.double()[:, None]  # N, K
    y = sum(xq[:, k:k + 1] * w[:, k][None, :] for k in range(layer.in_features))  # T, N
    y = y if layer.bias is None else y + layer.bias.double()
    return y.to(x.dtype).view(*x.shape[:-1], layer.out_features)

