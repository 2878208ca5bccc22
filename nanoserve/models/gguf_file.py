"""GGUF, llama.cpp's one-file checkpoints: the config, the tensors, kept packed and memory-mapped.

A GGUF file is a header of typed key/value pairs (`general.architecture`, `llama.block_count`,
`tokenizer.ggml.tokens`, ...), a table of tensors (name, shape, GGML type, offset), then the
tensors' bytes, each aligned. `gguf.GGUFReader` (llama.cpp's own Python reader) parses it and maps
the file into memory: a tensor's data is a view of the mapping, so nothing is read from disk until
it is touched, and the pages are the OS's page cache, shared by every process that maps the file.

What this module does with it:

- **the config**: the architecture's keys become the HF config.json fields they stand for, and
  that dict goes through the same reader as an HF checkpoint's (hf_config.py: every field that
  changes the math is implemented or refused by name). A key of the architecture that nothing
  here reads is refused by name too — a GGUF file must not load as something it is not.
- **the tensors**: renamed to the model's names (`blk.3.attn_q.weight` →
  `model.layers.3.self_attn.q_proj.weight`). Linears stored in a quantized type stay packed
  (`GGMLLinear`: the file's bytes, dequantized as each forward needs them); float tensors (norms,
  and F16/BF16/F32 linears) are converted to the model's dtype, a copy. The embedding is
  dequantized at load (a lookup table; one step of many, said here so nobody mistakes it).
- **Llama's q and k**: llama.cpp's converter reorders each head's rows of q_proj and k_proj so
  that rotary embedding pairs neighbouring dimensions (the original Llama code's layout), where HF
  pairs dimension i with i + d/2. Reading them back, `unpermute_rotary` undoes it. Qwen2/Qwen3
  files keep HF's layout.

- **the tokenizer**: from the file's `tokenizer.ggml.*` arrays (tokenizers/gguf_vocab.py).

- **Gemma's norms**: llama.cpp stores every Gemma 2 / 3 norm weight (q/k norms too) as 1 + w, the
  factor it multiplies by; reading them back subtracts the 1 (NORM_OFFSET).
- **Phi-3's fused matrices**: `attn_qkv` stacks q, k and v, and `ffn_up` stacks gate and up (gate
  first); `split_fused_rows` cuts them into the separate linears our model holds — packed rows too,
  since every row of blocks is quantized on its own. GPT-NeoX's `attn_qkv` and GLM-4's `ffn_up`
  are cut the same way (GPT-NeoX's converter has already reordered HF's head-by-head rows).
- **MoE experts**: Qwen2-MoE's `ffn_{gate,up,down}_exps` stack every expert's matrix
  [n_expert, rows, cols]; `expert_slices` gives each expert its own linear (packed rows too).

Families: llama (and Mistral, which llama.cpp writes as llama: gguf has no "mistral"
architecture), qwen2, qwen3, gemma2 and gemma3 (its text model: every 6th layer global, the others
sliding with a RoPE base of 10,000, as llama.cpp fixes them; query scale inferred as llama.cpp
does: `gemma_query_scale`; linear RoPE scaling of the global layers), phi3 (LongRoPE's factor
tensors and partial RoPE refused by name; its window not applied, as neither llama.cpp nor
transformers applies it to these files); and the families of their own modules (models/families/)
that llama.cpp has: granite (its four multipliers; a missing embedding or residual scale is 1 and a
missing attention scale 1/√head_dim, as llama.cpp computes them; q/k biases reordered with their
rows), gemma (Gemma 1), starcoder2, phi2 (its rotated width from rope.dimension_count), stablelm
(the parallel residual where a block has no ffn_norm, as llama.cpp decides) and command-r
(Cohere); gptneox (Pythia: its parallel-residual flag, rotated width and LayerNorm epsilon),
qwen2moe (routed experts and the sigmoid-gated shared expert; top-k weights not renormalised, as
llama.cpp runs qwen2moe), glm4 (its sandwich norms, partial RoPE on adjacent pairs), ernie4_5 (its
dense models) and exaone4 (which layers slide from attention.sliding_window_pattern; with a
window the global layers have no RoPE); and olmo2 (OLMo 2, and OLMo 3: an olmo2 file with a
window, its sliding layers from the pattern, their RoPE base rope.freq_base_swa or else the file's
one base, unscaled: `olmo3_fields`). Biases and q/k norms are read from which tensors the file
holds (TENSOR_FIELDS), as llama.cpp reads them. On the CPU, `GGMLLinear` multiplies a few rows by
the packed blocks in place (kernels/cpu_packed_gemv.c); on a GPU, Q8_0, Q4_K and Q6_K blocks are
dequantized in registers by a Triton kernel (kernels/ggml_matmul.py), other types dequantized whole,
then multiplied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..kernels.cpu_packed_gemv import (
    KERNEL_MAX_ROWS,
    PreparedBlocks,
    cpu_gemv_problem,
    decoded_matmul,
    ggml_dequantize,
)
from ..kernels.cpu_packed_gemv import KINDS as GEMV_TYPES
from ..quant.ggml_blocks import BLOCK_TYPES, dequantize
from ..tokenizers.gguf_vocab import gguf_tokenizer

# GGUF architecture → (HF model_type, whether llama.cpp permuted q and k). Mistral is written as
# llama (gguf has no "mistral" architecture); Gemma 3's files hold its text model only.
# Granite is written by the Llama converter's subclass, so its q and k are reordered too.
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
                 "gemma2": ("gemma2", False), "gemma3": ("gemma3_text", False),
                 "phi3": ("phi3", False), "granite": ("granite", True), "gemma": ("gemma", False),
                 "starcoder2": ("starcoder2", False), "phi2": ("phi", False),
                 "stablelm": ("stablelm", False), "command-r": ("cohere", False),
                 "olmo2": ("olmo2", False), "gptneox": ("gpt_neox", False),
                 "qwen2moe": ("qwen2_moe", False), "glm4": ("glm4", False),
                 "ernie4_5": ("ernie4_5", False), "exaone4": ("exaone4", False)}
# keys under "<arch>." → the HF config field each one is
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "attn_logit_softcapping": "attn_logit_softcapping",  # Gemma 2's
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base_swa": "rope_local_base_freq",  # Gemma 3's sliding layers (else 10,000)
    "rope.scaling.original_context_length": "original_max_position_embeddings",  # Phi-3's
}
# the RoPE scaling keys, read together into HF's rope_scaling (`rope_scaling_from_gguf`)
ROPE_SCALING_KEYS = ("rope.scaling.type", "rope.scaling.factor")
ROPE_SCALING_TYPES = ("none", "linear")
# keys only some architectures have -> the HF field of that family each one is. Granite's and
# Command-R's `logit_scale` are opposites: llama.cpp divides Granite's logits by it (HF's
# logits_scaling) and multiplies Command-R's (HF's logit_scale). The LayerNorm families' epsilon
# goes to the field their HF config names it by.
ARCH_CONFIG_KEYS = {
    "granite": {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"},
    "starcoder2": {"attention.layer_norm_epsilon": "norm_epsilon"},
    "phi2": {"attention.layer_norm_epsilon": "layer_norm_eps"},
    "stablelm": {"attention.layer_norm_epsilon": "layer_norm_eps"},
    "command-r": {"attention.layer_norm_epsilon": "layer_norm_eps", "logit_scale": "logit_scale"},
    "gptneox": {"attention.layer_norm_epsilon": "layer_norm_eps",
                "use_parallel_residual": "use_parallel_residual"},
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count")
# architectures normalised by LayerNorm, whose epsilon llama.cpp requires under its own key
LAYER_NORM_ARCHS = ("starcoder2", "phi2", "stablelm", "command-r", "gptneox")
# keys llama.cpp requires of one architecture only (its loader has no default for them)
ARCH_REQUIRED_KEYS = {"granite": ("logit_scale",), "command-r": ("logit_scale",),
                      "gptneox": ("use_parallel_residual",),
                      "qwen2moe": ("expert_count", "expert_used_count",
                                   "expert_feed_forward_length",
                                   "expert_shared_feed_forward_length")}
# keys read for a check only: they must agree with the others
CHECKED_KEYS = ("rope.dimension_count", "attention.value_length")
# architectures whose rope.dimension_count is the rotated part of each head (HF's
# partial_rotary_factor = it / head size); elsewhere it must be the whole head
PARTIAL_ROPE_ARCHS = ("phi2", "stablelm", "gptneox", "glm4")
# HF fields a file states by holding a tensor (block 0's) or not: biases, q/k norms
TENSOR_FIELDS = {
    "llama": {"attention_bias": "blk.0.attn_q.bias", "mlp_bias": "blk.0.ffn_up.bias"},
    "granite": {"attention_bias": "blk.0.attn_q.bias", "mlp_bias": "blk.0.ffn_up.bias"},
    "starcoder2": {"use_bias": "blk.0.attn_q.bias"},
    "stablelm": {"use_qkv_bias": "blk.0.attn_q.bias", "qk_layernorm": "blk.0.attn_q_norm.weight"},
    "command-r": {"attention_bias": "blk.0.attn_q.bias", "use_qk_norm": "blk.0.attn_q_norm.weight"},
    "gptneox": {"attention_bias": "blk.0.attn_qkv.bias"},
    "qwen2moe": {"qkv_bias": "blk.0.attn_q.bias"},
    "glm4": {"attention_bias": "blk.0.attn_q.bias"},
    "ernie4_5": {"use_bias": "blk.0.attn_q.bias"},
}
# keys a family's files carry that its readers (llama.cpp, transformers) do not apply: Phi-3's
# window, which llama.cpp switches off (its converter does not say which layers slide) and
# transformers' GGUF reader skips; nanoserve runs the file as both of them do
# StableLM's use_parallel_residual, which llama.cpp does not read either: it runs the parallel
# residual in the blocks without an ffn_norm (and the converter writes True for a config.json that
# lacks the field, sequential models included)
IGNORED_KEYS = {"phi3": ("attention.sliding_window",), "stablelm": ("use_parallel_residual",)}
# keys read by a function of their own (`window_layers`), not copied into one HF field: which
# layers slide, one bool a layer (True: sliding; OLMo 3's may be a period, as llama.cpp reads it)
LAYER_PATTERN_KEYS = {"exaone4": ("attention.sliding_window_pattern",),
                      "olmo2": ("attention.sliding_window_pattern",)}
# the top-level RoPE fields an OLMo 3 file's config moves into its per-layer-type rope_parameters
OLMO3_MOVED = ("rope_theta", "rope_scaling", "rope_local_base_freq")
FLOAT_TYPES = ("F32", "F16", "BF16")
# blk.N.<GGUF name> → model.layers.N.<our name>
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# where an architecture names a block's tensors otherwise (Gemma 2 and 3: four norms a block;
# Phi-3: q, k, v as one matrix, and gate and up as one, under ffn_up)
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# EXAONE 4: OLMo 2's post-norms. GLM-4: gate and up as one matrix under ffn_up (gate first), and
# its four norms under HF's names (its family's `rename` maps them onto the sandwich block's); q
# and k in HF's order (both rotate adjacent pairs). Qwen2-MoE: the router, the experts stacked
# [n_expert, rows, cols] (one linear per expert at load: `expert_slices`), the shared expert and
# its sigmoid gate (moe_shared.py's names)
_QWEN2MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                   "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Phi-2: llama.cpp has no q/k norms for it (None: refused by name); OLMo 2: the norms after
# attention and after the MLP, none before; GPT-NeoX: q, k, v as one matrix, which its converter
# has already reordered from HF's head-by-head [q_h; k_h; v_h] rows to all q, all k, all v
ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS,
                    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                    "phi2": {"attn_q_norm": None, "attn_k_norm": None},
                    "gptneox": {"attn_qkv": "self_attn.qkv_proj"},
                    "qwen2moe": _QWEN2MOE_NAMES,
                    "exaone4": {"post_attention_norm": "post_attention_layernorm",
                                "post_ffw_norm": "post_feedforward_layernorm"},
                    "glm4": {"ffn_up": "mlp.gate_up_proj",
                             "post_attention_norm": "post_self_attn_layernorm",
                             "post_ffw_norm": "post_mlp_layernorm"},
                    "olmo2": {"post_attention_norm": "post_attention_layernorm",
                              "post_ffw_norm": "post_feedforward_layernorm"}}
# a fused matrix → the linears whose rows it stacks, in order (our model keeps them apart)
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# llama.cpp stores Gemma's norm weights (q/k norms too) as 1 + w, what they multiply by; our model
# holds w, as HF
NORM_OFFSET = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}
# (blocks, width) of the Gemma whose queries llama.cpp scales by width / heads, not by head size
GEMMA_27B = {"gemma2": (46, 4608), "gemma3": (62, 5376)}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
LAYER_TENSOR = re.compile(r"(model\.layers\.\d+)\.([\w.]+)\.(weight|bias)")
GEMV_MAX_ROWS = KERNEL_MAX_ROWS  # activation rows up to which the C kernel beats decode + GEMM


class GGMLLinear(nn.Module):
    """A linear layer whose weight stays in a GGML block type (the file's bytes): each forward
    dequantizes it (quant/ggml_blocks.py) and multiplies. `packed` is [out_features, bytes per
    row], uint8, usually a view of the memory-mapped file."""

    def __init__(self, packed: torch.Tensor, type_name: str, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.type_name, self.in_features, self.out_features = type_name, in_features, out_features
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # the C kernel's call, prepared once per `packed` tensor: (key, PreparedBlocks, packed)
        self._cpu_plan: tuple | None = None

    def weight_float(self) -> torch.Tensor:
        """W [out, in] float32: decoded in C where the CPU kernel reads the type, else in torch
        (quant/ggml_blocks.py; the same numbers)."""
        if (self.packed.device.type == "cpu" and self.type_name in GEMV_TYPES
                and cpu_gemv_problem() is None):
            return ggml_dequantize(self.packed, self.type_name, self.out_features,
                                   self.in_features)
        return dequantize(self.packed, self.type_name, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda:  # Triton, dequantizing in registers (kernels/ggml_matmul.py)
            from ..kernels.ggml_matmul import ggml_kernel_serves, ggml_matmul
            if ggml_kernel_serves(rows, self.packed, self.type_name):
                y = ggml_matmul(rows, self.packed, self.type_name, self.out_features)
                y = y if bias is None else y + bias
                return y.reshape(*x.shape[:-1], self.out_features)
        if self._c_reads(rows):  # the blocks read by kernels/cpu_packed_gemv.c
            if rows.shape[0] <= GEMV_MAX_ROWS:  # a decode step: multiplied in place
                y = self._prepared()(rows.contiguous())
            else:  # a prefill, a large batch: decoded a slab at a time, BLAS GEMMs
                y = decoded_matmul(rows, self._decode_rows, self.out_features)
            y = y if bias is None else y + bias
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight_float().to(x.dtype), bias)

    def _prepared(self) -> PreparedBlocks:
        """The kernel's call for `packed`, checked once per tensor (replaced or changed in place:
        again), so that a decode step's forward pays for no checks."""
        packed = self._buffers["packed"]
        key = (id(packed), packed._version)
        if self._cpu_plan is None or self._cpu_plan[0] != key:
            call = PreparedBlocks(packed, self.type_name, self.in_features, self.out_features)
            self._cpu_plan = (key, call, packed)  # `packed` referenced: its id stays its own
        return self._cpu_plan[1]

    def _decode_rows(self, n0: int, n1: int) -> torch.Tensor:
        return ggml_dequantize(self.packed[n0:n1], self.type_name, n1 - n0, self.in_features)

    def _c_reads(self, rows: torch.Tensor) -> bool:
        """Whether the C code serves these float32 CPU rows: up to GEMV_MAX_ROWS through its
        products, more by decoding slabs for BLAS (benchmarks/RESULTS.md, "Quantized weights on
        the CPU")."""
        return (rows.device.type == "cpu" and rows.dtype == torch.float32
                and self.type_name in GEMV_TYPES and cpu_gemv_problem() is None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.type_name}, bias={self.bias is not None}")


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise CheckpointError(f"{path} is a GGUF file; reading it needs the gguf package "
                              "(pip install gguf)") from e
    try:
        return gguf.GGUFReader(path, "c")  # copy-on-write: writable views, the file untouched
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def read_metadata(reader) -> dict:
    """Every key/value of the header as Python values (arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_config_from_gguf(meta: dict, tensor_names: set[str]) -> dict:
    """The HF config.json fields the file's metadata stands for; unread keys refused by name."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not read here; allowed: "
                              f"{', '.join(ARCHITECTURES)}")
    prefix = arch + "."
    ignored = IGNORED_KEYS.get(arch, ())
    arch_keys = ARCH_CONFIG_KEYS.get(arch, {})
    known = (set(CONFIG_KEYS) | set(arch_keys) | set(CHECKED_KEYS) | set(ROPE_SCALING_KEYS)
             | set(ignored) | set(LAYER_PATTERN_KEYS.get(arch, ())))
    unread = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix):] not in known)
    if unread:
        raise CheckpointError(f"GGUF key {unread[0]!r} changes the model and is not read here "
                              f"({len(unread)} such keys)")
    missing = [prefix + k for k in required_keys(arch) if prefix + k not in meta]
    if missing:
        raise CheckpointError(f"the GGUF file lacks {missing[0]!r} ({len(missing)} of the keys a "
                              f"{arch} model needs are missing)")
    hf = {"model_type": ARCHITECTURES[arch][0]}
    for key, field in {**CONFIG_KEYS, **arch_keys}.items():
        if prefix + key in meta and key not in ignored:
            hf[field] = meta[prefix + key]
    hf.update(fields_from_tensors(arch, tensor_names))
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if "vocab_size" not in hf:
        hf["vocab_size"] = len(meta.get("tokenizer.ggml.tokens", []))
    hf["tie_word_embeddings"] = "output.weight" not in tensor_names
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                      ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            hf[name] = meta[key]
    scaling = rope_scaling_from_gguf(meta, prefix)
    if scaling is not None:
        hf["rope_scaling"] = scaling
    head_dim = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if arch in GEMMA_27B:
        hf["query_pre_attn_scalar"] = gemma_query_scale(arch, hf, head_dim)
    if arch == "gemma3":
        hf.update(gemma3_layers(hf))
    if arch in LAYER_PATTERN_KEYS:
        hf.update(window_layers(arch, meta, hf))
    if arch == "olmo2" and hf.get("sliding_window"):
        hf = olmo3_fields(hf)
    hf.update(unset_scales(arch, hf, head_dim))
    checked = CHECKED_KEYS
    if arch in PARTIAL_ROPE_ARCHS:
        hf["partial_rotary_factor"] = meta.get(prefix + "rope.dimension_count", head_dim) / head_dim
        checked = ("attention.value_length",)
    for key in checked:
        if meta.get(prefix + key, head_dim) != head_dim:
            raise CheckpointError(f"GGUF {prefix + key}={meta[prefix + key]} differs from the "
                                  f"head size {head_dim}: partial rotary or unequal q/v heads "
                                  "are not read here")
    return hf


