"""Shared experts and grouped routing (nanoserve/models/moe_shared.py) against transformers' own
blocks: Qwen2MoeSparseMoeBlock, DeepseekV2Moe (greedy, group_limited_greedy) and DeepseekV3MoE
(noaux_tc), each given random weights that are then read into nanoserve's block through
moe.split_stacked_experts (transformers 5 stacks the experts).

Negative controls, each moving the output past the tolerance: the shared expert's sigmoid gate
dropped (Qwen2-MoE), the correction bias added into the weights as well as the selection (V3), the
group limit ignored (V2's group_limited_greedy and V3's noaux_tc).
"""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
import transformers

from nanoserve.errors import CheckpointError, ConfigError
from nanoserve.models.config import ModelConfig
from nanoserve.models.moe import SparseMoeBlock, split_stacked_experts
from nanoserve.models.moe_shared import DeepseekMoE, DeepseekRouting, SharedExpertMoeBlock

C, F, E, K = 32, 16, 8, 3  # hidden, expert width, experts, top k
SHARED = 40  # Qwen2-MoE's shared expert width
TOL = 1e-5


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=10, hidden_size=C, n_layers=1, n_heads=4,
                       n_kv_heads=4, intermediate_size=48, max_position_embeddings=64,
                       num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F, **kw)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter N(0, 0.3) and the correction bias N(0, 0.2) (HF's init leaves it at 0)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)


def _load_from_hf(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    state = split_stacked_experts(dict(hf.state_dict()), C, F)
    ours.load_state_dict(state, strict=True)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 13, C, generator=torch.Generator().manual_seed(seed))


def _qwen2(norm_topk_prob: bool):
    cfg = transformers.Qwen2MoeConfig(hidden_size=C, moe_intermediate_size=F, num_experts=E,
                                      num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                                      shared_expert_intermediate_size=SHARED)
    hf = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomise(hf, seed=3)
    ours = SharedExpertMoeBlock(_cfg(norm_topk_prob=norm_topk_prob), SHARED)
    _load_from_hf(ours, hf)
    return ours, hf


def _deepseek(version: int, method: str, n_group: int = 4, topk_group: int = 2,
              norm_topk_prob: bool = False, scale: float = 2.5, n_shared: int = 2,
              mlp_bias: bool = False):
    kw = dict(hidden_size=C, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
              n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
              n_shared_experts=n_shared, norm_topk_prob=norm_topk_prob)
    if version == 2:
        config = transformers.DeepseekV2Config(topk_method=method, mlp_bias=mlp_bias, **kw)
        hf = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(config)
    else:
        config = transformers.DeepseekV3Config(**kw)
        hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
    hf.eval()
    _randomise(hf, seed=4)
    routing = DeepseekRouting(n_shared_experts=n_shared, topk_method=method, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=scale)
    # transformers' V2 router never renormalises, whatever norm_topk_prob says
    ours = DeepseekMoE(_cfg(norm_topk_prob=norm_topk_prob and version == 3, mlp_bias=mlp_bias),
                       routing)
    _load_from_hf(ours, hf)
    return ours, hf


def _max_delta(ours, hf, x) -> float:
    with torch.no_grad():
        return (ours(x) - hf(x)).abs().max().item()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_block_matches_transformers(norm_topk_prob):
    ours, hf = _qwen2(norm_topk_prob)
    assert _max_delta(ours, hf, _x()) <= TOL


def test_qwen2_moe_without_the_shared_gate_misses():
    """Negative control: the shared expert added unscaled (as DeepSeek adds its own)."""
    ours, hf = _qwen2(False)
    ours.forward = types.MethodType(
        lambda self, x: SparseMoeBlock.forward(self, x) + self.shared_expert(x), ours)
    assert _max_delta(ours, hf, _x()) > 1e-3


@pytest.mark.parametrize("version, method, norm_topk_prob", [
    (2, "greedy", False), (2, "group_limited_greedy", False),
    (3, "noaux_tc", True), (3, "noaux_tc", False)])
def test_deepseek_block_matches_transformers(version, method, norm_topk_prob):
    ours, hf = _deepseek(version, method, norm_topk_prob=norm_topk_prob)
    assert _max_delta(ours, hf, _x()) <= TOL


def test_deepseek_v2_shared_experts_take_mlp_bias():
    """DeepSeek-V2's shared experts are its MLP class, biased with mlp_bias (the routed ones never
    are)."""
    ours, hf = _deepseek(2, "greedy", mlp_bias=True)
    assert ours.shared_experts.down_proj.bias is not None
    assert _max_delta(ours, hf, _x()) <= TOL


def test_deepseek_v3_one_group_is_plain_top_k_of_the_corrected_scores():
    """n_group = topk_group = 1 (DeepSeek-V3-style routers without groups): still transformers'."""
    ours, hf = _deepseek(3, "noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, n_shared=1)
    assert _max_delta(ours, hf, _x()) <= TOL


def test_deepseek_v3_correction_bias_in_the_weights_misses():
    """Negative control: weights gathered from s + b (the selection's scores) instead of s."""
    ours, hf = _deepseek(3, "noaux_tc", norm_topk_prob=True)

    def route_with_bias_in_weights(self, x):
        _, experts = DeepseekMoE.route(self, x)  # the right experts
        scores = torch.sigmoid(x.float() @ self.gate.weight.float().T)  # N, E
        corrected = (scores + self.gate.e_score_correction_bias).gather(1, experts)  # N, k
        weights = corrected / corrected.sum(dim=-1, keepdim=True)
        return weights * self.routing.routed_scaling_factor, experts

    ours.route = types.MethodType(route_with_bias_in_weights, ours)
    assert _max_delta(ours, hf, _x()) > 1e-3


@pytest.mark.parametrize("version, method", [(2, "group_limited_greedy"), (3, "noaux_tc")])
def test_ignoring_the_group_limit_misses(version, method):
    """Negative control: every group kept (topk_group = n_group) while transformers keeps 2 of 4."""
    ours, hf = _deepseek(version, method, norm_topk_prob=version == 3)
    x = _x()
    assert _max_delta(ours, hf, x) <= TOL
    ours.routing = replace(ours.routing, topk_group=ours.routing.n_group)
    assert _max_delta(ours, hf, x) > 1e-3


def test_deepseek_v3_without_the_correction_bias_misses():
    """Negative control: selection by s alone (the bias ignored) picks other experts."""
    ours, hf = _deepseek(3, "noaux_tc", norm_topk_prob=True)
    with torch.no_grad():
        ours.gate.e_score_correction_bias.zero_()
    assert _max_delta(ours, hf, _x()) > 1e-3


@pytest.mark.parametrize("kw, match", [
    (dict(topk_method="noaux"), "topk_method='noaux'"),
    (dict(n_group=0), "n_group=0"),
    (dict(n_shared_experts=0), "n_shared_experts=0"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
    (dict(n_group=2, topk_group=3), "topk_group=3"),
])
def test_bad_routing_is_refused_by_name(kw, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekRouting(**kw)


@pytest.mark.parametrize("routing, match", [
    (DeepseekRouting(topk_method="group_limited_greedy", n_group=3), "n_group=3"),
    (DeepseekRouting(topk_method="noaux_tc", n_group=8, topk_group=2), "n_group=8"),
    (DeepseekRouting(topk_method="group_limited_greedy", n_group=4, topk_group=1),
     "num_experts_per_tok=3"),
])
def test_routing_that_does_not_fit_the_experts_is_refused_by_name(routing, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekMoE(_cfg(), routing)


def test_split_stacked_experts_refuses_another_layout_by_name():
    """[E, C, 2F] (gate_up transposed, as some other models store it) is not read as [E, 2F, C]."""
    width = 24
    stacked = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, C, 2 * width)}
    with pytest.raises(CheckpointError, match=r"experts.gate_up_proj' has shape \(8, 32, 48\)"):
        split_stacked_experts(stacked, C, width)


def test_the_correction_bias_stays_float32_in_a_16_bit_model():
    """transformers keeps e_score_correction_bias in float32 whatever the model's dtype; so does
    CorrectedRouter (a bf16 bias of ~1 keeps 3 digits, and near-tied experts would swap). The
    control: a plain buffer beside it becomes bf16."""
    from nanoserve.models.moe_shared import CorrectedRouter

    router = CorrectedRouter(8, 4)
    router.register_buffer("plain", torch.zeros(4))
    router.e_score_correction_bias.copy_(torch.tensor([1.0001, 1.0002, 1.0003, 1.0004]))
    router = router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.plain.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert router.e_score_correction_bias.unique().numel() == 4
