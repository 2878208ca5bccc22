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

from nanoserve.models.config import ModelConfig, llama3_rope_inv_freq  # noqa: F401  (exercise 2.1)


# ----------------------------------------------------------------------------- exercise 1
def causal_mask(q_positions: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, S]: query at absolute position p sees keys at positions 0..p; with a
    sliding window w (Exercise 1.3) only the w newest of them, p − w + 1 .. p.

    q_positions [B, T] are absolute positions; key j sits at position j (j < kv_len)."""
    raise NotImplementedError(
        "Exercise 1.1: a query sees every key written at or before its own absolute position "
        "(roughly 2 lines; see notebooks/01_engine_core, section 4, 'The KV cache'); 1.3: with a "
        "window, only the newest `window` of them (one more line; more: make hint EX=ex01 N=2)")


def naive_attention(q, k, v, q_positions=None, window: int | None = None):
    """softmax(q·kᵀ/√d + causal mask)·v, written out.  q [B,T,H,D]; k, v [B,S,Hkv,D] -> [B,T,H,D].

    Key j sits at position j. `q_positions` [B, T] are the queries' absolute positions; None
    means the queries are the keys themselves (positions 0..T-1, no cache). With Hkv < H
    (grouped-query attention) each kv head serves H // Hkv consecutive query heads. Compute in
    float32 and return q's dtype. `window`: pass it on to causal_mask (Exercise 1.3)."""
    raise NotImplementedError(
        "Exercise 1.2: scaled dot products of queries and keys, the hidden ones at −∞, a softmax "
        "over the keys, a weighted sum of the values; several query heads share each kv head "
        "(roughly 10 lines; see notebooks/01_engine_core, sections 1 and 3, 'Grouped-query "
        "attention'; more: make hint EX=ex01 N=2)")


# ----------------------------------------------------------------------------- exercise 2
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """θ_i = base^(-2i/d) for i < d/2 (Su et al. 2021), with the config's scaling applied.

    d = cfg.head_dim, base = cfg.rope_theta; returns float32 [D/2], fastest first (θ_0 = 1).
    cfg.rope_scaling is None (no scaling) or a dict whose "rope_type" says what to do:
    "default" nothing, "linear" divide every θ_i by scaling["factor"], "llama3" return
    llama3_rope_inv_freq(inv_freq, scaling) (imported above: Llama 3.1's frequency bands)."""
    raise NotImplementedError(
        "Exercise 2.1: each pair of dimensions turns at its own speed, a geometric series from 1 "
        "down, set by the base; then the scaling the config asks for (roughly 10 lines; see "
        "notebooks/01_engine_core, section 3, 'RoPE: rotary position embeddings'; more: make "
        "hint EX=ex02 N=2)")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of position·θ for each position; [B, T] positions -> two [B, T, 1, D] tensors.

    A token at position m turns pair i by the angle m·θ_i. Pair i is (i, i + D/2) (HF's half-split
    layout), so the D/2 angles appear twice, side by side: [a_0 .. a_{D/2-1}, a_0 .. a_{D/2-1}].
    Compute the angles in float32 and return cos and sin in `dtype`; the axis of size 1 broadcasts
    over heads. Rows of a batch may sit at different positions (a cache holds different lengths)."""
    raise NotImplementedError(
        "Exercise 2.2: a token at position m turns pair i by m times pair i's frequency; every "
        "angle serves both halves of the head (roughly 3 lines; see notebooks/01_engine_core, "
        "section 3, 'RoPE: rotary position embeddings'; more: make hint EX=ex02 N=2)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1], where x1 and x2 are the first and second halves of the last dim."""
    raise NotImplementedError(
        "Exercise 2.3: every pair turned by 90 degrees at once (roughly 2 lines; see "
        "notebooks/01_engine_core, section 3, 'RoPE: rotary position embeddings'; more: make "
        "hint EX=ex02 N=2)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+D/2}) pair by position·θ_i.  x: [B, T, H, D].

    Pairs are (i, i + D/2), the layout of HF checkpoints. llama2.c pairs neighbours
    (2i, 2i+1) instead; its loader permutes the q/k weight rows so this one function serves both.
    cos, sin [B, T, 1, D] come from rope_cos_sin. A 2-D rotation by a:
    (x1, x2) -> (x1·cos a − x2·sin a, x2·cos a + x1·sin a). Returns x's shape and dtype.
    """
    raise NotImplementedError(
        "Exercise 2.4: a rotation by a is cos a times the vector plus sin a times the vector "
        "turned by 90 degrees (roughly 1 line; see notebooks/01_engine_core, section 3, 'RoPE: "
        "rotary position embeddings'; more: make hint EX=ex02 N=2)")
