"""nanoserve.quant: weight-only quantization of linear layers (int8, int4, int3) and the formats
that store it.

Weight-only quantization stores each weight matrix W [N, K] of a linear layer as small integer
codes plus a float scale and an integer zero point per group of weights, and computes with
Ŵ = (codes − zero) · scale. Activations stay in floating point. Decoding at small batch sizes
reads every weight once per token and is bound by memory traffic, so 4-bit weights move nearly
4× fewer bytes than fp16. The price is the rounding error W − Ŵ; the three quantizers differ
only in how they choose Ŵ:

- rtn.py — round-to-nearest, each weight on its own: the baseline, and the grid (scales,
  zeros, codes, g_idx) that everything else shares. `QuantizedWeight`, `quantize_rtn`.
- gptq.py — GPTQ (Frantar et al. 2022): round one input column at a time and push the error
  onto the columns not yet rounded, using the Hessian H = 2XXᵀ/n of calibration inputs;
  act-order (desc_act) rounds the inputs with the most energy first. `GPTQ`, `gptq_quantize`.
- awq.py — AWQ (Lin et al. 2023): scale the input channels that carry large activations up
  before rounding (s = mean|x|^α, α searched) and fold 1/s into the op before; then clip each
  group's range. `awq_search`, `apply_awq`, `fold_scales`.
- packing.py — the checkpoint formats: GPTQ v1 (AutoGPTQ) and AutoAWQ GEMM int32 packing.
- ggml_blocks.py — llama.cpp's block types (Q8_0 … Q6_K, the tensors of a GGUF file), their
  layouts and their dequantization in torch.
- qlinear.py — `QuantLinear`, the layer the models run: packed GPTQ tensors, dequantized on the fly
  (a fused Triton W4A16 kernel on CUDA).

All three quantizers work one layer (or one group of layers sharing an input) at a time; a
model-level driver runs them block by block over calibration text. Taught in notebooks
05_rtn_gptq, 06_awq and 07_int4_kernel.
"""

from .awq import (
    AWQResult,
    activation_scale,
    apply_awq,
    apply_clip,
    awq_search,
    fold_scales,
    scaled_loss,
    search_clip,
    search_scales,
)
from .gptq import GPTQ, capture_inputs, gptq_naive, gptq_quantize, inverse_hessian_cholesky
from .rtn import QuantizedWeight, fake_quantize, quant_params, quantize_rtn, round_to_codes

__all__ = [
    "AWQResult", "GPTQ", "QuantizedWeight", "activation_scale", "apply_awq", "apply_clip",
    "awq_search",
    "capture_inputs", "fake_quantize", "fold_scales", "gptq_naive", "gptq_quantize",
    "inverse_hessian_cholesky",
    "quant_params", "quantize_rtn", "round_to_codes", "scaled_loss", "search_clip", "search_scales",
]
