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

Families: llama (and Mistral, which llama.cpp writes as llama), qwen2, qwen3, gemma2 (its norms
stored as 1 + w, its query scale inferred as llama.cpp does: `gemma2_query_scale`). On the CPU,
`GGMLLinear` multiplies a few rows by the packed blocks in place (kernels/cpu_packed_gemv.c); on a
GPU, Q8_0, Q4_K and Q6_K blocks are dequantized in registers by a Triton kernel
(kernels/ggml_matmul.py), other types dequantized whole, then multiplied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..kernels.cpu_packed_gemv import KINDS as GEMV_TYPES
from ..kernels.cpu_packed_gemv import cpu_gemv_problem, ggml_gemv
from ..quant.ggml_blocks import BLOCK_TYPES, dequantize
from ..tokenizers.gguf_vocab import gguf_tokenizer

# GGUF architecture → (HF model_type, whether llama.cpp permuted q and k)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
                 "gemma2": ("gemma2", False)}
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
}
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count", "attention.layer_norm_rms_epsilon")
# keys read for a check only: they must agree with the others
CHECKED_KEYS = ("rope.dimension_count", "attention.value_length")
FLOAT_TYPES = ("F32", "F16", "BF16")
# blk.N.<GGUF name> → model.layers.N.<our name>
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# where an architecture names a block's norms otherwise (Gemma 2: four norms a block)
ARCH_BLOCK_NAMES = {"gemma2": {"ffn_norm": "pre_feedforward_layernorm",
                               "post_attention_norm": "post_attention_layernorm",
                               "post_ffw_norm": "post_feedforward_layernorm"}}
# llama.cpp stores Gemma's norm weights as 1 + w (what they multiply by); our model holds w, as HF
NORM_OFFSET = {"gemma2": 1.0}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
GEMV_MAX_ROWS = 64  # activation rows up to which the C kernel beats dequantize + GEMM


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

    def weight_float(self) -> torch.Tensor:
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
        if self._packed_kernel_serves(rows):  # read the blocks in place (kernels/cpu_packed_gemv.c)
            y = ggml_gemv(rows, self.packed, self.type_name, self.out_features)
            y = y if bias is None else y + bias
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight_float().to(x.dtype), bias)

    def _packed_kernel_serves(self, rows: torch.Tensor) -> bool:
        """The C kernel for up to GEMV_MAX_ROWS float32 rows on the CPU (decode steps); more rows
        (a prefill) are faster through one dequantization and a BLAS GEMM that blocks for
        registers (benchmarks/RESULTS.md, "GGUF weights on the CPU")."""
        return (rows.device.type == "cpu" and rows.dtype == torch.float32
                and rows.shape[0] <= GEMV_MAX_ROWS and self.type_name in GEMV_TYPES
                and cpu_gemv_problem() is None)

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
    known = set(CONFIG_KEYS) | set(CHECKED_KEYS)
    unread = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix):] not in known)
    if unread:
        raise CheckpointError(f"GGUF key {unread[0]!r} changes the model and is not read here "
                              f"({len(unread)} such keys)")
    missing = [prefix + k for k in REQUIRED_KEYS if prefix + k not in meta]
    if missing:
        raise CheckpointError(f"the GGUF file lacks {missing[0]!r} ({len(missing)} of the keys a "
                              f"{arch} model needs are missing)")
    hf = {"model_type": ARCHITECTURES[arch][0]}
    for key, field in CONFIG_KEYS.items():
        if prefix + key in meta:
            hf[field] = meta[prefix + key]
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if "vocab_size" not in hf:
        hf["vocab_size"] = len(meta.get("tokenizer.ggml.tokens", []))
    hf["tie_word_embeddings"] = "output.weight" not in tensor_names
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                      ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            hf[name] = meta[key]
    head_dim = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if arch == "gemma2":
        hf["query_pre_attn_scalar"] = gemma2_query_scale(hf, head_dim)
    for key in CHECKED_KEYS:
        if meta.get(prefix + key, head_dim) != head_dim:
            raise CheckpointError(f"GGUF {prefix + key}={meta[prefix + key]} differs from the "
                                  f"head size {head_dim}: partial rotary or unequal q/v heads "
                                  "are not read here")
    return hf


def gemma2_query_scale(hf: dict, head_dim: int) -> int:
    """Gemma 2's query_pre_attn_scalar, which a GGUF file does not carry: llama.cpp takes the head
    size, except for the 27B model (46 blocks, 4608 wide), whose queries are scaled by hidden size /
    heads (144, not its head size 128), as its HF config says."""
    if (hf["num_hidden_layers"], hf["hidden_size"]) == (46, 4608):
        return hf["hidden_size"] // hf["num_attention_heads"]
    return head_dim


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
        if part not in names:
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
    """How many heads' rows llama.cpp reordered in this tensor (None: not q or k)."""
    if name.endswith("self_attn.q_proj.weight"):
        return hf["num_attention_heads"]
    if name.endswith("self_attn.k_proj.weight"):
        return hf["num_key_value_heads"]
    return None


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
    for tensor in reader.tensors:
        name, kind = our_name(tensor.name, arch), _type_name(tensor)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first
        data = torch.from_numpy(tensor.data)
        heads = _heads_for(name, hf) if permuted else None
        if kind in FLOAT_TYPES or not name.endswith(".weight") or "embed_tokens" in name:
            value = dequantize(data, kind, shape)
            if name.endswith("norm.weight"):
                value = value - NORM_OFFSET.get(arch, 0.0)
            floats[name] = value if heads is None else unpermute_rotary(value, heads)
            continue
        rows = data.reshape(shape[0], -1)
        if heads is not None:  # the same reordering, on whole packed rows
            rows = unpermute_rotary(rows, heads)
        packed[name.removesuffix(".weight")] = GGMLLinear(rows, kind, shape[1], shape[0])
    for module, linear in packed.items():  # a bias stays float, beside its packed weight
        bias = floats.pop(module + ".bias", None)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
    return GGUFCheckpoint(hf, floats, packed, gguf_tokenizer(meta))
