"""Whether a family's text prompts start with BOS: as its HF tokenizer does (Cohere's and DeepSeek's
add one; GPT-NeoX's, Phi's, StarCoder2's, StableLM's and gpt-oss's do not). Own-layout families say
so in `ModelConfig.bos_in_prompts`; the Llama layout's default is to add one."""

from __future__ import annotations

import pytest
import transformers

from nanoserve.models.hf_config import config_from_hf

SMALL = dict(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=4)
CASES = [("CohereConfig", "CohereForCausalLM", {}, True),
         ("DeepseekV3Config", "DeepseekV3ForCausalLM",
          dict(first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=8, q_lora_rank=None), True),
         ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, False),
         ("PhiConfig", "PhiForCausalLM", {}, False),
         ("Starcoder2Config", "Starcoder2ForCausalLM", {}, False),
         ("GraniteConfig", "GraniteForCausalLM", {}, True),
         ("GPT2Config", "GPT2LMHeadModel", {}, False)]


@pytest.mark.parametrize("config_class,arch,extra,adds_bos", CASES)
def test_text_prompts_start_with_bos_as_the_family_tokenizer_does(config_class, arch, extra,
                                                                   adds_bos):
    fields = {} if config_class == "GPT2Config" else dict(SMALL, **extra)
    hf = getattr(transformers, config_class)(**fields).to_dict()
    hf["architectures"] = [arch]
    assert config_from_hf(hf).adds_bos is adds_bos
