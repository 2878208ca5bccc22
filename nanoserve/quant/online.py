"""Quantization at load time: `LLM(..., quantization=...)`, vLLM's `quantization="fp8"` for a float
checkpoint.

None of these needs calibration data, so a float model becomes 8-bit as it loads:

- "fp8": FP8-e4m3 weights, one scale per output channel, and FP8 activations with one scale per
  token computed at every call (W8A8-FP8, fp8.py; tensor cores on sm_89+, a dequantizing fallback
  elsewhere);
- "int8": int8 weights per channel, int8 activations per token, an int32 GEMM (W8A8, int8.py);
- "llm.int8": LLM.int8's decomposition, outlier features in float (llm_int8.py).

SmoothQuant (smoothquant.py) does need calibration text: `smooth_model`, then `quantize_linears`
(below) with `W8A8Linear.from_linear`. Every linear of every decoder block is replaced; embeddings
and the LM head stay in float.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..errors import NanoserveError
from .fp8 import FP8Linear
from .int8 import W8A8Linear
from .llm_int8 import LLMInt8Linear
from .model import block_groups, decoder_blocks
from .qlinear import QuantLinear

QUANTIZED_LAYERS = (QuantLinear, W8A8Linear, FP8Linear)  # LLMInt8Linear is a W8A8Linear
QUANTIZERS = {"fp8": FP8Linear.from_linear, "int8": W8A8Linear.from_linear,
                        "llm.int8": LLMInt8Linear.from_linear}


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZERS:
        raise NanoserveError(f"quantization={quantization!r}; allowed: None (the checkpoint as it "
                             f"is), {', '.join(QUANTIZERS)}")


def quantize_on_load(model: nn.Module, quantization: str | None) -> list[str]:
    """Replace the block linears of a float model by 8-bit ones, in place; returns their names
    (None: none)."""
    check_quantization(quantization)
    if quantization is None:
        return []
    done = next(
        (type(m).__name__ for m in model.modules() if isinstance(m, QUANTIZED_LAYERS)), None
    )
    if done is not None:
        raise NanoserveError(f"quantization={quantization!r} quantizes a float checkpoint; this "
                             f"one is already quantized ({done} layers: GPTQ, AWQ or "
                             "compressed-tensors): load it without `quantization`")
    return quantize_linears(model, QUANTIZERS[quantization])


def quantize_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> list[str]:
    """Replace every linear of every decoder block by make(linear) (embeddings, the LM head and a
    MoE router stay in float, as in vLLM's checkpoints); returns the names replaced."""
    prefix, blocks = decoder_blocks(model)
    done = []
    for i, block in enumerate(blocks):
        for _, names in block_groups(model, block):
            for n in names:
                parent, _, child = n.rpartition(".")
                owner = block.get_submodule(parent) if parent else block
                setattr(owner, child, make(getattr(owner, child)))
                done.append(f"{prefix}.{i}.{n}")
    return done
