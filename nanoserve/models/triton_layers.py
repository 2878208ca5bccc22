"""The model's layers on the Triton path: fewer, larger launches where the torch code launches
many small kernels (issue 43; counted by benchmarks/bench_launches.py). The engine swaps them in
when it runs the triton attention backend (ModelRunner, extension point "triton_layers"). Only
classes change and weights are regrouped in place: parameters, checkpoint names and state dicts
stay the modules' own.

    TritonRMSNorm        layers.RMSNorm as one kernel (kernels/rms_norm.py): six launches → one
    stack_linears        one linear over several that read the same input (q, k, v; gate, up):
                         their weights (a GPTQ layer's codes, zeros, scales) become views of the
                         stacked one's, so one GEMM computes all
    TritonLlamaModel     a pre-norm Llama whose layers run fused (below)
    use_triton_layers    swap them into a model, in place; returns what was swapped

A fused Llama layer (vLLM's layout) launches 9 kernels in a decode step where the torch code
launches 40:

    add_rms_norm(x, residual)         the previous layer's residual add folded into this norm
    qkv_proj                          q, k and v from one GEMM (views of its output)
    rotary_embedding_store_kv         RoPE on q and k, read from a cos/sin table built once, and
                                      k, v written into the paged pool
    paged_attention, o_proj
    add_rms_norm(attn, residual)
    gate_up_proj, silu_and_mul, down_proj

The residual stream therefore travels beside the hidden states from layer to layer, and the last
add happens in the final norm. Where a piece cannot fuse, the layer takes the unfused step for it
alone: a prefill or an 8-bit pool rotates with `rotary_embedding` and stores through the backend's
`attention`; a layer without RoPE (SmolLM3's NoPE layers) skips it; projections another module
has wrapped since (a LoRA adapter) are called one by one again, so the wrapper is never bypassed.
Sandwich and post-norm blocks, MoE layers and GPT-2 keep their own forward (their norms still one
kernel each).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm, attention, rope_cos_sin
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

ROPE_CHUNK = 65536  # positions whose cos and sin are computed at once (build_rope_tables)


class TritonRMSNorm(RMSNorm):
    """RMSNorm through `nanoserve.kernels.rms_norm` (the same conventions; statistics in float32,
    summed in another order: equal to RMSNorm within float32's rounding,
    tests/test_kernels_norm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self.eps, self.unit_offset, self.scale_fp32)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual) in one launch; (norm(x), x) without a residual."""
        from ..kernels.rms_norm import add_rms_norm

        if residual is None:
            return self(x), x
        return add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset, self.scale_fp32)


# ----------------------------------------------------------------------------- stacked weights
def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear (or the oneDNN one, models/onednn.py) in a floating dtype: what can stack."""
    from .onednn import OneDNNLinear

    return type(m) in (nn.Linear, OneDNNLinear) and m.weight.is_floating_point()


def _stack_tensors(owners: list[nn.Module], name: str, dim: int = 0) -> torch.Tensor:
    """torch.cat of the owners' `name` tensors along `dim`; each owner's becomes a view of it (a
    Parameter stays a Parameter, a buffer a buffer, under its own name: the state dict does not
    change)."""
    tensors = [getattr(owner, name) for owner in owners]
    stacked = torch.cat([t.detach() for t in tensors], dim=dim)
    start = 0
    for t, owner in zip(tensors, owners):
        view = stacked.narrow(dim, start, t.shape[dim])
        if isinstance(t, nn.Parameter):
            setattr(owner, name, nn.Parameter(view, requires_grad=t.requires_grad))
        else:
            owner._buffers[name] = view
        start += t.shape[dim]
    return stacked


