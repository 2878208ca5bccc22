"""EAGLE's draft head (Li et al. 2024): draft autoregressively at the level of features, not tokens.

The target's feature f_t — its last hidden state, the LM head's input — determines its distribution
of token t + 1. EAGLE trains one small decoder layer to predict the *next feature*: from f_t and the
embedding of token t + 1 (the token the target drew from f_t: which branch was taken) it predicts
f̂_{t+1}, and the target's own LM head turns f̂_{t+1} into the draft distribution of token t + 2.
Drafting feeds its own outputs back:

    (f_{m-1}, x_m)  → f̂_m → d_1 ~ LM(f̂_m) the last real feature and the last real token
    (f̂_m,    d_1)  → f̂_{m+1} → d_2 ~ LM(f̂_{m+1})  ... γ drafts, one call of the head each

    EagleHead     fc [2C → C] over (feature, token embedding), then one decoder layer (RoPE
                  attention over the head's own past positions — its KV cache — and a SwiGLU MLP);
                  no input norm, as EAGLE's
    save_eagle    a directory: config.json (hidden_size, num_attention_heads, intermediate_size,
                  vocab_size,
    load_eagle    rope_theta, base_model_name_or_path) and eagle.safetensors with EAGLE's key names
                  ("fc.*", "layers.0.self_attn.{q,k,v,o}_proj.weight",
                  "layers.0.mlp.{gate,up,down}_proj.weight",
                  "layers.0.post_attention_layernorm.weight")
    EagleProposer the engine's proposer (eagle_proposer.py)

Drafts are sampled from the head's distributions at the request's temperature / top-k / top-p (q:
what the rejection sampler needs, so at T > 0 the target's law is kept exactly), or its argmax when
greedy. Training: tools/train_eagle.py (features regressed with smooth L1, the LM head's
distribution of the next token matched).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError

WEIGHTS, CONFIG = "eagle.safetensors", "config.json"


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D] rotated by its positions [T] (the rotate-half form; inv_freq [D/2])."""
    ang = positions.float()[:, None] * inv_freq  # T, D/2
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EagleHead(nn.Module):
    """fc over (feature, embedding), then one decoder layer: `forward(feats, embeds, positions,
    past)` -> the predicted next features, and the layer's keys and values of these positions (the
    caller keeps them)."""

    def __init__(self, hidden: int, num_heads: int, intermediate: int, vocab: int,
                 rope_theta: float = 10000.0):
        super().__init__()
        self.hidden = hidden
        self.num_heads = num_heads
        self.intermediate = intermediate
        self.vocab = vocab
        self.rope_theta, self.head_dim = rope_theta, hidden // num_heads
        self.fc = nn.Linear(2 * hidden, hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden, bias=False) for _ in range(4)
        )
        self.post_attention_layernorm = RMSNorm(hidden)
        self.gate_proj, self.up_proj = (nn.Linear(hidden, intermediate,
                                                  bias=False) for _ in range(2))
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        # (RoPE's frequencies: a float32 constant, not a weight; moved with the input)
        D = self.head_dim
        self.inv_freq = 1.0 / rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # D/2

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """feats, embeds [..., T, C] at `positions` [T] (one sequence's consecutive positions; a
        leading batch dimension in training, where there is no past); past: the cache (K, V) [P, H,
        D] of the positions before. Returns (f̂ [..., T, C], (k, v) [..., T, H, D] of these T
        positions)."""
        x = self.fc(torch.cat([feats, embeds], -1))  # ..., T, C
        *lead, T, C = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = (p(x).view(*lead, T, H, D) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        q, k = rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat([past[0], k]), torch.cat([past[1], v])  # P + T, H, D
        P = keys.shape[-3] - T
        # query i sees keys ≤ P + i
        causal = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
        y = F.scaled_dot_product_attention(q.transpose(-3, -2), keys.transpose(-3, -2),
                                           values.transpose(-3, -2),
                                           attn_mask=causal)  # ..., H, T, D
        h = x + self.o_proj(y.transpose(-3, -2).reshape(*lead, T, C))
        n = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n)), (k, v)

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under EAGLE's names."""
        names = {"fc": "fc", "q_proj": "layers.0.self_attn.q_proj",
                 "k_proj": "layers.0.self_attn.k_proj",
                 "v_proj": "layers.0.self_attn.v_proj", "o_proj": "layers.0.self_attn.o_proj",
                 "post_attention_layernorm": "layers.0.post_attention_layernorm",
                 "gate_proj": "layers.0.mlp.gate_proj",
                 "up_proj": "layers.0.mlp.up_proj", "down_proj": "layers.0.mlp.down_proj"}
        return {
            f"{names[k.split('.')[0]]}.{k.split('.', 1)[1]}": v
            for k, v in self.state_dict().items()
        }


def save_eagle(head: EagleHead, path: str | Path, base_model: str = "") -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["EagleHead"], "hidden_size": head.hidden,
              "num_attention_heads": head.num_heads,
              "intermediate_size": head.intermediate, "vocab_size": head.vocab,
              "rope_theta": head.rope_theta,
              "base_model_name_or_path": base_model}
    (path / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in head.eagle_state_dict().items()},
              str(path / WEIGHTS))
    return path


def load_eagle(path: str | Path, hidden: int, vocab: int, device=None, dtype=None) -> EagleHead:
    """A head saved by save_eagle, checked against the target's hidden size and vocabulary."""
    path = Path(path)
    for f in (CONFIG, WEIGHTS):
        if not (path / f).is_file():
            raise CheckpointError(f"{path} holds no EAGLE head: {f} is missing")
    cfg = json.loads((path / CONFIG).read_text())
    if (cfg.get("hidden_size"), cfg.get("vocab_size")) != (hidden, vocab):
        raise CheckpointError(f"{path}: the EAGLE head is for "
                              f"hidden_size={cfg.get('hidden_size')}, "
                              f"vocab_size={cfg.get('vocab_size')}; the target has {hidden} and "
                              f"{vocab}: another model's")
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1 or hidden % heads:
        raise CheckpointError(f"{path / CONFIG}: num_attention_heads={heads!r} must divide "
                              f"hidden_size={hidden}")
    head = EagleHead(hidden, heads, int(cfg.get("intermediate_size", 4 * hidden)), vocab,
                     float(cfg.get("rope_theta", 10000.0)))
    # EAGLE's name -> ours
    ours = {v: k for k, v in zip(head.state_dict(), head.eagle_state_dict())}
    state = load_file(str(path / WEIGHTS))
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or unexpected:
        raise CheckpointError(f"{path / WEIGHTS}: tensors missing {missing[:3]} or unexpected "
                              f"{unexpected[:3]}")
    head.load_state_dict({ours[k]: v for k, v in state.items()})
    return head.to(device=device, dtype=dtype).eval()


def token_embedding(model) -> nn.Embedding:
    """The target's token embedding (no position table: EAGLE embeds the token alone)."""
    body = model.transformer if hasattr(model, "transformer") else model.model
    return body.wte if hasattr(body, "wte") else body.embed_tokens
