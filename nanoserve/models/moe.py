"""Mixture of experts (Shazeer et al. 2017; Mixtral, Qwen3-MoE): E small MLPs instead of one, and a
router that sends each token to its top k of them.

    probs = softmax(x · Wᵣᵀ)                        # N, E     the router ("gate"), in float32
    w, e = topk(probs, k)                            # N, k     each token's experts and weights
    w = w / Σ w   (Mixtral always; Qwen3-MoE when norm_topk_prob)
    y_t = Σ_j w_tj · expert_{e_tj}(x_t)              # only k of E experts run per token

So a model holds E MLPs' weights but spends k MLPs' compute per token. Two forms, the same sum:
`moe_reference` loops over tokens and their k experts, as the formula reads; `SparseMoeBlock` loops
over experts, runs each once on all the tokens routed to it (one matmul per expert, not per token)
and scatters the weighted outputs back (`index_add_`). A test checks they agree. Taught in the model
families notebook.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import CheckpointError
from .config import ModelConfig


class Expert(nn.Module):
    """One expert: a gated MLP, down(act(gate(x)) · up(x)) (Mixtral's checkpoints name them w1, w3,
    w2). `width`: another width than the routed experts' (a shared expert, moe_shared.py); `bias`:
    biases on the three projections (DeepSeek-V2's shared experts with mlp_bias)."""

    def __init__(self, cfg: ModelConfig, act, width: int | None = None, bias: bool = False):
        super().__init__()
        width = width or cfg.moe_intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=bias)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, act):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(cfg, act) for _ in range(cfg.num_experts))
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        probs = self.gate(x).float().softmax(dim=-1)  # N, E
        weights, experts = probs.topk(self.top_k, dim=-1)  # N, k
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # N, C
        weights, experts = self.route(x)  # N, k
        out = torch.zeros_like(x)  # N, C
        for e in experts.unique().tolist():  # only the experts some token chose
            # n_e each: which tokens, which of their k
            tokens, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](x.index_select(0, tokens)) * weights[tokens, slot, None]  # n_e, C
            out.index_add_(0, tokens, y)
        return out.view(shape)


def moe_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The same sum token by token: for each token, its k experts, each weighted. x [..., C]."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = block.route(flat)
    out = torch.stack(
        [
            sum(w * block.experts[int(e)](t[None])[0] for w, e in zip(weights[i], experts[i]))
            for i, t in enumerate(flat)
        ]
    )
    return out.view(x.shape)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether `layer` has experts: Qwen3-MoE may keep dense MLPs in `mlp_only_layers` and between
    sparse steps."""
    return (
        cfg.num_experts > 0 and layer not in (cfg.mlp_only_layers or [])
        and (layer + 1) % cfg.moe_every == 0
    )


MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                 ".w2.": ".down_proj."}


def rename(key: str, table: dict[str, str], reverse: bool = False) -> str:
    """A checkpoint name in nanoserve's spelling (or back, with reverse): Mixtral's w1/w3/w2
    experts."""
    for theirs, ours in table.items():
        key = key.replace(ours, theirs) if reverse else key.replace(theirs, ours)
    return key


# transformers 5 holds a block's experts stacked, experts.gate_up_proj [E, 2F, C] (each expert's
# gate rows, then its up rows) and experts.down_proj [E, C, F]; its save_pretrained writes them back
# one expert at a time (experts.N.gate_proj.weight, ...), but a state dict saved as it is keeps them
# stacked.
_STACKED = re.compile(r"(^|.*\.)experts\.(gate_up_proj|down_proj)$")


def split_stacked_experts(tensors: dict[str, torch.Tensor], hidden_size: int,
                          width: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with stacked experts (transformers 5's in-memory layout) split into one
    gate_proj, up_proj and down_proj weight per expert, the names `Expert` has; other tensors pass
    through. `width`: each routed expert's F. A stacked tensor of another shape is refused by
    name."""
    out = {}
    for key, t in tensors.items():
        match = _STACKED.fullmatch(key)
        if match is None:
            out[key] = t
            continue
        prefix, kind = match.groups()
        want = (2 * width, hidden_size) if kind == "gate_up_proj" else (hidden_size, width)
        if t.ndim != 3 or tuple(t.shape[1:]) != want:
            raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, expected "
                                  f"[num_experts, {want[0]}, {want[1]}] from config.json")
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}experts.{e}.gate_proj.weight"] = t[e, :width]  # F, C
                out[f"{prefix}experts.{e}.up_proj.weight"] = t[e, width:]  # F, C
            else:
                out[f"{prefix}experts.{e}.down_proj.weight"] = t[e]  # C, F
    return out
