"""Test helper: a transformers model written as a GGUF file the way llama.cpp's converter writes
one (its metadata keys, tensor names from gguf's own name map, q/k rows reordered for Llama, Gemma's
norms as 1 + w; Phi-3's fused qkv_proj / gate_up_proj stay fused, as attn_qkv / ffn_up), each
linear in a chosen GGML type. Granite, Gemma 1, StarCoder2, Phi-2, StableLM, Command-R, OLMo 2 / 3,
GPT-NeoX, Qwen2-MoE, GLM-4, ERNIE 4.5 and EXAONE 4 get the key list each of the converter's
classes writes for them (`_CONVERTER_KEYS`: which keys,
from which HF fields), read from the converter's source; the keys' names are the gguf package's own.
Legacy types are quantized by the `gguf` package itself; K-quant types (which it cannot quantize)
get random blocks with small float16 scales — a random model either way, and both readers under
test see the same bytes.

Imported by name (`from gguf_writer import write_gguf`), like testdata.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nanoserve.tokenizers.bpe import token_chars

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# where each type keeps its float16 numbers: byte offsets in a block (llama.cpp's block structs)
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# d (and dmin) of random K-quant blocks: sub-scale × code reach ~45 (Q2_K) to ~4,000 (Q6_K: int8
# scales, 6-bit codes), so that weights stay within about ±0.1
D_SCALE = {"Q2_K": 2e-3, "Q3_K": 5e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2.5e-5}


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, HF's row i + j·d/2 goes to row 2i + j."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def k_blocks(qtype, shape: tuple[int, int], rng) -> np.ndarray:
    """Random K-quant blocks whose float16 scales give weights within about ±0.1 (block sizes from
    gguf's own table)."""
    import gguf

    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block_weights
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype.name]:
        d = (rng.uniform(0.2, 1.0, n) * D_SCALE[qtype.name]).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(shape[0], -1)


def packed_weights(type_name: str, shape: tuple[int, int], seed: int = 0,
                   std: float = 0.05) -> np.ndarray:
    """A [rows, bytes] matrix of `type_name` blocks: N(0, std) weights quantized by gguf (legacy
    types), or random K-quant blocks (which gguf cannot make)."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name in K_TYPES:
        return k_blocks(qtype, shape, rng)
    return gguf.quants.quantize((rng.standard_normal(shape) * std).astype(np.float32), qtype)


def close_gguf(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _archs() -> dict:
    import gguf

    names = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *_CONVERTER_KEYS)
    return {name: getattr(gguf.MODEL_ARCH, name.upper().replace("-", "_")) for name in names}


def _rope_parameters(cfg) -> dict:
    """The full-attention layers' RoPE fields, wherever this transformers keeps them."""
    if hasattr(cfg, "rope_theta"):
        return {"rope_theta": cfg.rope_theta, **(getattr(cfg, "rope_scaling", None) or {})}
    params = cfg.rope_parameters
    return params.get("full_attention", params)  # Gemma 3: one entry per layer type


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rotary_factor(cfg) -> float:
    """Phi's and StableLM's partial_rotary_factor, wherever this transformers keeps it."""
    factor = getattr(cfg, "partial_rotary_factor", None)
    return factor if factor is not None else _rope_parameters(cfg)["partial_rotary_factor"]


def _layer_norm_eps(cfg) -> float:
    """The LayerNorm epsilon under the name the family's config uses (StarCoder2: norm_epsilon)."""
    return getattr(cfg, "layer_norm_eps", None) or cfg.norm_epsilon


