"""kernels/lora_bgmv.py: each row's LoRA adapter added to the base output (Punica's BGMV), in
Triton's interpreter here (the GPU compile matrix compiles it for sm_80..90), against two
references: the kernel file's own `lora_bgmv_ref` (gather per row) and nanoserve/lora/batched.py's
segmented `lora_segmented` (one pair of matmuls per adapter), which were proven against the
single-adapter layer. Ragged shapes (in, out, R not multiples of the tiles), rows without an adapter
left exactly as they were, slots out of range refused. Negative control: rows with and without an
adapter swapped miss by far.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.lora_bgmv import lora_bgmv, lora_bgmv_ref

from nanoserve.lora.batched import lora_segmented


def _case(seed, N, IN, OUT, S, R, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, IN, generator=g).to(dtype)
    A = torch.randn(S, R, IN, generator=g).to(dtype)
    B = torch.randn(S, OUT, R, generator=g).to(dtype)
    slots = torch.randint(-1, S, (N,), generator=g)
    y = torch.randn(N, OUT, generator=g).to(dtype)
    return x, A, B, slots, y


@pytest.mark.parametrize("N,IN,OUT,S,R,block_k,block_o", [
    (7, 24, 40, 3, 8, 16, 16),  # ragged in and out against the tiles
    (5, 64, 96, 4, 5, 64, 32),  # R not a power of two
    (1, 33, 17, 1, 16, 8, 8),   # one row, one slot
])
def test_kernel_matches_both_references(N, IN, OUT, S, R, block_k, block_o):
    x, A, B, slots, y = _case(0, N, IN, OUT, S, R)
    want = y + lora_bgmv_ref(x, A, B, slots)
    present = sorted({s for s in slots.tolist() if s >= 0})
    assert torch.allclose(
        lora_bgmv_ref(x, A, B, slots), lora_segmented(x, A, B, slots, present), atol=1e-4
    )
    got = lora_bgmv(x, A, B, slots, y.clone(), block_k=block_k, block_o=block_o)
    assert (got - want).abs().max().item() <= 1e-4
    none = slots < 0
    assert torch.equal(got[none], y[none])  # rows without an adapter: untouched, bit for bit
    # the control: adapter rows without, the others with slot 0
    flipped = torch.where(slots >= 0, -1, 0)
    assert (lora_bgmv(x, A, B, flipped, y.clone(), block_k=block_k,
                      block_o=block_o) - want).abs().max() > 1e-2


def test_bad_inputs_are_named():
    x, A, B, slots, y = _case(1, 4, 16, 8, 2, 4)
    with pytest.raises(ValueError, match=r"slots must be −1 or 0 \.\. 1, got"):
        lora_bgmv(x, A, B, slots + 2, y)
    with pytest.raises(ValueError, match="lora_bgmv needs x \\[N, in\\]"):
        lora_bgmv(x[None], A, B, slots, y)
    with pytest.raises(ValueError, match="one dtype"):
        lora_bgmv(x.double(), A, B, slots, y)
    with pytest.raises(ValueError, match="slots must be int32/int64"):
        lora_bgmv(x, A, B, slots.float(), y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_on_a_gpu(dtype):
    """The compiled kernel (not the interpreter) against the reference, at a decode batch's
    shape."""
    x, A, B, slots, y = (t.cuda() for t in _case(2, 64, 4096, 4096, 8, 16, dtype))
    want = y.float() + lora_bgmv_ref(x, A, B, slots).float()
    got = lora_bgmv(x, A, B, slots, y.clone()).float()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
