"""The load section: which model, in what precision, on which device, and how its forward runs."""

from __future__ import annotations

from dataclasses import dataclass

from .base import EngineArg, arg, check_choice

# quant/online.py: 8-bit linears made as they load
QUANTIZATION_METHODS = ("fp8", "int8", "llm.int8")


@dataclass(frozen=True)
class LoadConfig:
    """Which model, in what precision, on which device, and how its forward runs."""

    # a shipped name (demo), a checkpoint directory, a llama2.c .bin or a hub id
    model: str = "demo"
    dtype: object = None  # "float32", "bfloat16", a torch.dtype; None: the device's default
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: cuda when available
    quantization: str | None = None  # make a float checkpoint's linears 8-bit as they load
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # special-token text in a text prompt stays text (HF's name); default: it becomes the token's id
    split_special_tokens: bool = False
    # a tokenizer (directory or file) used instead of the checkpoint's own (vLLM's --tokenizer)
    tokenizer: str | None = None

    def __post_init__(self):
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS, optional=True)


# its keyword arguments (config/args.py)
LOAD_ARGS: dict[str, EngineArg] = {
    "dtype": arg("load", "dtype", "float32, float16 or bfloat16 (default: float32 on CPU, "
                                  "bfloat16 on CUDA where the GPU has it, else float16)"),
    "device": arg("load", "device", "cpu, cuda or cuda:N (default: cuda when available)"),
    "quantization": arg("load", "quantization", "make a float checkpoint's linears 8-bit as it "
                        "loads: W8A8 fp8 or int8, or LLM.int8", choices=QUANTIZATION_METHODS),
    "enforce_eager": arg("load", "enforce_eager", "no CUDA graphs for decode steps (debugging)"),
    "split_special_tokens": arg("load", "split_special_tokens",
                                "encode special-token text in a prompt ('<|endoftext|>') as "
                                "ordinary text, so that users' prompts cannot write control "
                                "tokens (default: the token's id, as HF and vLLM do)"),
    "tokenizer": arg("load", "tokenizer", "a tokenizer directory or file to use instead of the "
                     "checkpoint's own (e.g. beside a GGUF file)"),
}
