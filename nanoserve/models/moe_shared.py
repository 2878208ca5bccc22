"""Mixture of experts with shared experts and grouped routing: the blocks of Qwen2-MoE and of
DeepSeek-V2 / V3 (DeepSeekMoE, Dai et al. 2024), built on moe.py's routed experts.

Both keep moe.py's E routed experts, each token running its top k, and add *shared* experts that
every token runs: knowledge all tokens need then lives once, in the shared expert, instead of being
learnt again by every routed one.

**Qwen2-MoE** (Qwen1.5-MoE, Qwen2-57B-A14B): moe.py's router as it is (softmax, top-k, renormalised
only with norm_topk_prob) plus one shared expert, a gated MLP of width
shared_expert_intermediate_size, whose output each token scales by a gate of its own:

    y = Σ_j w_j · expert_{e_j}(x) + σ(x · g) · shared_expert(x)      # g [C]: shared_expert_gate

**DeepSeek-V2 / V3**: n_shared_experts shared experts, held as one gated MLP of width
moe_intermediate_size · n_shared_experts (the sum of several MLPs is one wider MLP), always added,
unscaled; the routed experts are chosen by one of three `topk_method`s:

    greedy                 (V2)  s = softmax(x · Wᵣᵀ); the top k of s; w = s there
    group_limited_greedy   (V2)  s = softmax; the E experts in n_group groups of E / n_group, a
                                 group's score its best s; only the experts of the topk_group best
                                 groups compete for the top k; w = s there
    noaux_tc               (V3)  s = sigmoid(x · Wᵣᵀ); c = s + b, with b the per-expert
                                 e_score_correction_bias that training nudges to balance the load
                                 without an auxiliary loss; a group's score the sum of its two best
                                 c; the top k of c in the topk_group best groups; w = s there (b
                                 picks experts, it never weighs them)
    then                         w /= Σ w (with norm_topk_prob; V3 adds 1e-20 to Σ w),
                                 w *= routed_scaling_factor

The router's product and scores are computed in float32, as transformers does.

What the DeepSeek block needs: `DeepseekMoE(cfg, routing)` with a ModelConfig giving hidden_size,
num_experts (n_routed_experts), num_experts_per_tok, moe_intermediate_size, hidden_act,
norm_topk_prob and mlp_bias (the shared experts' biases, DeepSeek-V2's mlp_bias), and a
`DeepseekRouting` giving n_shared_experts, topk_method, n_group, topk_group and
routed_scaling_factor. transformers' DeepSeek-V2 router never renormalises, whatever
norm_topk_prob says: a V2 reader passes norm_topk_prob=False. transformers keeps
e_score_correction_bias in float32 whatever the model's dtype; here it takes the model's dtype like
every other tensor (bf16 rounds it: the selection can differ from transformers' on near-ties).

Module names are the checkpoints' (Qwen2-MoE: mlp.gate, mlp.experts.N.{gate,up,down}_proj,
mlp.shared_expert.*, mlp.shared_expert_gate; DeepSeek: mlp.gate, mlp.gate.e_score_correction_bias,
mlp.experts.N.*, mlp.shared_experts.*); moe.split_stacked_experts reads transformers 5's stacked
expert tensors onto them. tests/test_moe_shared.py holds both against transformers' own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .config import ModelConfig
from .layers import ACTIVATION_FNS
from .moe import Expert, SparseMoeBlock

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's block: moe.py's routed experts plus a shared expert of width `shared_width`
    (HF: shared_expert_intermediate_size), gated per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, shared_width: int):
        act = ACTIVATION_FNS[cfg.hidden_act]
        super().__init__(cfg, act)
        self.shared_expert = Expert(cfg, act, width=shared_width)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # ..., C
        gate = torch.sigmoid(self.shared_expert_gate(x))  # ..., 1
        return routed + gate * self.shared_expert(x)


@dataclass(frozen=True)
class DeepseekRouting:
    """How DeepSeek-V2 / V3 route (HF DeepseekV2Config / DeepseekV3Config field names)."""

    n_shared_experts: int = 1
    topk_method: str = "greedy"  # one of TOPK_METHODS; noaux_tc: sigmoid scores and a correction
    n_group: int = 1  # the experts split into this many equal groups
    topk_group: int = 1  # groups kept per token (group_limited_greedy, noaux_tc)
    routed_scaling_factor: float = 1.0  # the routed experts' weights × this

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ConfigError(f"deepseek config field topk_method={self.topk_method!r} is not "
                              f"supported; supported: {', '.join(TOPK_METHODS)}")
        for name in ("n_shared_experts", "n_group", "topk_group"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"deepseek config field {name}={value!r} must be an integer "
                                  "≥ 1")
        scale = self.routed_scaling_factor
        if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ConfigError(f"deepseek config field routed_scaling_factor={scale!r} must be a "
                              "positive finite number")
        if self.topk_group > self.n_group:
            raise ConfigError(f"deepseek config field topk_group={self.topk_group} must lie in "
                              f"1..n_group={self.n_group}")

    def check(self, num_experts: int, top_k: int) -> None:
        """Refuse, by name, groups that do not split `num_experts` evenly, groups too small for
        noaux_tc's two best, and a top k larger than the experts the kept groups hold."""
        if num_experts % self.n_group:
            raise ConfigError(f"deepseek config field n_group={self.n_group} does not divide "
                              f"n_routed_experts={num_experts}")
        group_size = num_experts // self.n_group
        if self.topk_method == "noaux_tc" and group_size < 2:
            raise ConfigError(f"deepseek config: noaux_tc scores each group by its two best "
                              f"experts, but n_group={self.n_group} leaves {group_size} per group "
                              f"of n_routed_experts={num_experts}")
        kept = num_experts
        if self.topk_method != "greedy":
            kept = self.topk_group * group_size
        if top_k > kept:
            raise ConfigError(f"deepseek config field num_experts_per_tok={top_k} exceeds the "
                              f"{kept} experts of the topk_group={self.topk_group} groups kept")


