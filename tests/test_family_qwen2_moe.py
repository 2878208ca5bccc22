"""Qwen2-MoE against transformers' Qwen2MoeForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens on two tiny checkpoints that between them set every field
the family implements away from its default; the shared expert's gate dropped as the negative
control; the layer types derived from max_window_layers as Qwen2MoeConfig derives them (and not as
Qwen2's rule would); refusals by name; quantization (RTN, the shared expert included) and tensor
parallelism (refused by name).
"""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from family_oracle import (
    TOL,
    assert_engine_matches_hf,
    assert_every_field_classified,
    assert_logits_match,
    family_checkpoint,
    load,
    logits_delta,
)

from nanoserve.errors import ConfigError, NanoserveError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf
from nanoserve.models.moe import SparseMoeBlock
from nanoserve.models.moe_shared import SharedExpertMoeBlock

# 4 layers: 0 and 2 slide (even, below max_window_layers=3) with a window of 6; layer 1 dense
# (mlp_only_layers); GQA; renormalised top 2 of 6 experts
SPARSE = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=257, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
              shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
              use_sliding_window=True, sliding_window=6, max_window_layers=3,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# 3 layers: experts in layer 1 only (decoder_sparse_step=2); no q/k/v biases; tied head; head_dim
# apart from hidden / heads; linear RoPE scaling; gelu; the odd layer slides by layer_types alone
STEP = dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, head_dim=12, vocab_size=257, max_position_embeddings=256,
            hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            num_experts=4, num_experts_per_tok=3, moe_intermediate_size=20,
            shared_expert_intermediate_size=28, decoder_sparse_step=2, qkv_bias=False,
            use_sliding_window=True, sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("qwen2_moe"),
                             transformers.Qwen2MoeConfig(**SPARSE), seed=7)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("qwen2_moe_step"),
                             transformers.Qwen2MoeConfig(**STEP), seed=8)


def test_logits_and_cached_decode_match_hf(sparse):
    assert_logits_match(*sparse)


def test_engine_greedy_matches_hf(sparse):
    assert_engine_matches_hf(*sparse)


def test_sparse_step_no_bias_tied_head_match_hf(step):
    """decoder_sparse_step, qkv_bias=False, head_dim, linear RoPE, gelu, explicit layer_types."""
    assert_logits_match(*step)
    model, cfg = load(step[0])
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SharedExpertMoeBlock", "LlamaMLP"]
    assert model.model.layers[0].self_attn.q_proj.bias is None
    assert [layer.self_attn.window for layer in model.model.layers] == [None, 5, None]


def test_engine_greedy_matches_hf_with_the_step_checkpoint(step):
    assert_engine_matches_hf(*step, backends=("torch",))


def test_the_layers_are_those_transformers_builds(sparse):
    model, cfg = load(sparse[0])
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SharedExpertMoeBlock", "LlamaMLP", "SharedExpertMoeBlock",
                     "SharedExpertMoeBlock"]
    assert [layer.self_attn.window for layer in model.model.layers] == [6, None, 6, None]
    block = model.model.layers[0].mlp
    assert block.shared_expert.up_proj.out_features == 40 and block.renormalize


def test_dropping_the_shared_expert_gate_misses(sparse):
    """Negative control: the shared expert added unscaled (σ(gate(x)) taken as 1)."""
    path, hf = sparse
    model, cfg = load(path)
    for layer in model.model.layers:
        if isinstance(layer.mlp, SharedExpertMoeBlock):
            layer.mlp.forward = types.MethodType(
                lambda self, x: SparseMoeBlock.forward(self, x) + self.shared_expert(x), layer.mlp)
    assert logits_delta(model, cfg, hf) > TOL


@pytest.mark.parametrize("n_layers, max_window_layers", [(4, 3), (6, 4), (5, 28), (3, 0)])
def test_layer_types_are_derived_as_transformers_derives_them(n_layers, max_window_layers):
    """A config.json without layer_types (as Qwen1.5-MoE's): the even layers below
    max_window_layers slide. Control: Qwen2's rule (from max_window_layers on) differs where it
    can."""
    fields = dict(SPARSE, num_hidden_layers=n_layers, max_window_layers=max_window_layers,
                  mlp_only_layers=[])
    want = transformers.Qwen2MoeConfig(**fields).layer_types
    raw = {**fields, "architectures": ["Qwen2MoeForCausalLM"]}
    cfg = config_from_hf(raw)
    got = [cfg.layer_window(i) is not None for i in range(n_layers)]
    assert got == [t == "sliding_attention" for t in want]
    qwen2_rule = [i >= max_window_layers for i in range(n_layers)]
    if max_window_layers < n_layers:
        assert qwen2_rule != got


def test_transformers_4_rope_spelling_reads_the_same():
    """rope_theta / rope_scaling (transformers 4) read as rope_parameters does; a config without
    architectures is found by its model_type."""
    new = dict(STEP, architectures=["Qwen2MoeForCausalLM"])
    old = {k: v for k, v in STEP.items() if k != "rope_parameters"}
    old.update(model_type="qwen2_moe", rope_theta=10000.0,
               rope_scaling={"type": "linear", "factor": 2.0})
    a, b = config_from_hf(new), config_from_hf(old)
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling)
    assert a.rope_scaling["rope_type"] == "linear"


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("qwen2_moe"))


@pytest.mark.parametrize("change, match", [
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    (dict(use_sliding_window=False), "use_sliding_window=False"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok=7"),
    (dict(hidden_act="gelu_10"), "hidden_act='gelu_10'"),
])
def test_what_it_cannot_compute_is_refused_by_name(change, match):
    raw = {**SPARSE, **change, "architectures": ["Qwen2MoeForCausalLM"],
           "layer_types": transformers.Qwen2MoeConfig(**SPARSE).layer_types}
    with pytest.raises(ConfigError, match=match):
        config_from_hf(raw)


def test_rtn_quantizes_the_shared_expert_and_tensor_parallel_refuses(sparse):
    """RTN reaches every expert's linears and the shared expert's (its gate and the router stay
    float); GPTQ is refused (an expert sees only its routed calibration tokens); tensor
    parallelism refuses mixture-of-experts blocks by name."""
    from nanoserve.parallel.tensor_parallel import tp_unsupported
    from nanoserve.quant.model import QuantizeConfig, quantize_model

    model, cfg = load(sparse[0])
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=8), progress=False)
    names = set(res.qweights)
    assert "model.layers.0.mlp.shared_expert.down_proj" in names
    assert "model.layers.3.mlp.experts.5.gate_proj" in names
    assert "model.layers.1.mlp.gate_proj" in names  # the dense layer
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in names)
    calib = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NanoserveError, match="method='gptq' on a mixture-of-experts model"):
        quantize_model(model, calib, QuantizeConfig(method="gptq", group_size=8), progress=False)
    assert tp_unsupported(cfg, 2) == "mixture-of-experts blocks are not sharded yet"


def test_stacked_expert_tensors_load_too(sparse, tmp_path):
    """A state dict saved with transformers 5's stacked experts (experts.gate_up_proj [E, 2F, C])
    loads to the same logits as save_pretrained's per-expert names."""
    import shutil

    from safetensors.torch import save_file

    path, hf = sparse
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # (an untied head)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    model, cfg = load(tmp_path)
    assert logits_delta(model, cfg, hf) <= TOL


def test_saving_a_qwen2_moe_checkpoint_is_refused_by_name(sparse, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, cfg = load(sparse[0])
    with pytest.raises(ConfigError, match="saving a qwen2_moe checkpoint is not supported"):
        save_checkpoint(model, tmp_path)
