"""Mixture of experts (nanoserve/models/moe.py): the grouped form against the per-token loop, the
router against transformers' own, and MoE models through the engine.

Oracles: the per-token reference loop (the formula as written), transformers' MixtralSparseMoeBlock
and Qwen3MoeSparseMoeBlock given the same weights, and HF generate (test_models_parity runs the
`mixtral` and `qwen3-moe` checkpoints). Negative controls: renormalising where Qwen3-MoE does not,
and routing each token to its k *lowest* experts, both miss.
"""

from __future__ import annotations

import pytest
import torch
from testdata import hf_moe_block_like

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import ACTIVATION_FNS
from nanoserve.models.moe import SparseMoeBlock, moe_reference


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=10, hidden_size=32, n_layers=1, n_heads=4,
                       n_kv_heads=4,
                       intermediate_size=48, max_position_embeddings=64,
                       **{"num_experts": 6, "num_experts_per_tok": 2,
                                                                            **kw})


def _block(seed=0, **kw) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(_cfg(**kw), ACTIVATION_FNS["silu"])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_by_expert_equals_the_per_token_loop(top_k, renormalize):
    block = _block(num_experts_per_tok=top_k, norm_topk_prob=renormalize)
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        assert torch.allclose(block(x), moe_reference(block, x), atol=1e-5, rtol=0)


def test_experts_nobody_chose_are_skipped_and_counted():
    """A router that sends every token to experts 0 and 1: the others never run (and the sum is
    unchanged)."""
    block = _block()
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:2] = 5.0  # experts 0 and 1 win for inputs with a positive sum
        x = torch.rand(2, 5, 32)
        calls = []
        hooks = [e.register_forward_hook(lambda m, a, o,
                                         i=i: calls.append(i)) for i, e in enumerate(block.experts)]
        out = block(x)
        for h in hooks:
            h.remove()
        assert sorted(calls) == [0, 1]
        assert torch.allclose(out, moe_reference(block, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_and_experts_match_transformers_block(family):
    """Our block given the weights of transformers' sparse MoE block computes what it computes."""
    # Mixtral always renormalises; this Qwen3-MoE does not
    ours = _block(norm_topk_prob=family == "mixtral")
    hf = hf_moe_block_like(ours, family)
    with torch.no_grad():
        x = torch.randn(2, 9, 32)
        want = hf(x)
        assert torch.allclose(ours(x), want, atol=1e-5, rtol=0)
        ours.renormalize = not ours.renormalize  # negative control: the other family's rule
        assert (ours(x) - want).abs().max() > 1e-3
        ours.renormalize = not ours.renormalize
        lowest = lambda x: (lambda w, e: (w, e))(
            *ours.gate(x).float().softmax(-1).topk(2, largest=False)
        )
        ours.route = lambda x: tuple(
            t.to(x.dtype) if t.is_floating_point() else t for t in lowest(x)
        )
        assert (ours(x) - want).abs().max() > 1e-3  # negative control: the wrong experts


def test_moe_models_run_through_the_engine_and_quantize_with_rtn_only(hf_checkpoints, tmp_path):
    """Continuous batching and prefix caching on Qwen3-MoE; RTN int4 experts reload to the same
    logits; GPTQ and AWQ are refused by name (an expert sees only the calibration tokens routed to
    it)."""
    from nanoserve.models.loader import load_model
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import replace_linears, save_quantized

    path = hf_checkpoints["qwen3-moe"][0]
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4)
    prompts = [[3, 17, 42, 5, 99, 7], [3, 17, 42, 5, 8], list(range(30, 50))]
    batched = [
        o.outputs[0].token_ids
        for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
    ]
    alone = [llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    calib = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for method in ("gptq", "awq"):
        with pytest.raises(NanoserveError,
                           match=f"method='{method}' on a mixture-of-experts model"):
            quantize_model(model, calib, QuantizeConfig(method=method, group_size=16),
                           progress=False)
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=16), progress=False)
    assert any(".mlp.experts.5.down_proj" in k for k in res.qweights) and not any(
        ".mlp.gate" == k[-9:] for k in res.qweights
    )
    out = save_quantized(model, res, tmp_path / "q", tokenizer_from=path)
    reloaded, _, _ = load_model(out, dtype="float32", device="cpu")
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x), replace_linears(model, res.qweights)(x))
