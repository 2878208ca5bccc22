"""The contiguous KV cache: keys and values of every past token, preallocated per layer.

Without a cache, generating token t recomputes attention inputs for all t previous tokens,
so decoding n tokens costs O(n²) token-forwards. With it, each step runs the model on the
one new token and reads the past keys/values from here: O(n). The price is memory,
2 · layers · max_len · kv_heads · head_dim numbers per sequence, reserved up front — the waste
that the paged cache (nanoserve/paged.py) removes. Taught in notebooks/01_*.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import NanoserveError


class KVCache:
    """k, v: [n_layers, batch, max_seq_len, n_kv_heads, head_dim]; all rows hold `length` tokens."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (cfg.n_layers, batch_size, max_seq_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.length = 0  # tokens cached so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append this step's k, v [B, T, Hkv, D] at `length`; return all cached [B, length+T, Hkv, D]."""
        start, T = self.length, k.shape[1]
        if start + T > self.max_seq_len:
            raise NanoserveError(
                f"KV cache overflow: {start} cached + {T} new tokens > max_seq_len={self.max_seq_len}")
        self.k[layer, :, start:start + T] = k
        self.v[layer, :, start:start + T] = v
        return self.k[layer, :, :start + T], self.v[layer, :, :start + T]

    def advance(self, n: int) -> None:
        """Called by the model once all layers have written the step's n tokens."""
        self.length += n

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