def _text_model_keys(writer, cfg) -> None:
    """What the converter's base class (TextModel) writes for every architecture that does not
    write its own list: the sizes, the RoPE base, the norm epsilon under its RMSNorm or LayerNorm
    key, and a head size only where config.json has a head_dim."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(_rope_parameters(cfg)["rope_theta"])
    if getattr(cfg, "rms_norm_eps", None) is not None:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    else:
        writer.add_layer_norm_eps(_layer_norm_eps(cfg))
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)


def _granite_keys(writer, cfg) -> None:
    """Granite: Llama's keys (TextModel's, the vocabulary size, the rotary width; its head_dim is
    dropped) and the four multipliers, each written only when set and non-zero."""
    _text_model_keys(writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for add, value in ((writer.add_attention_scale, cfg.attention_multiplier),
                       (writer.add_embedding_scale, cfg.embedding_multiplier),
                       (writer.add_residual_scale, cfg.residual_multiplier),
                       (writer.add_logit_scale, cfg.logits_scaling)):
        if value:
            add(value)


def _gemma_keys(writer, cfg) -> None:
    """Gemma 1: its own list — no RoPE base (llama.cpp's default 10,000), the head size always."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)


def _phi2_keys(writer, cfg) -> None:
    """Phi-2: its own list — an MLP width of 4 × hidden, as many KV heads as heads, the rotated
    width int(factor · hidden) // heads, no RoPE base."""
    n_embd, n_head = cfg.hidden_size, cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(4 * n_embd)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_rope_dimension_count(int(_rotary_factor(cfg) * n_embd) // n_head)


def _stablelm_keys(writer, cfg) -> None:
    """StableLM: its own list — the rotated width of a head, the parallel-residual flag (which
    llama.cpp does not read), no RoPE base."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    head = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(_rotary_factor(cfg) * head))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_parallel_residual(cfg.use_parallel_residual)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)


def _command_r_keys(writer, cfg) -> None:
    """Command-R: TextModel's keys, the logit scale, and RoPE scaling "none"."""
    import gguf

    _text_model_keys(writer, cfg)
    writer.add_logit_scale(cfg.logit_scale)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _gptneox_keys(writer, cfg) -> None:
    """GPT-NeoX (Pythia): its own list — the rotated width of a head, the parallel-residual flag,
    the LayerNorm epsilon; no RoPE base (llama.cpp's default 10,000) and no KV head count."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    head = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(_rotary_factor(cfg) * head))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_parallel_residual(cfg.use_parallel_residual)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)


def _glm4_keys(writer, cfg) -> None:
    """GLM-4: TextModel's keys and the rotated width, head_dim · partial_rotary_factor."""
    _text_model_keys(writer, cfg)
    writer.add_rope_dimension_count(int(_head_dim(cfg) * _rotary_factor(cfg)))


def _exaone4_keys(writer, cfg) -> None:
    """EXAONE 4: TextModel's keys, the vocabulary size, and with a window the window and which
    layers slide (one bool a layer, from layer_types)."""
    _text_model_keys(writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _olmo2_keys(writer, cfg) -> None:
    """OLMo 2 and 3 (both written as olmo2): TextModel's keys (the base of the full-attention
    layers), and where the config has a window (OLMo 3) the window and which layers slide."""
    _text_model_keys(writer, cfg)
    if getattr(cfg, "sliding_window", None) is not None:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _qwen2moe_keys(writer, cfg) -> None:
    """Qwen2-MoE: TextModel's keys with the expert counts, and the routed and shared experts'
    widths."""
    _text_model_keys(writer, cfg)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _split_expert_stacks(state: dict) -> dict:
    """transformers 5's stacked experts as the converter stores them: gate_up_proj [E, 2F, C] cut
    into experts.gate_proj.weight and experts.up_proj.weight [E, F, C]; down_proj [E, C, F] named
    experts.down_proj.weight; every other tensor as it is."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            width = tensor.shape[1] // 2
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj.weight"] = tensor[:, :width]
            out[stem + "up_proj.weight"] = tensor[:, width:]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def _qkv_by_part(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GPT-NeoX's query_key_value rows (weight or bias), head by head [q_h; k_h; v_h], as its
    converter stores them: all q rows, then all k, then all v."""
    per_head = w.reshape(n_heads, 3, -1, *w.shape[1:])  # H, 3, D, (C)
    return np.concatenate([per_head[:, i].reshape(-1, *w.shape[1:]) for i in range(3)])


# GGUF architecture -> the keys its converter class writes (these replace the Llama-style list
# write_gguf writes for the architectures before them; OLMo 3 is written as olmo2)
_CONVERTER_KEYS = {"granite": _granite_keys, "gemma": _gemma_keys,
                   "starcoder2": _text_model_keys, "phi2": _phi2_keys,
                   "stablelm": _stablelm_keys, "command-r": _command_r_keys,
                   "olmo2": _olmo2_keys, "gptneox": _gptneox_keys,
                   "qwen2moe": _qwen2moe_keys, "glm4": _glm4_keys,
                   "ernie4_5": _text_model_keys, "exaone4": _exaone4_keys}
# architectures whose converter reorders q/k rows (Llama's class and its subclass Granite's)
_PERMUTED = ("llama", "granite")
# architectures whose converter stores every norm weight as 1 + w
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")


def _stacked_head_norms(state: dict) -> dict:
    """StableLM's per-head q/k LayerNorms (q_layernorm.norms.h.weight, h = 0..H-1) stacked into one
    [H, head_dim] q_layernorm.weight per layer, as its converter stacks them; every other tensor
    as it is."""
    import re

    out, heads = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*)\.norms\.(\d+)\.weight", name)
        if match is None:
            out[name] = tensor
            continue
        heads.setdefault(match[1] + ".weight", {})[int(match[2])] = tensor
    for name, per_head in heads.items():
        out[name] = np.stack([per_head[h] for h in sorted(per_head)])  # H, head_dim
    return out


def _add_family_keys(writer, cfg, arch: str) -> None:
    """What llama.cpp's converter writes for one family only."""
    import gguf

    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3" and _rope_parameters(cfg).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(_rope_parameters(cfg)["factor"])
    if arch == "phi3":  # its window (0: none), and its pretraining context, always
        writer.add_sliding_window(cfg.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_pad_token_id(cfg.pad_token_id)  # transformers needs one within the vocabulary


def _add_demo_vocabulary(writer) -> None:
    writer.add_tokenizer_model("gpt2")  # the demo's byte vocabulary: 256 bytes, <|endoftext|>
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token_chars(bytes([b])) for b in range(256)] + ["<|endoftext|>"])
    writer.add_token_types([1] * 256 + [3])
    writer.add_token_merges([])  # bytes only: nothing is merged (transformers then wants scores)
    writer.add_token_scores([0.0] * 257)
    writer.add_eos_token_id(256)


def _llama_style_keys(writer, cfg, arch: str) -> None:
    """The keys written for Llama, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(_rope_parameters(cfg)["rope_theta"])
    head_dim = _head_dim(cfg)
    writer.add_rope_dimension_count(head_dim)
    if arch != "phi3":  # (Phi-3's converter writes no head size: hidden / heads)
        writer.add_key_length(head_dim)  # Qwen3's head is not hidden / heads wide
        writer.add_value_length(head_dim)
    _add_family_keys(writer, cfg, arch)
    writer.add_vocab_size(cfg.vocab_size)


def _as_converted(name: str, w: np.ndarray, cfg, arch: str) -> np.ndarray:
    """One HF tensor as the converter stores it: Gemma's norms as 1 + w, Llama's and Granite's q/k
    rows (weights and biases) reordered for llama.cpp's rotary layout."""
    if arch == "gptneox" and ".query_key_value." in name:
        return _qkv_by_part(w, cfg.num_attention_heads)
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        return w + 1  # llama.cpp's converter stores Gemma's norms (q/k norms too) as 1 + w
    if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_rotary(w, cfg.num_attention_heads)
    if arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_rotary(w, cfg.num_key_value_heads)
    return w


def _quantized(name: str, gguf_name: str, w: np.ndarray) -> bool:
    """Whether the converter stores this tensor in the chosen type: the linears (2-D) and stacked
    experts (3-D), not the embedding, norms or the MoE routers (ffn_gate_inp*, kept F32)."""
    if w.ndim not in (2, 3) or "embed_tokens" in name or "norm" in name:
        return False
    return ".ffn_gate_inp" not in gguf_name


def write_gguf(model, path: Path, qtype_name: str = "F32", arch: str = "llama",
               seed: int = 0, vocabulary: bool = True) -> Path:
    """`model` (a transformers Llama, Qwen2, Qwen3, Gemma2, Gemma3, Phi3, Granite, Gemma,
    Starcoder2, Phi, StableLm, Cohere, Olmo2, Olmo3, GPTNeoX, Qwen2Moe, Glm4, Ernie4_5 or Exaone4
    ForCausalLM with the demo's 257-token vocabulary) as a GGUF
    file at `path`, its 2-D linear weights in `qtype_name`, everything else (norms too) F32, with
    the demo's byte tokenizer (`vocabulary=False`: none, token ids only — llama.cpp refuses a
    "gpt2" vocabulary without merges, and the demo's has none)."""
    import gguf

    cfg = model.config
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if arch in _CONVERTER_KEYS:
        _CONVERTER_KEYS[arch](writer, cfg)
    else:
        _llama_style_keys(writer, cfg, arch)
    if vocabulary:
        _add_demo_vocabulary(writer)
    else:
        writer.add_tokenizer_model("none")
    names = gguf.get_tensor_name_map(_archs()[arch], cfg.num_hidden_layers)
    state = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    for name, w in _split_expert_stacks(_stacked_head_norms(state)).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = _as_converted(name, w, cfg, arch)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if not _quantized(name, gguf_name, w) or qtype_name == "F32":
            writer.add_tensor(gguf_name, w)
        elif qtype_name in K_TYPES:  # (stacked experts: their rows, expert after expert)
            blocks = k_blocks(qtype, (w.size // w.shape[-1], w.shape[-1]), rng)
            writer.add_tensor(gguf_name, blocks.reshape(*w.shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    close_gguf(writer)
    return path
