"""Exercises 1 and 2: attention with a KV cache, and rotary position embeddings (RoPE).

Your versions of functions in nanoserve/models/layers.py, with the same names and signatures.
Taught in notebooks/01_engine_core.ipynb (sections 1, 3 and 4). Check your work with

    make exercises EX=ex01        # or: .venv/bin/pytest tests/exercises -m ex01 --impl exercises

Shapes: B batch, T queries, S keys, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math  # noqa: F401  (you will want it)

import torch
import torch.nn.functional as F  # noqa: F401


# ----------------------------------------------------------------------------- exercise 1
def causal_mask(q_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S]: query at absolute position p sees keys at positions 0..p.

    q_positions [B, T] are absolute positions; key j sits at position j (j < kv_len)."""
    raise NotImplementedError(
        "Exercise 1.1: compare the key positions 0..S-1 with each query's position "
        "(roughly 2 lines; see notebooks/01_engine_core, section 4, 'The KV cache')")


def naive_attention(q, k, v, q_positions=None):
    """softmax(q·kᵀ/√d + causal mask)·v, written out.  q [B,T,H,D]; k, v [B,S,Hkv,D] -> [B,T,H,D].

    Key j sits at position j. `q_positions` [B, T] are the queries' absolute positions; None
    means the queries are the keys themselves (positions 0..T-1, no cache). With Hkv < H
    (grouped-query attention) each kv head serves H // Hkv consecutive query heads. Compute in
    float32 and return q's dtype."""
    raise NotImplementedError(
        "Exercise 1.2: scores = q·kᵀ/√D, mask with causal_mask, softmax over keys, weight v; "
        "repeat each kv head for its group of query heads first "
        "(roughly 10 lines; see notebooks/01_engine_core, sections 1 and 3, 'Grouped-query attention')")
