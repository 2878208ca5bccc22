"""Model families: GPT-2 and Llama-class. `build_model(cfg)` picks the class for a config."""

from .base import CausalLM
from .config import ModelConfig
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM

MODEL_CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}


def build_model(cfg: ModelConfig) -> CausalLM:
    """An uninitialised model of the config's family (the loader fills in the weights)."""
    from .family import family_of

    family = family_of(cfg.hf_model_type)
    if family is not None:  # a family of its own module (models/families/)
        return family.model_class(cfg)
    return MODEL_CLASSES[cfg.arch](cfg)


__all__ = ["CausalLM", "GPT2LMHeadModel", "LlamaForCausalLM", "build_model", "MODEL_CLASSES"]
