"""Checkpoint loading and saving: HF safetensors directories, hub ids, llama2.c `.bin` files.

`load_model(path)` returns (model, config, tokenizer); the tokenizer is None when the checkpoint
has none (token-id prompts still work). It accepts
- a name of a model shipped inside the package (`demo`, `demo-draft`, see nanoserve/assets),
- an HF directory: `config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`
  (else `pytorch_model.bin` or a sharded `pytorch_model.bin.index.json`),
- an HF hub id (`org/name`) when `huggingface_hub` is installed and the network is there,
- a llama2.c `.bin` file (legacy v0 format, e.g. stories260K) with its tokenizer beside it.
Every way this can go wrong raises a `CheckpointError`/`ConfigError` naming the file, the
tensor or the field. Taught in notebooks/01_*.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import CheckpointError, ConfigError, NanoserveError
from ..extension_points import extension
from ..models import CausalLM, build_model
from ..tokenizers import has_tokenizer, load_tokenizer
from .config import ModelConfig
from .family import family_of
from .fused import fuse, split_fused
from .hf_export import to_hf_config
from .llama2c import read_llama2c
from .moe import MIXTRAL_NAMES, rename

ASSETS = Path(__file__).parents[1] / "assets"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# GPT-2 projections that OpenAI stored as Conv1D, i.e. weight [in, out].
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# Buffers some checkpoints carry that are not weights.
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$)")


# ----------------------------------------------------------------------------- dtype / device
def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> CUDA when available, else CPU. Anything else must be a device torch knows."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise NanoserveError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise NanoserveError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise NanoserveError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> float32 on CPU; on CUDA bfloat16 where the GPU has it (compute capability 8.0+),
    else float16 (a T4 emulates bf16). An explicit bfloat16 on a GPU without it is refused."""
    if dtype is None:
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if _cuda_has_bf16(device) else torch.float16
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise NanoserveError(f"unsupported dtype {dtype}; supported: float32, float16, "
                                 "bfloat16")
        resolved = dtype
    elif dtype not in DTYPES:
        raise NanoserveError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPES)}")
    else:
        resolved = DTYPES[dtype]
    if resolved == torch.bfloat16 and device.type == "cuda" and not _cuda_has_bf16(device):
        name = torch.cuda.get_device_name(device)
        raise NanoserveError(f"dtype bfloat16 is not supported natively by {name} (compute "
                             "capability below 8.0); use float16 or float32")
    return resolved


def _cuda_has_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


# ----------------------------------------------------------------------------- paths
def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A shipped model name, a local path, or a hub id (downloaded) -> a local path."""
    name = str(name_or_path)
    if (ASSETS / name / "config.json").is_file():
        return ASSETS / name
    path = Path(name).expanduser()
    if path.exists():
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        return _download_from_hub(name)
    shipped = sorted(p.name for p in ASSETS.glob("*") if (p / "config.json").is_file())
    raise CheckpointError(
        f"model {name!r} not found: not a local path, a shipped model "
        f"({', '.join(shipped) or 'none'}) or a hub id of the form 'org/name'")


def _download_from_hub(repo_id: str) -> Path:
    try:
        import huggingface_hub
    except ImportError as e:
        raise CheckpointError(
            f"{repo_id!r} is not a local path; downloading it from the hub needs "
            "`pip install nanoserve[hub]` (huggingface_hub)") from e
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        local = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken",
                            "vocab.bpe"])
    except Exception as e:  # offline, unknown repo, gated model: all end the same way for the user
        raise CheckpointError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "are you offline? Pass a local checkpoint directory instead") from e
    return Path(local)


# ----------------------------------------------------------------------------- loading
def load_model(name_or_path, dtype=None, device=None, tokenizer_path=None):
    """Load (model, config, tokenizer) from anything `resolve_model_path` accepts;
    `tokenizer_path`: a tokenizer directory or file used instead of the checkpoint's own (vLLM's
    --tokenizer)."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path = resolve_model_path(name_or_path)
    one_shard = path.is_file() and path.name.startswith("pytorch_model")
    if one_shard and (path.parent / "config.json").is_file():
        raise CheckpointError(f"{path} is one file of an HF checkpoint; pass its directory "
                              f"{path.parent}")
    modules = None  # layers a reader built whole (a GGUF file's packed linears)
    tokenizer = None  # one the checkpoint file holds (GGUF); else read from the folder
    sparsity = None  # a pruned checkpoint's sparsity_config (nanoserve/sparsity/checkpoint.py)
    if path.is_file() and path.suffix == ".bin":
        cfg, tensors = read_llama2c(path)
        tok_dir, quantization = path.parent, None
    elif _is_gguf(path):  # llama.cpp's one-file format, read by the gguf extension
        gguf = extension("gguf").read_gguf(path)
        cfg, tensors, modules = ModelConfig.from_hf(gguf.hf_config), gguf.tensors, gguf.modules
        tok_dir, quantization, tokenizer = path.parent, None, gguf.tokenizer
    elif path.is_dir() and (path / "config.json").is_file():
        cfg = read_hf_config(path / "config.json")
        hf_config = json.loads((path / "config.json").read_text())
        quantization = hf_config.get("quantization_config")
        sparsity = hf_config.get("sparsity_config")
        tensors = read_weights_dir(path)
        tok_dir = path
    else:
        raise CheckpointError(
            f"{path} is not a checkpoint: expected a directory with config.json + "
            "model.safetensors (or pytorch_model.bin), a GGUF file, or a llama2.c .bin file")
    model = build_from_tensors(cfg, tensors, torch_dtype, dev, quantization, modules)
    if sparsity is not None:  # its claimed pattern (2:4) is checked before the model is used
        extension("sparsity").check_sparse_model(model, sparsity)
    # No tokenizer beside the weights is allowed (vLLM's skip_tokenizer_init): prompts are then
    # token ids.
    if tokenizer_path is not None:
        tokenizer, tok_dir = load_tokenizer(tokenizer_path), Path(tokenizer_path)
    elif tokenizer is None and has_tokenizer(tok_dir):
        tokenizer = load_tokenizer(tok_dir)
    check_vocabulary(cfg, tokenizer, tok_dir)
    return model, cfg, tokenizer


