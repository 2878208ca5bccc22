"""PEFT adapters for the LoRA tests: made by PEFT itself on a copy of a tiny HF model, A and B
random (PEFT's init leaves B = 0, an update that changes nothing), saved with `save_pretrained`."""

from __future__ import annotations

import copy

import torch

TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama-gqa": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def make_peft_adapter(hf, out_dir, targets, seed=0, **config):
    """A PEFT LoRA adapter on a copy of `hf`, A and B random; returns (the PEFT model, its
    directory)."""
    import peft

    config = {"r": 4, "lora_alpha": 8, "target_modules": targets, **config}
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir)
    return model, out_dir


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `ids` from an HF (or PEFT) model."""
    x = torch.tensor([ids])
    out = model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist()