def required_keys(arch: str) -> tuple[str, ...]:
    """The keys (under "<arch>.") llama.cpp will not load the architecture without: the sizes, the
    norm epsilon of its norm (RMSNorm's or LayerNorm's), and the architecture's own."""
    eps = "attention.layer_norm_rms_epsilon"
    if arch in LAYER_NORM_ARCHS:
        eps = "attention.layer_norm_epsilon"
    return (*REQUIRED_KEYS, eps, *ARCH_REQUIRED_KEYS.get(arch, ()))


def fields_from_tensors(arch: str, tensor_names: set[str]) -> dict:
    """The HF fields a file states by which tensors it holds, as llama.cpp reads them: biases and
    q/k norms where they are present (TENSOR_FIELDS), and StableLM's parallel residual in blocks
    without an ffn_norm."""
    table = TENSOR_FIELDS.get(arch, {})
    fields = {field: tensor in tensor_names for field, tensor in table.items()}
    if arch == "stablelm":
        fields["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in tensor_names
    return fields


def unset_scales(arch: str, hf: dict, head_dim: int) -> dict:
    """The multipliers a file leaves out (or writes as 0), as llama.cpp then computes: Granite's
    embedding and residual scales multiply by nothing (1), its attention scale is 1/√head_dim (not
    HF's default 1); Command-R's logits are not scaled (not HF's default 1/16)."""
    defaults = {"granite": {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                            "attention_multiplier": head_dim ** -0.5},
                "command-r": {"logit_scale": 1.0}}
    return {field: value for field, value in defaults.get(arch, {}).items() if not hf.get(field)}


def rope_scaling_from_gguf(meta: dict, prefix: str) -> dict | None:
    """HF's rope_scaling for the file's `rope.scaling.*` keys: linear (positions divided by the
    factor; llama.cpp's type when the key is absent) or none; any other type is refused by name.
    On Gemma 3 it scales the global layers only, as llama.cpp and HF apply it."""
    kind = meta.get(prefix + "rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise CheckpointError(f"GGUF {prefix}rope.scaling.type={kind!r} is not read here; "
                              f"allowed: {', '.join(ROPE_SCALING_TYPES)}")
    factor = float(meta.get(prefix + "rope.scaling.factor", 1.0))
    if kind == "none" or factor in (0.0, 1.0):  # llama.cpp reads a factor of 0 as none too
        return None
    return {"rope_type": "linear", "factor": factor}


def gemma_query_scale(arch: str, hf: dict, head_dim: int) -> int:
    """Gemma's query_pre_attn_scalar, which a GGUF file does not carry: llama.cpp takes the head
    size, except for the 27B models (Gemma 2: 46 blocks, 4608 wide; Gemma 3: 62 blocks, 5376
    wide), whose queries are scaled by hidden size / heads (144 and 168, not their head size
    128), as their HF configs say."""
    if (hf["num_hidden_layers"], hf["hidden_size"]) == GEMMA_27B[arch]:
        return hf["hidden_size"] // hf["num_attention_heads"]
    return head_dim


def gemma3_layers(hf: dict) -> dict:
    """Which Gemma 3 layers slide, as llama.cpp decides: every 6th layer is global, the others
    slide; a file without attention.sliding_window (its converter omits it when no layer slides)
    has global layers only."""
    if hf.get("sliding_window") is None:
        return {"sliding_window": None,
                "layer_types": ["full_attention"] * hf["num_hidden_layers"]}
    return {"sliding_window_pattern": 6}


def window_layers(arch: str, meta: dict, hf: dict) -> dict:
    """EXAONE 4's layer kinds, as llama.cpp reads them: a file with attention.sliding_window says
    in attention.sliding_window_pattern which layers slide (one bool a layer; HF's layer_types, and
    with a window the global layers apply no RoPE); a file without a window has global layers only,
    every one rotating (HF's sliding_window=None, not the config class's default of 4096)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key)
    n_layers = hf["num_hidden_layers"]
    if isinstance(pattern, int) and arch == "olmo2":  # a period: the last layer of each is global
        pattern = [i % pattern < pattern - 1 for i in range(n_layers)]
    if not hf.get("sliding_window"):  # (0: none, as llama.cpp reads it)
        if pattern is not None:
            raise CheckpointError(f"GGUF {key} is set without {arch}.attention.sliding_window")
        if arch == "olmo2":
            return {"sliding_window": None}
        if n_layers == 64:  # llama.cpp then fixes a window of 4096 on 3 of every 4 layers
            raise CheckpointError(f"a 64-block {arch} GGUF file without "
                                  f"{arch}.attention.sliding_window is not read here (llama.cpp "
                                  "gives it the 32B model's window); allowed: a file with one")
        return {"sliding_window": None}
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise CheckpointError(f"GGUF {key}={pattern!r} must list one bool per layer "
                              f"({n_layers}) where the file has a window")
    return {"layer_types": [_layer_kind(slides) for slides in pattern]}


def olmo3_fields(hf: dict) -> dict:
    """OLMo 3, which llama.cpp's converter writes as olmo2 with a window: `hf` as HF's olmo3 config
    with a RoPE per layer type, as llama.cpp applies them — the full-attention layers the file's
    base (and its linear scaling), the sliding layers rope.freq_base_swa where the file has one,
    else the same base, never scaled."""
    full = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    full.update(hf.get("rope_scaling") or {})
    sliding = {"rope_type": "default",
               "rope_theta": hf.get("rope_local_base_freq", full["rope_theta"])}
    kept = {k: v for k, v in hf.items() if k not in OLMO3_MOVED}
    return {**kept, "model_type": "olmo3",
            "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}


def _layer_kind(slides: bool) -> str:
    if slides:
        return "sliding_attention"
    return "full_attention"


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q_proj / k_proj rows: within each head, row 2i + j of the
    file (j = 0, 1) is row i + j·d/2 of HF's layout."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def our_name(gguf_name: str, arch: str) -> str:
    match = BLOCK_TENSOR.fullmatch(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        names = {**BLOCK_NAMES, **ARCH_BLOCK_NAMES.get(arch, {})}
        if names.get(part) is None:
            raise CheckpointError(f"GGUF tensor {gguf_name!r} is not read here")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in TOP_NAMES:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} is not read here")
    return f"{TOP_NAMES[stem]}.{kind}"


def _type_name(tensor) -> str:
    name = tensor.tensor_type.name
    if name not in BLOCK_TYPES:
        raise CheckpointError(f"GGUF tensor {tensor.name!r} is stored as {name}; allowed types: "
                              f"{', '.join(BLOCK_TYPES)}")
    return name


def _heads_for(name: str, hf: dict) -> int | None:
    """How many heads' rows llama.cpp reordered in this tensor, q's and k's weights and biases
    alike (None: not q or k)."""
    module = name.rpartition(".")[0]
    if module.endswith("self_attn.q_proj"):
        return hf["num_attention_heads"]
    if module.endswith("self_attn.k_proj"):
        return hf["num_key_value_heads"]
    return None


def part_rows(part: str, hf: dict) -> int:
    """How many rows `part` (one of FUSED_PARTS' linears) has."""
    head_dim = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if part == "self_attn.q_proj":
        return hf["num_attention_heads"] * head_dim
    if part in ("self_attn.k_proj", "self_attn.v_proj"):
        return hf["num_key_value_heads"] * head_dim
    return hf["intermediate_size"]  # gate_proj, up_proj


def split_fused_rows(name: str, rows: torch.Tensor, hf: dict) -> dict[str, torch.Tensor]:
    """A fused tensor (Phi-3's qkv_proj, gate_up_proj) as its parts, split along the output rows —
    float rows or whole rows of packed blocks alike, since each row is quantized on its own; any
    other tensor as itself."""
    match = LAYER_TENSOR.fullmatch(name)  # model.layers.N, self_attn.qkv_proj, weight
    if match is None or match[2] not in FUSED_PARTS:
        return {name: rows}
    layer, module, kind = match.groups()
    parts = FUSED_PARTS[module]
    sizes = [part_rows(part, hf) for part in parts]
    if sum(sizes) != rows.shape[0]:
        raise CheckpointError(f"GGUF tensor for {name!r} has {rows.shape[0]} rows; the config "
                              f"gives {' + '.join(map(str, sizes))} for {', '.join(parts)}")
    pieces = rows.split(sizes)
    return {f"{layer}.{part}.{kind}": piece for part, piece in zip(parts, pieces)}


def expert_slices(name: str, shape: tuple[int, ...], data: torch.Tensor) -> list[tuple]:
    """[(name, shape, data)]: a stacked tensor of experts [n_expert, rows, cols] as one 2-D entry
    per expert (`mlp.experts.<e>.gate_proj.weight`, ...: moe.py's Expert), float values and packed
    rows alike (`data[e]` is that expert's rows); any other tensor as itself."""
    if len(shape) != 3:
        return [(name, shape, data)]
    head, found, tail = name.partition("mlp.experts.")
    if not found:
        raise CheckpointError(f"GGUF tensor for {name!r} has 3 dimensions {shape}; only stacked "
                              "experts (ffn_*_exps) are read with 3")
    return [(f"{head}mlp.experts.{e}.{tail}", shape[1:], data[e]) for e in range(shape[0])]


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the loader's terms."""

    hf_config: dict  # the config.json fields it stands for
    tensors: dict[str, torch.Tensor]  # float tensors by our names
    modules: dict[str, GGMLLinear]  # packed linears by module name
    tokenizer: object | None  # from tokenizer.ggml.* (None: the file has no vocabulary)


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = _reader(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    hf = hf_config_from_gguf(meta, names)
    arch = meta["general.architecture"]
    permuted = ARCHITECTURES[arch][1]
    floats, packed = {}, {}
    entries = []  # (our name, GGML type, shape, data), stacked experts one entry per expert
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
        name, kind = our_name(tensor.name, arch), _type_name(tensor)
        for entry in expert_slices(name, shape, torch.from_numpy(tensor.data)):
            entries.append((entry[0], kind, entry[1], entry[2]))
    for name, kind, shape, data in entries:
        heads = _heads_for(name, hf) if permuted else None
        if kind in FLOAT_TYPES or not name.endswith(".weight") or "embed_tokens" in name:
            value = dequantize(data, kind, shape)
            if name.endswith("norm.weight"):
                value = value - NORM_OFFSET.get(arch, 0.0)
            value = value if heads is None else unpermute_rotary(value, heads)
            floats.update(split_fused_rows(name, value, hf))
            continue
        rows = data.reshape(shape[0], -1)
        if heads is not None:  # the same reordering, on whole packed rows
            rows = unpermute_rotary(rows, heads)
        for part, piece in split_fused_rows(name, rows, hf).items():
            linear = GGMLLinear(piece, kind, shape[1], piece.shape[0])
            packed[part.removesuffix(".weight")] = linear
    for module, linear in packed.items():  # a bias stays float, beside its packed weight
        bias = floats.pop(module + ".bias", None)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
    return GGUFCheckpoint(hf, floats, packed, gguf_tokenizer(meta))
