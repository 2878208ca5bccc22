"""llama.cpp's block types dequantized in torch (nanoserve/quant/ggml_blocks.py), held to the `gguf`
package's numpy reference (llama.cpp's own Python): random blocks of every type, bit for bit, with
the float16 scales drawn to cover zero, negative, subnormal and extreme values. Negative controls:
a block read with a wrong layout (the nibble order of Q4_0 swapped; Q6_K's halves exchanged) no
longer matches, so the comparison can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.errors import NanoserveError
from nanoserve.quant import ggml_blocks
from nanoserve.quant.ggml_blocks import BLOCK_TYPES, dequantize

gguf = pytest.importorskip("gguf")
from gguf_writer import F16_FIELDS  # noqa: E402

quants = pytest.importorskip("gguf.quants")

SPECIAL_F16 = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1e-5, 1.0, -1.0],
                       dtype=np.float16)


def _random_blocks(name: str, n: int, seed: int) -> np.ndarray:
    """n blocks of random bytes whose float16 fields are finite: mostly ordinary scales (|d| ≈
    1e-3..1, either sign), one in eight an edge value (zero, ±max, subnormal)."""
    kind = BLOCK_TYPES[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, kind.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS.get(name, []):
        values = (rng.choice([-1, 1], n) * 10 ** rng.uniform(-3, 0, n)).astype(np.float16)
        edge = rng.random(n) < 0.125
        values[edge] = rng.choice(SPECIAL_F16, edge.sum())
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(n, 2)
    return blocks


def _reference(blocks: np.ndarray, name: str) -> np.ndarray:
    return quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, name))


@pytest.mark.parametrize("name", [n for n in BLOCK_TYPES if n.startswith("Q")])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_block_type_equals_ggufs_reference_bit_for_bit(name, seed):
    blocks = _random_blocks(name, 512, seed)
    ours = ggml_blocks.DEQUANTIZE[name](torch.from_numpy(blocks)).numpy()
    ref = _reference(blocks, name)
    assert ours.shape == ref.shape == (512, BLOCK_TYPES[name].block_weights)
    np.testing.assert_array_equal(ours, ref)  # NaN-free: the float16 fields are finite


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types(name):
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32))
    stored = values.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name])
    raw = stored.view(torch.uint8) if name != "F32" else stored.view(torch.uint8)
    assert torch.equal(dequantize(raw, name, (8, 64)), stored.float())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_by_gguf_then_read_back(name):
    """Weights gguf itself quantizes (its quantize_blocks): our dequantization of its bytes is its
    dequantization, and near the weights it started from."""
    qtype = getattr(gguf.GGMLQuantizationType, name)
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((16, 256)).astype(np.float32)
    raw = quants.quantize(weights, qtype)
    ours = dequantize(torch.from_numpy(raw), name, (16, 256)).numpy()
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))
    assert np.abs(ours - weights).max() < 0.6  # a 4-bit grid of a N(0, 1) block is this coarse


def test_negative_controls_a_wrong_layout_is_caught():
    blocks = torch.from_numpy(_random_blocks("Q4_0", 64, 2))
    swapped = ggml_blocks._f16(blocks, 0) * (torch.cat([blocks[:, 2:] >> 4, blocks[:, 2:] & 0xF],
                                                       1).float() - 8)
    assert not np.array_equal(swapped.numpy(), _reference(blocks.numpy(), "Q4_0"))
    q6 = _random_blocks("Q6_K", 64, 3)
    exchanged = q6.copy()
    exchanged[:, :64], exchanged[:, 64:128] = q6[:, 64:128], q6[:, :64]
    ours = ggml_blocks.dequantize_q6_k(torch.from_numpy(exchanged)).numpy()
    assert not np.array_equal(ours, _reference(q6, "Q6_K"))


def test_shapes_are_checked():
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    assert dequantize(raw, "Q8_0", (2, 64)).shape == (2, 64)
    with pytest.raises(NanoserveError, match="whole blocks of 32"):
        dequantize(raw, "Q8_0", (4, 33))
    with pytest.raises(NanoserveError, match="not the 256"):
        dequantize(raw, "Q8_0", (4, 64))
    with pytest.raises(NanoserveError, match="allowed: F32"):
        dequantize(raw, "IQ2_XXS", (2, 64))


def test_bits_per_weight_as_llama_cpp_states_them():
    bits = {name: kind.bits_per_weight for name, kind in BLOCK_TYPES.items()}
    assert bits["Q8_0"] == 8.5 and bits["Q4_0"] == 4.5 and bits["Q4_K"] == 4.5
    assert bits["Q6_K"] == 6.5625 and bits["Q2_K"] == 2.625 and bits["Q3_K"] == 3.4375


def test_type_ids_and_block_sizes_are_ggufs():
    for name, kind in BLOCK_TYPES.items():
        qtype = getattr(gguf.GGMLQuantizationType, name)
        assert kind.type_id == qtype.value
        assert (kind.block_weights, kind.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