def _is_gguf(path: Path) -> bool:
    """A GGUF file starts with the four bytes "GGUF"."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def check_vocabulary(cfg: ModelConfig, tokenizer, where: Path) -> None:
    """The tokenizer's ids must all be rows of the model's embedding. A model may have more rows
    than the tokenizer has ids (vocabularies padded to a multiple of 64 or 128, as Qwen2's); the
    engine then never samples an id the tokenizer cannot decode (LLMEngine.usable_vocab_size)."""
    if tokenizer is None:
        return
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer in {where} has {tokenizer.vocab_size} token ids but the model's "
            f"vocab_size is {cfg.vocab_size}: ids {cfg.vocab_size}..{tokenizer.vocab_size - 1} "
            "have no embedding; is this the model's own tokenizer?")
    for name in ("bos_id", "eos_id"):
        value = getattr(tokenizer, name)
        if value is not None and value >= cfg.vocab_size:
            raise ConfigError(f"the tokenizer's {name}={value} is outside the model's "
                              f"vocab_size={cfg.vocab_size}")


def read_hf_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(raw)


def read_weights_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) checkpoint, by name: safetensors when there, else
    pytorch_model.bin."""
    for stem, read in (("model.safetensors", _read_safetensors),
                       ("pytorch_model.bin", _read_torch_bin)):
        index = path / f"{stem}.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid checkpoint index: {e}") from e
        elif (path / stem).is_file():
            files = [stem]
        else:
            continue
        tensors: dict[str, torch.Tensor] = {}
        for name in files:
            if not (path / name).is_file():
                raise CheckpointError(f"shard {path / name} named in the index is missing")
            tensors.update(read(path / name))
        return tensors
    raise CheckpointError(f"{path} has config.json but no model.safetensors, pytorch_model.bin "
                          "or a .index.json of their shards")


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e


