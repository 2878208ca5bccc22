"""llama2.c checkpoints (Karpathy's `run.c` format, legacy v0): a header of seven int32 and then
every weight as float32, in a fixed order. `read_llama2c` turns one into a ModelConfig and tensors
with HF names and layout, so the Llama model loads it like any HF checkpoint
(nanoserve/models/loader.py calls it for a `.bin` path; stories260K is one). Taught in
notebooks/01_*.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from .config import ModelConfig

_LLAMA2C_HEADER = struct.Struct("<7i")


def read_llama2c(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a legacy (v0, fp32) llama2.c checkpoint into HF names and layout."""
    data = path.read_bytes()
    if len(data) < _LLAMA2C_HEADER.size:
        raise CheckpointError(f"{path} is too short to be a llama2.c checkpoint ({len(data)} "
                              "bytes)")
    if data[:4] == b"ak42":
        raise CheckpointError(f"{path} is a llama2.c v1/v2 export; only the legacy v0 format is "
                              "supported")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = _LLAMA2C_HEADER.unpack_from(data)
    shared = vocab > 0  # llama2.c's convention: a negative vocab size means an untied classifier
    try:
        cfg = ModelConfig(arch="llama", vocab_size=abs(vocab), hidden_size=dim, n_layers=n_layers,
                          n_heads=n_heads, n_kv_heads=n_kv_heads, intermediate_size=hidden,
                          max_position_embeddings=seq_len, norm_eps=1e-5,
                          tie_word_embeddings=shared,
                          bos_token_id=1, eos_token_ids=[2])
    except ConfigError as e:
        raise CheckpointError(f"{path} does not look like a llama2.c checkpoint: {e}") from e
    hd = dim // n_heads
    kv = n_kv_heads * hd
    V, L = abs(vocab), n_layers
    shapes = [("tok_emb", (V, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)),
              ("wk", (L, kv, dim)),
              ("wv", (L, kv, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)),
              ("w1", (L, hidden, dim)),
              ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)), ("rms_final", (dim,)),
              ("freq_cis", (seq_len, hd))]  # real and imaginary halves, unused: we compute RoPE
    if not shared:
        shapes.append(("wcls", (V, dim)))
    need = sum(torch.Size(s).numel() for _, s in shapes)
    have = (len(data) - _LLAMA2C_HEADER.size) // 4
    if have != need:
        raise CheckpointError(
            f"{path}: header promises {need} float32 values, file holds {have}; truncated or not "
            "llama2.c v0")
    flat = torch.frombuffer(bytearray(data[_LLAMA2C_HEADER.size:]), dtype=torch.float32)
    raw, offset = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        raw[name] = flat[offset:offset + n].view(shape)
        offset += n

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        # llama2.c rotates neighbouring pairs (2i, 2i+1); HF rotates (i, i + D/2). Reordering the
        # output rows of wq/wk within each head turns one layout into the other.
        out_dim, in_dim = w.shape
        return (
            w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
        )

    t = {"model.embed_tokens.weight": raw["tok_emb"], "model.norm.weight": raw["rms_final"]}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = raw["rms_att"][i]
        t[p + "self_attn.q_proj.weight"] = unpermute(raw["wq"][i], n_heads)
        t[p + "self_attn.k_proj.weight"] = unpermute(raw["wk"][i], n_kv_heads)
        t[p + "self_attn.v_proj.weight"] = raw["wv"][i]
        t[p + "self_attn.o_proj.weight"] = raw["wo"][i]
        t[p + "post_attention_layernorm.weight"] = raw["rms_ffn"][i]
        t[p + "mlp.gate_proj.weight"] = raw["w1"][i]
        t[p + "mlp.down_proj.weight"] = raw["w2"][i]
        t[p + "mlp.up_proj.weight"] = raw["w3"][i]
    if not shared:
        t["lm_head.weight"] = raw["wcls"]
    return cfg, t