class CorrectedRouter(nn.Linear):
    """DeepSeek-V3's router: the linear x · Wᵣᵀ and the per-expert bias b its selection adds (HF's
    gate.e_score_correction_bias, a buffer that the checkpoint holds)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def _apply(self, fn, recurse=True):
        """`.to(bf16)` and the like move the bias but keep it in float32, as transformers does:
        in 16 bits a bias of ~1 keeps 3 significant digits, and near-tied experts swap."""
        kept = self.e_score_correction_bias.float()
        super()._apply(fn, recurse)
        device = self.e_score_correction_bias.device
        if kept.is_meta or device.type == "meta":  # built on "meta", then given memory (to_empty)
            self.e_score_correction_bias = torch.empty(kept.shape, device=device)
        else:
            self.e_score_correction_bias = kept.to(device)
        return self


def group_mask(choice: torch.Tensor, n_group: int, topk_group: int, by: str) -> torch.Tensor:
    """[N, E] True where an expert's group is among each token's `topk_group` best of `n_group`,
    a group scored by its best choice score (by="max": V2) or its two best summed ("top2": V3)."""
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)  # N, G, E/G
    if by == "max":
        group_scores = grouped.max(dim=-1).values  # N, G
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # N, G
    kept = group_scores.topk(topk_group, dim=-1).indices  # N, topk_group
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # N, G
    return mask.repeat_interleave(E // n_group, dim=1)  # N, E


class DeepseekMoE(SparseMoeBlock):
    """DeepSeek-V2 / V3's block: routed experts chosen by `routing.topk_method`, plus the shared
    experts (one MLP of width moe_intermediate_size · n_shared_experts) added to every token."""

    def __init__(self, cfg: ModelConfig, routing: DeepseekRouting):
        act = ACTIVATION_FNS[cfg.hidden_act]
        super().__init__(cfg, act)
        routing.check(cfg.num_experts, cfg.num_experts_per_tok)
        self.routing = routing
        if routing.topk_method == "noaux_tc":
            self.gate = CorrectedRouter(cfg.hidden_size, cfg.num_experts)
        width = cfg.moe_intermediate_size * routing.n_shared_experts
        self.shared_experts = Expert(cfg, act, width=width, bias=cfg.mlp_bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        r = self.routing
        logits = F.linear(x.float(), self.gate.weight.float())  # N, E
        if r.topk_method == "noaux_tc":
            scores = logits.sigmoid()  # N, E
            choice = scores + self.gate.e_score_correction_bias.float()  # N, E: selection only
        else:
            scores = logits.softmax(dim=-1)  # N, E
            choice = scores
        if r.topk_method != "greedy":
            by = "top2" if r.topk_method == "noaux_tc" else "max"
            keep = group_mask(choice, r.n_group, r.topk_group, by)  # N, E
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # N, k
        weights = scores.gather(1, experts)  # N, k: the scores, never the corrected ones
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * r.routed_scaling_factor
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)
