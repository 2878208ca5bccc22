"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; vLLM's layers and names): one model over N
ranks.

A linear layer y = x Wᵀ splits two ways. **By columns** (its outputs): rank r holds rows
r·O/N..(r+1)·O/N of W [O, I] and computes that slice of y from the whole x; nothing to exchange.
**By rows** (its inputs): rank r holds columns r·I/N.. of W and computes a partial y from its slice
of x; the partial results are summed across ranks (one all-reduce), and the bias is added once,
after. A transformer block needs exactly two all-reduces: q, k, v and gate, up are column-parallel
(each rank its attention heads, its share of the MLP), o and down are row-parallel, and what flows
between them stays local:

    x ─┬─ q,k,v (column: H/N heads) ─ attention on those heads ─ o (row) ─ all-reduce ─ + x
       └─ gate, up (column: I/N) ── act(gate)·up ───────────── down (row) ─ all-reduce ─ + x

The vocabulary splits too: each rank embeds the ids in its ⌈V/N⌉ share (others give 0; an all-reduce
sums the rows) and computes its share of the logits (an all-gather joins them; the padding up to
N·⌈V/N⌉ rows is zeros, its logits dropped). With fewer KV heads than ranks
(GQA), each rank keeps the one KV head its query heads share: KV heads are replicated, as vLLM does.

    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead
    shard_model(model, rank, world_size)   a loaded GPT-2 or Llama-family model, in place, to rank's
                                           share
    tp_unsupported(config, world_size)     why a model cannot be sharded N ways (None when it can)

All-reduces go through `torch.distributed` (gloo on CPU, NCCL on CUDA); `shard_model` needs its
process group initialized. What would be computed wrongly is refused by name: heads or the MLP not
divisible by N, a whole-projection q/k norm (OLMo 2: its variance spans every head),
mixture-of-experts blocks, 8-bit and adapter-wrapped linears. GPTQ / AWQ layers (QuantLinear) split
by their codes (quant_shard.py): by outputs freely, by inputs along whole groups only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import NanoserveError
from ..quant.qlinear import QuantLinear


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows start..start+size of t, zero rows past its end (the vocabulary padded to a multiple of
    N)."""
    out = t.new_zeros(size, *t.shape[1:])
    have = max(0, min(size, t.shape[0] - start))
    out[:have] = t[start:start + have]
    return out


def _column(layer: nn.Module, index: torch.Tensor) -> nn.Module:
    """The column-parallel share of a float or a GPTQ / AWQ (QuantLinear) layer."""
    from .quant_shard import ColumnParallelQuantLinear

    return (
        ColumnParallelQuantLinear(layer, index) if isinstance(layer, QuantLinear)
        else ColumnParallelLinear(layer, index)
    )


def _row(layer: nn.Module, index: torch.Tensor) -> nn.Module:
    """The row-parallel share of a float or a GPTQ / AWQ (QuantLinear) layer."""
    from .quant_shard import RowParallelQuantLinear

    return (
        RowParallelQuantLinear(layer, index) if isinstance(layer, QuantLinear)
        else RowParallelLinear(layer, index)
    )


# split by inputs (GPT-2's attention and MLP c_proj both)
ROW_PARALLEL = ("c_proj", "o_proj", "down_proj")


def _check_splittable(layer: nn.Module, name: str, world_size: int) -> None:
    """A float nn.Linear splits any way; a GPTQ / AWQ layer too, by inputs only along its groups."""
    if isinstance(layer, QuantLinear):
        from .quant_shard import column_split_problem, row_split_problem

        problem = (row_split_problem if name in ROW_PARALLEL else column_split_problem)(
            layer, world_size
        )
        if problem:
            raise NanoserveError(f"tensor_parallel_size={world_size}: the quantized {name} cannot "
                                 f"be split: {problem}")
        return
    _check_float_linear(layer)


def _check_float_linear(layer: nn.Module) -> None:
    """Only a float nn.Linear's weight is split here: an int8/int4 layer's codes and scales split
    otherwise."""
    if not isinstance(layer, nn.Linear) or not layer.weight.is_floating_point():
        raise NanoserveError("tensor parallelism splits float nn.Linear layers, not a "
                             f"{type(layer).__name__}: 8-bit (or adapter-wrapped) linears are not "
                             "split yet; GPTQ / AWQ layers are")


class ColumnParallelLinear(nn.Module):
    """Rows `index` of a linear's weight [O, I] (and bias): this rank's share of its outputs."""

    def __init__(self, layer: nn.Linear, index: torch.Tensor):
        super().__init__()
        _check_float_linear(layer)
        self.in_features, self.out_features = layer.in_features, len(index)
        # O/N, I
        self.weight = nn.Parameter(layer.weight.detach()[index].clone(), requires_grad=False)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach()[index].clone(),
                                                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O/N]
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns `index` of a linear's weight: a partial product of this rank's inputs, summed over
    ranks."""

    def __init__(self, layer: nn.Linear, index: torch.Tensor):
        super().__init__()
        _check_float_linear(layer)
        self.in_features, self.out_features = len(index), layer.out_features
        # O, I/N
        self.weight = nn.Parameter(layer.weight.detach()[:, index].clone(), requires_grad=False)
        self.bias = (
            None if layer.bias is None
            else nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I/N] -> [..., O]
        y = F.linear(x, self.weight)
        dist.all_reduce(y)  # Σ over ranks of the partial products
        return y if self.bias is None else y + self.bias  # the bias once, not N times