def _read_torch_bin(file: Path) -> dict[str, torch.Tensor]:
    # A .bin is a pickle, and unpickling can run any code: weights_only=True lets through tensors
    # and plain containers only, which is all a state dict holds.
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:
        # truncated zip, not a torch file, or a pickle that holds more than weights
        raise CheckpointError(f"{file} cannot be read as a state dict with "
                              f"torch.load(weights_only=True): {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    return state


def normalize_hf_names(cfg: ModelConfig,
                       tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint names/layouts onto our module names ([out, in] Linear weights)."""
    out = {}
    for key, t in tensors.items():
        if _IGNORED.search(key):
            continue
        if cfg.arch == "gpt2":
            if not key.startswith(("transformer.", "lm_head.")):
                key = "transformer." + key  # saved from GPT2Model rather than GPT2LMHeadModel
            if _CONV1D.search(key) and t.ndim == 2:
                t = t.t()
        if cfg.hf_model_type == "mixtral":
            # block_sparse_moe.experts.i.w1 -> mlp.experts.i.gate_proj, ...
            key = rename(key, MIXTRAL_NAMES)
        out[key] = t
    family = family_of(cfg.hf_model_type)
    if family is not None and family.rename is not None:  # its own names (models/families/)
        return family.rename(cfg, out)
    return split_fused(cfg, out) if cfg.hf_model_type == "phi3" else out


def build_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                       device: torch.device, quantization: dict | None = None,
                       modules: dict[str, nn.Module] | None = None) -> CausalLM:
    """Create the model without random init (on "meta") and copy every weight in, checking shapes.

    With a quantization_config (GPTQ or AWQ checkpoints), the quantized linears become
    QuantLinears holding the packed tensors (nanoserve/quant/load.py). `modules`: linears a reader
    built whole (GGUF's packed ones, models/gguf_file.py), put in place of the model's."""
    tensors = normalize_hf_names(cfg, tensors)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty() allocates each parameter anew, which unties them
    quantized = set()
    if quantization is not None:
        quant = extension("quantization")  # nanoserve/quant/
        layers = quant.quantized_layers(tensors, quantization)
        if "lm_head" in layers and cfg.tie_word_embeddings:
            raise CheckpointError("the LM head is quantized (its lm_head.* tensors) but "
                                  "config.json says tie_word_embeddings: true, which makes the LM "
                                  "head the float embedding matrix; a quantized head needs "
                                  "tie_word_embeddings: false")
        quant.install_quant_linears(model, layers, dtype, device)
        quantized = set(layers)
    for name, module in (modules or {}).items():
        _install_linear(model, name, module, device)
        quantized.add(name)
    expected = {k: v for k, v in model.state_dict().items()
                if k.rpartition(".")[0] not in quantized}
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [k for k in expected if k not in tensors and k not in tied]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} "
                              "missing in all)")
    with torch.no_grad():
        for key, param in expected.items():
            if key in tied and key not in tensors:
                continue
            src = tensors[key]
            if tuple(src.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {key!r} has shape {tuple(src.shape)}, expected {tuple(param.shape)} "
                    "from config.json")
            # (the model's dtype, but for what a module keeps in float32: DeepSeek-V3's router bias)
            param.copy_(src.to(device=device, dtype=param.dtype))
    return model.eval()


def _install_linear(model: nn.Module, name: str, module: nn.Module, device: torch.device) -> None:
    """Put `module` where the model has the linear `name`, after checking it is that layer."""
    try:
        linear = model.get_submodule(name)
    except AttributeError as e:
        raise CheckpointError(f"the checkpoint's layer {name!r} is no layer of this model") from e
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"the checkpoint's layer {name!r} is a linear; the model's is a "
                              f"{type(linear).__name__}")
    if (module.in_features, module.out_features) != (linear.in_features, linear.out_features):
        raise CheckpointError(f"layer {name!r} is [{module.out_features}, {module.in_features}] in "
                              f"the checkpoint, [{linear.out_features}, {linear.in_features}] in "
                              "the model")
    if (module.bias is None) != (linear.bias is None):
        raise CheckpointError(f"layer {name!r}: the model's has a bias and the checkpoint's has "
                              "none, or the other way round")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module.to(device))


# ----------------------------------------------------------------------------- saving
def save_checkpoint(model: CausalLM, directory: str | os.PathLike,
                    replaced: dict[str, dict[str, torch.Tensor]] | None = None,
                    quantization_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in the HF layout (transformers can load it).

    `replaced` maps a module name to the tensors stored for it instead of its own (a quantized
    linear's qweight / qzeros / scales / g_idx / bias: quant/save.py), and
    `quantization_config` goes into config.json with them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.config
    replaced = replaced or {}
    state = {}
    for key, t in model.state_dict().items():
        tied = key == "lm_head.weight" and cfg.tie_word_embeddings
        if tied or key.rpartition(".")[0] in replaced:
            continue
        if cfg.arch == "gpt2" and _CONV1D.search(key):
            t = t.t()
        state[key] = t.detach().to("cpu").contiguous()
    for name, tensors in replaced.items():
        state.update({f"{name}.{k}": v.detach().to("cpu").contiguous() for k, v in tensors.items()})
    if cfg.hf_model_type == "phi3" and not replaced:  # transformers reads Phi-3's fused layout only
        state = fuse(cfg, state)
    if cfg.hf_model_type == "mixtral":
        state = {rename(k, MIXTRAL_NAMES, reverse=True): v for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = to_hf_config(cfg)
    if quantization_config is not None:
        hf["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out
