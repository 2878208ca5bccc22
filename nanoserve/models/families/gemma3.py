"""Gemma 3 as Google ships it (Gemma3ForConditionalGeneration): its language model, read as the
text-only Gemma 3 that hf_config already runs (model_type "gemma3_text"), the images left out.

The released checkpoints are multimodal: a SigLIP vision tower and a projector that turn an image
into soft tokens, and the Gemma 3 language model that reads them among the text. On text alone the
HF model computes exactly its language model: the image-token mask is empty, so every query sees the
causal (or sliding) window of Gemma3ForCausalLM. So
- config: the text model's config is nested under `text_config` and read by hf_config as a
  "gemma3_text" config (its field table, its defaults, its sliding layers and two RoPE bases); the
  top level adds the image-token ids (inert without images) and `tie_word_embeddings`, which
  transformers 5 reads from the top level. One difference from the text-only class: the
  multimodal class's LM head never applies `text_config.final_logit_softcapping` (released
  configs set it to null, where the two agree), so nanoserve does not either;
- weights: the language model's tensors sit under a prefix, `language_model.model.*` and
  `language_model.lm_head.*` in the files transformers 4.50 wrote (and transformers 5 still writes),
  `model.language_model.*` and `lm_head.*` in transformers 5's own module names; both are renamed
  onto Llama's names. The vision tower's and the projector's tensors are dropped, with a log line.
Image inputs are not accepted: a prompt is token ids, and an image placeholder id is embedded as the
ordinary token it is. Saving is refused (the dropped vision weights could not be written back).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ...errors import ConfigError
from ..config import ModelConfig
from ..family import Family
from ..hf_config import config_from_hf
from ..hf_fields import COMMON, implemented, inert
from ..llama import LlamaForCausalLM

logger = logging.getLogger("nanoserve")

# checkpoint prefix -> the model's, for the language model's tensors (transformers 4.50's first)
LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
# the image path's tensors, in either layout: not read
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def gemma3_config(cfg: dict[str, Any]) -> ModelConfig:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"gemma3 config field text_config={text!r} is not supported; "
                          "supported: the language model's config as a dictionary")
    tied = cfg["tie_word_embeddings"]
    text_tied = text.get("tie_word_embeddings", tied)
    if text_tied != tied:
        raise ConfigError(f"gemma3 config field text_config.tie_word_embeddings={text_tied!r} "
                          f"disagrees with tie_word_embeddings={tied!r} (transformers 4 read the "
                          "first, transformers 5 reads the second); supported: both the same")
    # the language model's config, read and checked field by field as a Gemma3ForCausalLM's
    language = config_from_hf({**text, "architectures": ["Gemma3ForCausalLM"],
                               "model_type": "gemma3_text", "tie_word_embeddings": tied})
    ids = {}
    if cfg.get("eos_token_id") is not None:  # the released configs list the end-of-turn id here
        eos = cfg["eos_token_id"]
        ids["eos_token_ids"] = [int(i) for i in eos] if isinstance(eos, list) else [int(eos)]
    if cfg.get("bos_token_id") is not None:
        ids["bos_token_id"] = int(cfg["bos_token_id"])
    # Gemma3ForConditionalGeneration's head never soft-caps (Gemma3ForCausalLM's does)
    return replace(language, hf_model_type="gemma3", final_softcap=None, **ids)


def language_model_tensors(cfg: ModelConfig,
                           tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under Llama's names; the vision tower and projector dropped."""
    out = {}
    dropped = 0
    for key, t in tensors.items():
        if key.startswith(VISION_PREFIXES):
            dropped += 1
            continue
        out[rename_language_model(key)] = t
    if dropped:
        logger.info("gemma3: loading the language model only; %d tensors of the vision tower and "
                    "the multimodal projector are not read (text-only inputs)", dropped)
    return out


def rename_language_model(key: str) -> str:
    for prefix, ours in LANGUAGE_MODEL_PREFIXES:
        if key.startswith(prefix):
            return ours + key[len(prefix):]
    return key


_IMAGES = "the image path, which nanoserve does not run (text-only inputs)"

GEMMA3_FIELDS = {
    **COMMON,
    "text_config": implemented("the language model's config, read as a gemma3_text config (its "
                               "own field table), but for final_logit_softcapping, which this "
                               "class's head never applies"),
    "tie_word_embeddings": implemented("the LM head is the token embedding matrix (transformers 5 "
                                       "reads it here, not in text_config)"),
    "vision_config": inert(f"the vision tower's config: {_IMAGES}"),
    "mm_tokens_per_image": inert(f"soft tokens per image: {_IMAGES}"),
    "boi_token_index": inert(f"the begin-of-image id: {_IMAGES}"),
    "eoi_token_index": inert(f"the end-of-image id: {_IMAGES}"),
    "image_token_index": inert(f"the image placeholder id: {_IMAGES}"),
}

FAMILY = Family(
    model_type="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    hf_config_class="Gemma3Config",
    fields=GEMMA3_FIELDS,
    config=gemma3_config,
    model_class=LlamaForCausalLM,
    defaults=dict(tie_word_embeddings=True),
    rename=language_model_tensors,
    name="Gemma 3 as released (4B, 12B, 27B)",
    summary="the multimodal checkpoint's language model, on text; the vision tower's and the "
            "projector's weights are not read",
)
