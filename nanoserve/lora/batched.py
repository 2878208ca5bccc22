"""Several LoRA adapters in one batch: one base matmul for every row, then each row's own x·Aᵢᵀ·Bᵢᵀ.

Merging serves one adapter; a server holding many fine-tunes of one base wants each request under
its own adapter, in the same batch (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023). The base
matmul is shared by all rows; the adapters are not. A layer keeps a fixed number of adapter *slots*:
A [S, R, in] and B [S, out, R] (R the largest rank served; a smaller adapter is zero-padded, which
changes nothing: the padded columns of A meet zero columns of B), and each forward comes with the
slot of every token row (−1: the base alone). Two ways to compute the adapters' part, both plain
torch:

- **segmented** (Punica's SGMV): rows grouped by slot, one pair of matmuls per adapter present;
  efficient when the rows of an adapter are many (prefill, or few adapters).
- **gathered** (Punica's BGMV): each row's A and B gathered, then a batched product per row; one
  launch whatever the mix, at the cost of copying [N, R, in] and [N, out, R].

They are the references of the Triton kernel (kernels/lora_bgmv.py: BGMV's shrink and expand, in
place on the base output); `method` picks one of the three. The slot index of a forward is set by
whoever owns the batch (`set_slots`), like the attention metadata: the layer's forward signature
stays the model's.
"""

from __future__ import annotations

import torch
from torch import nn


def lora_segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                   present: list[int]) -> torch.Tensor:
    """Σ over adapters s in `present` of rows(slot = s)·A[s]ᵀ·B[s]ᵀ. x [N, in], A [S, R, in], B [S,
    out, R], slots [N] -> [N, out]; `present` lists the slots that occur (host values: no device
    read here)."""
    out = x.new_zeros(x.shape[0], B.shape[1])  # N, out
    for s in present:
        rows = (slots == s).nonzero().squeeze(1)  # n_s
        out.index_add_(0, rows, (x.index_select(0, rows) @ A[s].t()) @ B[s].t())  # n_s, out
    return out


def lora_gathered(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """Each row's own adapter gathered: x [N, in] -> [N, out]; a row with slot −1 gets zeros."""
    live = slots >= 0  # N
    s = slots.clamp(min=0)
    shrunk = torch.einsum("nri,ni->nr", A[s], x)  # N, R
    return torch.einsum("nor,nr->no", B[s], shrunk) * live[:, None]  # N, out


class MultiLoRALinear(nn.Module):
    """base(x) + each token row's adapter, from `num_slots` slots of rank ≤ `max_rank`."""

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        ref = next(t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point())
        kw = dict(dtype=dtype or ref.dtype, device=ref.device)
        self.register_buffer("lora_A", torch.zeros(num_slots, max_rank, self.in_features, **kw),
                             persistent=False)
        self.register_buffer("lora_B", torch.zeros(num_slots, self.out_features, max_rank, **kw),
                             persistent=False)
        # N: each token row's slot, −1 none (set per forward)
        self.slots: torch.Tensor | None = None
        self.present: list[int] = []  # the slots that occur in `slots`, known on the host
        # the adapters' part: "segmented" (SGMV), "gathered" (BGMV) or "kernel"
        self.method = "segmented"

    def set_adapter(self, slot: int, A: torch.Tensor | None, B: torch.Tensor | None) -> None:
        """Load A [r, in] and s·B [out, r] into `slot` (zero-padded to max_rank), or clear it
        (None)."""
        R = self.lora_A.shape[1]
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        if A is None:
            return
        r = A.shape[0]
        if r > R or A.shape[1] != self.in_features or tuple(B.shape) != (self.out_features, r):
            raise ValueError(f"an adapter of A {tuple(A.shape)}, B {tuple(B.shape)} does not fit "
                             f"slots of rank ≤ {R} for a [{self.out_features}, {self.in_features}] "
                             "layer")
        self.lora_A[slot, :r] = A
        self.lora_B[slot, :, :r] = B

    def set_slots(self, slots: torch.Tensor, present: list[int]) -> None:
        """This forward's slots, [N] one per token row (x.reshape(-1, in)'s rows), or [B] one per
        batch row of an x [B, T, in] (each row's T tokens share it: the engine's way), and the slots
        present."""
        self.slots, self.present = slots, present

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        y = self.base(x)
        if self.slots is None or not self.present:
            return y
        flat = x.reshape(-1, self.in_features)  # N, in
        slots = self.slots
        # one slot per batch row: repeat it for the row's T tokens
        if slots.shape[0] != flat.shape[0]:
            if x.dim() != 3 or x.shape[0] != slots.shape[0]:
                raise ValueError(f"{slots.shape[0]} slots for an input of shape {tuple(x.shape)}: "
                                 "give one per token row, or one per batch row of a [B, T, in] "
                                 "input")
            slots = slots.repeat_interleave(x.shape[1])  # N
        if self.method == "kernel":  # kernels/lora_bgmv.py (on a CPU, Triton's interpreter)
            from ..kernels.lora_bgmv import lora_bgmv

            return lora_bgmv(flat.contiguous(), self.lora_A, self.lora_B, slots,
                             y.reshape(-1, self.out_features)).view(y.shape)  # y += ..., in place
        if self.method == "gathered":
            extra = lora_gathered(flat, self.lora_A, self.lora_B, slots)
        else:
            extra = lora_segmented(flat, self.lora_A, self.lora_B, slots, self.present)
        return y + extra.view(y.shape)
