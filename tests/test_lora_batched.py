"""nanoserve/lora/batched.py: several adapters in one forward, by segments (SGMV), by gathering
(BGMV) and by the Triton kernel (kernels/lora_bgmv.py).

The oracle is the single-adapter path (LoRALinear, itself proven against PEFT in test_lora.py) run
row by row, each row with its own adapter or none. Adapters of ranks 2, 4 and 8 share slots of rank
8 (zero padding must change nothing). Negative control: the same rows with their slots shifted by
one miss by far.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanoserve.lora.batched import MultiLoRALinear, lora_gathered, lora_segmented
from nanoserve.lora.layer import LoRALinear

IN, OUT = 24, 40


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(IN, OUT)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=g))
        base.bias.copy_(torch.randn(OUT, generator=g))
    adapters = [
        (torch.randn(r, IN, generator=g), torch.randn(OUT, r, generator=g)) for r in (2, 4, 8)
    ]
    layer = MultiLoRALinear(base, num_slots=4, max_rank=8)
    for slot, (A, B) in enumerate(adapters):
        layer.set_adapter(slot, A, B)
    x = torch.randn(2, 5, IN, generator=g)  # B, T, in: token rows in reshape(-1, in) order
    slots = torch.tensor([0, 1, 2, -1, 1, 0, 2, -1, 0, 1])
    return base, adapters, layer, x, slots


def _row_by_row(base, adapters, x, slots):
    rows = []
    for row, s in zip(x.reshape(-1, IN), slots.tolist()):
        layer = base if s < 0 else LoRALinear(base, *adapters[s])
        rows.append(layer(row[None])[0])
    return torch.stack(rows).view(*x.shape[:-1], OUT)


@pytest.mark.parametrize("how", ["segmented", "gathered", "kernel"])
@torch.no_grad()
def test_a_mixed_batch_equals_each_row_under_its_own_adapter(how):
    base, adapters, layer, x, slots = _setup()
    layer.method = how  # (the kernel: Triton's interpreter here)
    layer.set_slots(slots, sorted({s for s in slots.tolist() if s >= 0}))
    want = _row_by_row(base, adapters, x, slots)
    assert (layer(x) - want).abs().max().item() <= 1e-4
    # the control: shifted slots
    layer.set_slots(slots.roll(1), sorted({s for s in slots.tolist() if s >= 0}))
    assert (layer(x) - want).abs().max().item() > 1e-2


@torch.no_grad()
def test_segmented_and_gathered_agree_and_a_cleared_slot_is_the_base():
    base, adapters, layer, x, slots = _setup(1)
    flat = x.reshape(-1, IN)
    seg = lora_segmented(flat, layer.lora_A, layer.lora_B, slots, [0, 1, 2])
    gat = lora_gathered(flat, layer.lora_A, layer.lora_B, slots)
    assert (seg - gat).abs().max().item() <= 1e-4
    assert torch.equal(seg[slots < 0], torch.zeros(2, OUT)) and torch.equal(
        gat[slots < 0], torch.zeros(2, OUT)
    )
    layer.set_adapter(1, None, None)  # cleared: its rows get the base alone
    layer.set_slots(slots, [0, 2])
    rows = (slots == 1).nonzero().squeeze(1)
    assert torch.allclose(layer(x).reshape(-1, OUT)[rows], base(flat[rows]), atol=1e-5)
    layer.set_slots(None, [])
    assert torch.equal(layer(x), base(x))  # no slots set: the base


def test_an_adapter_that_does_not_fit_is_refused():
    _, _, layer, _, _ = _setup()
    with pytest.raises(ValueError, match=r"does not fit slots of rank ≤ 8 for a \[40, 24\] layer"):
        layer.set_adapter(0, torch.zeros(16, IN), torch.zeros(OUT, 16))
    with pytest.raises(ValueError, match="does not fit"):
        layer.set_adapter(0, torch.zeros(4, IN + 1), torch.zeros(OUT, 4))