class VocabParallelEmbedding(nn.Module):
    """Rows start..start+n of the embedding: ids outside them embed to 0 here, and the all-reduce
    fills them in."""

    def __init__(self, emb: nn.Embedding, start: int, n: int):
        super().__init__()
        self.start, self.n = start, n
        # V/N, C
        self.weight = nn.Parameter(_rows(emb.weight.detach(), start, n), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, C]
        local = ids - self.start
        mine = (local >= 0) & (local < self.n)
        x = F.embedding(local.clamp(0, self.n - 1), self.weight) * mine[..., None]
        dist.all_reduce(x)
        return x


class ParallelLMHead(nn.Module):
    """This rank's V/N of the logits, gathered from every rank into the whole vocabulary.

    The share is `weight` [⌈V/N⌉, C] (float; tied: the embedding's share), or `quantized`: the
    rows of a quantized head this rank has (quant_shard.column_shard; the last rank's share may be
    short of `rows`, its missing logits are zeros, dropped after the gather)."""

    def __init__(self, weight: torch.Tensor | None, world_size: int, vocab_size: int,
                 quantized: nn.Module | None = None, rows: int = 0):
        super().__init__()
        self.weight, self.world_size, self.vocab_size = weight, world_size, vocab_size
        self.quantized, self.rows = quantized, rows

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., V]
        if self.quantized is None:
            local = F.linear(h, self.weight).contiguous()
        else:
            local = self.quantized(h)
            local = F.pad(local, (0, self.rows - local.shape[-1])).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]  # the padding rows' logits dropped


def tp_unsupported(cfg, world_size: int) -> str | None:
    """Why `cfg` cannot be split `world_size` ways, or None."""
    arch = getattr(cfg, "arch", "llama")
    checks = [(arch in ("gpt2", "llama"),
               f"the {arch!r} layout (a family's own blocks, models/families/) is not sharded; "
               "supported: the gpt2 and llama layouts"),
              (cfg.n_heads % world_size == 0,
               f"n_heads={cfg.n_heads} is not divisible by {world_size}"),
              (cfg.n_kv_heads % world_size == 0 or world_size % cfg.n_kv_heads == 0,
               f"n_kv_heads={cfg.n_kv_heads} neither divides nor is divided by {world_size}"),
              (cfg.intermediate_size % world_size == 0,
               f"intermediate_size={cfg.intermediate_size} is not divisible by {world_size}"),
              (getattr(cfg, "qk_norm", None) != "whole",
               "a q/k norm over the whole projection (OLMo 2) spans "
               "every head"),
              (not getattr(cfg, "num_experts", 0), "mixture-of-experts blocks are not sharded yet")]
    return next((why for ok, why in checks if not ok), None)


def _heads(head_dim: int, first: int, count: int) -> torch.Tensor:
    """Output indices of heads first..first+count−1 of a projection with heads of head_dim."""
    return torch.arange(first * head_dim, (first + count) * head_dim)