def _hold(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """`tensor` as module.name, a buffer outside the state dict (moved by .to(), never saved, not
    a parameter: what the model loaded stays all there is)."""
    if name in module._parameters:
        del module._parameters[name]
    module.__dict__.pop(name, None)
    module.register_buffer(name, tensor, persistent=False)


def _stack_plain(linears: list[nn.Module]) -> nn.Linear | None:
    first = linears[0]
    w = first.weight
    if any(m.weight.dtype != w.dtype or m.weight.device != w.device for m in linears):
        return None
    weight = _stack_tensors(linears, "weight")
    bias = None
    if first.bias is not None:
        bias = _stack_tensors(linears, "bias")
    stacked = nn.Linear(w.shape[1], weight.shape[0], device="meta")
    if type(first) is not nn.Linear:  # the same GEMM library as the layers it replaces
        stacked = type(first).from_linear(stacked)
    _hold(stacked, "weight", weight)
    _hold(stacked, "bias", bias)
    return stacked


def _stack_quantized(linears: list[nn.Module]) -> nn.Module | None:
    """GPTQ layers (quant/qlinear.py) side by side: codes, zeros and scales joined along the
    outputs. They must share bits, groups (g_idx, equal) and dtype, and each one's outputs must
    fill whole int32 words of zeros."""
    from ..quant.qlinear import QuantLinear

    first = linears[0]
    for m in linears:
        same = (m.bits, m.group_size, m.in_features, m.scales.dtype, m.mma_layout) == (
            first.bits, first.group_size, first.in_features, first.scales.dtype, first.mma_layout)
        if not same or (m.out_features * m.bits) % 32 or not torch.equal(m.g_idx, first.g_idx):
            return None
    out = sum(m.out_features for m in linears)
    stacked = QuantLinear(first.in_features, out, first.bits, first.group_size,
                          first.bias is not None, first.scales.dtype, device="meta")
    for name in ("qweight", "qzeros", "scales"):
        _hold(stacked, name, _stack_tensors(linears, name, dim=1))  # [·, N] each
    bias = None
    if first.bias is not None:
        bias = _stack_tensors(linears, "bias")
    _hold(stacked, "bias", bias)
    _hold(stacked, "g_idx", first.g_idx)
    stacked.mma_layout = first.mma_layout  # the codes' order is along the inputs: kept by a cat
    return stacked


def stack_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One linear computing all of `linears` (same input) at once, their outputs side by side; each
    one's weight (and bias; a GPTQ layer's codes, zeros and scales) now a view of it, so nothing is
    held twice and an in-place change of either is seen by both. None when they cannot stack
    (different classes, such as a LoRA-wrapped linear; mixed dtypes, devices, biases or groups)."""
    from ..quant.qlinear import QuantLinear

    if len({m.bias is None for m in linears}) > 1:
        return None
    if all(_plain_linear(m) for m in linears):
        return _stack_plain(linears)
    if all(type(m) is QuantLinear for m in linears):
        return _stack_quantized(linears)
    return None


class _Stacked(nn.Module):
    """A module whose projections NAMES run as one stacked linear (None where they do not stack).
    It remembers the modules it was made from, so a forward can tell whether they are still the
    ones in place (a LoRA wrapper replaces a module by name)."""

    NAMES: tuple[str, ...] = ()

    def stack(self, name: str) -> None:
        """Stack NAMES into one linear, held as `name` (qkv_proj, gate_up_proj: vLLM's names)."""
        self.stacked_from = [getattr(self, n) for n in self.NAMES]
        self.stack_name = name
        setattr(self, name, stack_linears(self.stacked_from))
        if getattr(self, name) is not None:
            self.stack_storage = _storage(self.stacked_from[0])

    def stacked_intact(self) -> bool:
        """A stack exists, the modules in place are those stacked, and they are still views of it
        (a .to() gives each its own copy: the stack would then miss later changes to them)."""
        if getattr(self, self.stack_name) is None:
            return False
        in_place = all(getattr(self, n) is m for n, m in zip(self.NAMES, self.stacked_from))
        return in_place and all(_storage(m) == self.stack_storage for m in self.stacked_from)


def _storage(linear: nn.Module) -> int:
    """Where a linear's weight (a GPTQ layer's codes) lives: the stack's memory while a view."""
    weight = getattr(linear, "weight", None)
    if weight is None:
        weight = linear.qweight
    return weight.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- fused layers
class TritonLlamaAttention(LlamaAttention, _Stacked):
    """LlamaAttention with q, k, v from one GEMM and RoPE fused with the KV store (`fused`)."""

    NAMES = ("q_proj", "k_proj", "v_proj")

    def project(self, x: torch.Tensor):
        """q, k, v [B, T, ·] of x: views of one GEMM's output while the stack is intact."""
        if not self.stacked_intact():
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_dim = self.n_heads * self.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        return self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)

    def fused(self, x, positions, table, cache):
        """The attention's output [B, T, C] for x [B, T, C] at `positions` [B, T]; `table`: the
        layer's (cos, sin) rows [P, R/2], None without RoPE; `cache`: the step's CacheView (None:
        the tokens attend among themselves)."""
        from ..kernels.rotary import rotary_embedding

        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.project(x)
        if self.qk_norm == "whole":  # OLMo 2: normalise the whole projections
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(B * T, H, D), k.view(B * T, Hkv, D), v.view(B * T, Hkv, D)
        if self.qk_norm == "per_head":  # Qwen3: normalise each head's q and k
            q, k = self.q_norm(q), self.k_norm(k)
        how = dict(window=self.window, scale=self.scale, softcap=self.softcap)
        # a triton view's decode step rotates and stores in one kernel; any other step or cache
        # (a prefill, an 8-bit pool, notebook 01's contiguous KVCache) gets q and k rotated here
        if table is not None and getattr(cache, "fuses_rope_store", False):
            y = cache.rope_attention(self.layer_idx, q, k, v, positions, *table, **how)
            return self.o_proj(y.reshape(B, T, -1))
        if table is not None:
            q, k = rotary_embedding(q, k, positions.reshape(-1), *table)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if cache is None:
            y = attention(q, k, v, **how)
        else:  # a layer without RoPE
            y = cache.attention(self.layer_idx, q, k, v, positions, **how)
        return self.o_proj(y.reshape(B, T, -1))


