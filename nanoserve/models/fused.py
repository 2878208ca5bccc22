"""Checkpoints that store several linears as one matrix: Phi-3's `qkv_proj` and `gate_up_proj`.

One [q + k + v, d] matrix computes q, k and v in one matmul; nanoserve keeps them as the separate
q_proj / k_proj / v_proj (and gate_proj / up_proj) every other family has, so one model class, one
quantizer and one LoRA path serve them all. The rows split exactly (a matmul by stacked rows is the
stacked matmuls), so this is a change of names, not of math: `split_fused` at load, `fuse` at save
so that transformers reads the checkpoint back.
"""

from __future__ import annotations

import re

import torch

from .config import ModelConfig

_FUSED = re.compile(r"^(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def _parts(cfg: ModelConfig, fused: str) -> list[tuple[str, int]]:
    """(module name, rows) of each linear in a fused one, in HF's order."""
    if fused == "self_attn.qkv_proj":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]
    # gate first
    return [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)]


def split_fused(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each fused tensor replaced by its parts, split along the output rows."""
    out = {}
    for key, t in tensors.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = t
            continue
        prefix, fused, kind = m.groups()
        parts = _parts(cfg, fused)
        if t.shape[0] != sum(rows for _, rows in parts):
            return {**tensors}  # a shape the loader's own check will name, with the expected layout
        for (name, _), piece in zip(parts, t.split([rows for _, rows in parts])):
            out[f"{prefix}.{name}.{kind}"] = piece
    return out


def fuse(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `split_fused` for a Phi-3 state dict: q/k/v and gate/up stacked back into one
    each."""
    out = dict(state)
    for key in [k for k in state if k.endswith(("self_attn.q_proj.weight",
                                                "mlp.gate_proj.weight"))]:
        prefix = key.rsplit(".", 3)[0]  # model.layers.N
        fused = "self_attn.qkv_proj" if "self_attn" in key else "mlp.gate_up_proj"
        names = [f"{prefix}.{name}.weight" for name, _ in _parts(cfg, fused)]
        out[f"{prefix}.{fused}.weight"] = torch.cat([out.pop(n) for n in names])
    return out