def check_shardable(model: nn.Module, world_size: int) -> None:
    """Raise, by name, what keeps `model` from being split `world_size` ways (before anything is
    split)."""
    why = tp_unsupported(model.config, world_size)
    if why is not None:
        raise NanoserveError(f"tensor_parallel_size={world_size} is not possible for this model: "
                             f"{why}")
    for module in model.modules():  # every layer to split checked before the first one is
        for name in ("c_attn", "c_proj", "c_fc", "q_proj", "k_proj", "v_proj", "o_proj",
                     "gate_proj", "up_proj",
                     "down_proj"):
            if hasattr(module, name):
                _check_splittable(getattr(module, name), name, world_size)


def shard_model(model: nn.Module, rank: int, world_size: int) -> nn.Module:
    """Replace `model`'s layers, in place, by rank's share of them (see the module's docstring)."""
    cfg = model.config
    check_shardable(model, world_size)
    H, D, N = cfg.n_heads, cfg.head_dim, world_size
    Hl = H // N
    Kl = max(1, cfg.n_kv_heads // N)  # KV heads per rank (replicated when fewer than ranks)
    k_first = (
        rank * cfg.n_kv_heads // N if cfg.n_kv_heads >= N else (rank * Hl) // (H // cfg.n_kv_heads)
    )
    q_idx, kv_idx = _heads(D, rank * Hl, Hl), _heads(D, k_first, Kl)
    inter = cfg.intermediate_size // N
    mlp_idx = torch.arange(rank * inter, (rank + 1) * inter)
    for module in list(model.modules()):
        if hasattr(module, "c_attn"):  # GPT-2: fused [q; k; v] rows, each part split by heads
            C = cfg.hidden_size
            fused = torch.cat([q_idx + part * C for part in range(3)])
            module.c_attn = _column(module.c_attn, fused)
            module.c_proj = _row(module.c_proj, q_idx)
            module.n_heads = Hl
        elif hasattr(module, "q_proj"):  # Llama family
            module.q_proj = _column(module.q_proj, q_idx)
            module.k_proj = _column(module.k_proj, kv_idx)
            module.v_proj = _column(module.v_proj, kv_idx)
            module.o_proj = _row(module.o_proj, q_idx)
            module.n_heads, module.n_kv_heads = Hl, Kl
        elif hasattr(module, "c_fc"):  # GPT-2's MLP
            module.c_fc = _column(module.c_fc, mlp_idx)
            module.c_proj = _row(module.c_proj, mlp_idx)
        elif hasattr(module, "gate_proj"):  # Llama's MLP
            module.gate_proj = _column(module.gate_proj, mlp_idx)
            module.up_proj = _column(module.up_proj, mlp_idx)
            module.down_proj = _row(module.down_proj, mlp_idx)
    _shard_vocab(model, rank, world_size)
    return model


def _shard_vocab(model: nn.Module, rank: int, world_size: int) -> None:
    V = model.config.vocab_size
    # rows per rank: the vocabulary padded up to a multiple of N (as vLLM pads it)
    n = -(-V // world_size)
    start = rank * n
    holder, attr = (
        (model.transformer, "wte") if hasattr(model, "transformer")
        else (model.model, "embed_tokens")
    )
    whole = getattr(holder, attr)
    emb = VocabParallelEmbedding(whole, start, n)
    setattr(holder, attr, emb)
    if isinstance(model.lm_head, QuantLinear):  # a quantized head (never tied): its rows split
        model.lm_head = _quantized_head(model.lm_head, rank, world_size)
        return
    tied = model.lm_head.weight is whole.weight
    head_weight = (
        emb.weight if tied
        else nn.Parameter(_rows(model.lm_head.weight.detach(), start, n), requires_grad=False)
    )
    model.lm_head = ParallelLMHead(head_weight, world_size, V)


def _quantized_head(head: QuantLinear, rank: int, world_size: int) -> ParallelLMHead:
    """A quantized LM head split by its rows (outputs): each share a multiple of the packing's
    word (32 / bits rows; the vocabulary is one, quant/model.py checks), the last one shorter."""
    from .quant_shard import column_shard

    V, word = head.out_features, 32 // head.bits
    rows = -(-V // (word * world_size)) * word
    mine = torch.arange(min(rank * rows, V), min((rank + 1) * rows, V))
    return ParallelLMHead(None, world_size, V, column_shard(head, mine), rows)