class TritonLlamaMLP(LlamaMLP, _Stacked):
    """SwiGLU with gate and up from one GEMM and silu(gate)·up in one kernel."""

    NAMES = ("gate_proj", "up_proj")

    def forward(self, x):
        from ..kernels.silu_mul import silu_and_mul

        if not self.stacked_intact():
            return super().forward(x)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class TritonLlamaDecoderLayer(LlamaDecoderLayer):
    """A pre-norm Llama layer carrying the residual stream beside its output (the module's
    docstring)."""

    def fused(self, x, residual, positions, table, cache):
        """(mlp output, residual before adding it): x + residual is the layer's input, as
        LlamaDecoderLayer's x; residual None at the first layer (x is the input itself)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn.fused(h, positions, table, cache)
        h, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(h), residual


class TritonLlamaModel(LlamaModel):
    """LlamaModel whose layers run fused, RoPE read from tables of cos and sin built once for
    every position the model accepts (max_position_embeddings: the engine's max_model_len)."""

    def build_rope_tables(self) -> None:
        """Each RoPE kind's (cos, sin) [P, R/2] in the model's dtype, as `blocks` computes them per
        step (layers.rope_cos_sin; LongRoPE's and YaRN's factor applied to the global one)."""
        ref = self.embed_tokens.weight
        self.rope_tables = {}
        for kind, inv_freq in self.inv_freq.items():
            half = inv_freq.shape[0]
            cos = torch.empty(self.max_positions, half, dtype=ref.dtype, device=ref.device)
            sin = torch.empty_like(cos)
            # in chunks of positions: rope_cos_sin's float32 intermediates stay small however long
            # the context (a 1M-position model would need GBs at once)
            for start in range(0, self.max_positions, ROPE_CHUNK):
                end = min(start + ROPE_CHUNK, self.max_positions)
                positions = torch.arange(start, end, device=ref.device)[None]  # 1, n
                c, s = rope_cos_sin(inv_freq.to(ref.device), positions, ref.dtype)  # 1, n, 1, R
                if kind == "global" and self.attention_factor != 1.0:
                    c = c * self.attention_factor
                    s = s * self.attention_factor
                cos[start:end] = c[0, :, 0, :half]
                sin[start:end] = s[0, :, 0, :half]
            self.rope_tables[kind] = (cos, sin)
        self.rope_tables["none"] = None

    def fused_blocks(self, x, positions, cache):
        """The layers over x [B, T, C]: (last layer's output, residual), still to be added."""
        residual = None
        for layer in self.layers:
            x, residual = layer.fused(x, residual, positions, self.rope_tables[layer.rope], cache)
        return x, residual

    def forward(self, input_ids, positions, cache):
        x, residual = self.fused_blocks(self.embed(input_ids, positions), positions, cache)
        return self.norm.add_forward(x, residual)[0]

    def blocks(self, x, positions, cache):
        """A pipeline stage's share (parallel/pipeline.py): the residual added back at its end."""
        x, residual = self.fused_blocks(x, positions, cache)
        return x + residual


def _fuse_model(model: LlamaModel, max_positions: int) -> bool:
    """Turn a pre-norm Llama body into TritonLlamaModel, stacking q/k/v and gate/up where they
    stack; False (nothing changed) for other blocks."""
    if not all(type(layer) is LlamaDecoderLayer for layer in model.layers):
        return False
    for layer in model.layers:
        layer.__class__ = TritonLlamaDecoderLayer
        layer.self_attn.__class__ = TritonLlamaAttention
        layer.self_attn.stack("qkv_proj")
        if type(layer.mlp) is LlamaMLP and layer.mlp.act is torch.nn.functional.silu:
            layer.mlp.__class__ = TritonLlamaMLP
            layer.mlp.stack("gate_up_proj")
    model.__class__ = TritonLlamaModel
    model.max_positions = max_positions
    model.build_rope_tables()
    return True


def use_triton_layers(model: nn.Module) -> dict[str, int]:
    """Swap in the Triton path's modules, in place (classes and weights' grouping only): every
    plain RMSNorm for its one-kernel form; a pre-norm Llama body for TritonLlamaModel. Returns how
    many of each were swapped."""
    swapped = {"rms_norm": 0, "fused_llama_layers": 0, "int4_mma_layout": 0}
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = TritonRMSNorm
            swapped["rms_norm"] += 1
    body = getattr(model, "model", None)
    if type(body) is LlamaModel and len(body.layers):
        if _fuse_model(body, model.config.max_position_embeddings):
            swapped["fused_llama_layers"] = len(body.layers)
    if next(model.parameters()).is_cuda:  # after stacking: a stack's codes reordered once
        from ..quant.qlinear import use_mma_layout

        swapped["int4_mma_layout"] = use_mma_layout(model)
    return swapped
