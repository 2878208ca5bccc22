"""Quantize a whole model: RTN, GPTQ or AWQ on every linear layer of every block, block by block.

rtn.py, gptq.py and awq.py each handle one layer (or one group of layers reading the same
input). This module is the loop around them, the way GPTQ's and AWQ's reference code runs it:

1. Run the calibration text through the embeddings and stop at block 0 (a forward pre-hook that
   records block 0's arguments and raises `_Stop`): the inputs of block 0, [B, T, C] per batch.
2. For each block, in order:
   - record its float outputs on those inputs (to measure what quantization does to the block);
   - quantize its linears group by group, in the order they run (`block_groups`):
     * RTN rounds each weight;
     * GPTQ runs the block on the inputs with hooks accumulating H = 2XXᵀ/n per linear, quantizes
       the group, puts the quantized weights in, and only then calibrates the next group, so
       o_proj is calibrated on the outputs of the already-quantized q/k/v ("true sequential");
     * AWQ captures each group's input, searches its scales and clipping, folds the scales into
       the op before (a norm, or the linear before: v → o, up → down), and rounds every linear
       of the block at the end (folding into an already-rounded layer would move it off its grid);
   - run the quantized block: its outputs are the next block's inputs, so every block is
     calibrated on what the quantized model before it really produces.
3. The embeddings stay in float; so does the LM head unless `lm_head=True` (gptqmodel's option of
   the same name): it is then quantized last, calibrated on what it really reads (the final
   norm's outputs, captured by a hook while the quantized model runs the calibration text). On a
   model whose LM head is its embedding matrix (`tie_word_embeddings`), the head gets its own copy
   first and the model becomes untied: the embedding stays float (a gather reads a few rows of it
   a step), the head is read whole every decode step, which is what int4 shrinks.

Weights end up in the model as their dequantized values Ŵ (a "fake-quantized" float model, which
is what perplexity is measured on), and the codes are returned per layer for packing into
`QuantLinear`s or a checkpoint (checkpoint.py). A layer whose input width K is not a multiple of
the group size falls back to one group per row (reported in `LayerReport.group_size`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import NanoserveError
from .awq import apply_awq, apply_clip, awq_search, search_clip
from .gptq import GPTQ, capture_inputs
from .rtn import QuantizedWeight, check_bits, quantize_rtn

METHODS = ("rtn", "gptq", "awq")


@dataclass
class QuantizeConfig:
    """What `quantize_model` does; the fields of a GPTQ checkpoint's quantization_config."""

    method: str = "gptq"
    bits: int = 4
    group_size: int = 128      # −1: one group per output row (the usual int8 setting)
    # symmetric grid (zero = 2^(bits−1)); GPTQ v1 checkpoints need it or zeros ≥ 1
    sym: bool = True
    act_order: bool = False    # GPTQ desc_act
    # GPTQ: every group's grid from the original weights, groups k // group_size even under
    # act-order (llmcompressor's actorder="static"; its default)
    static_groups: bool = False
    damp: float = 0.01         # GPTQ percdamp
    blocksize: int = 128       # GPTQ lazy-batch width
    lm_head: bool = False      # quantize the LM head too (untying a tied one)

    def __post_init__(self):
        if self.method not in METHODS:
            raise NanoserveError(f"method={self.method!r} is not a quantization method; allowed: "
                                 f"{', '.join(METHODS)}")
        check_bits(self.bits)
        if self.group_size != -1 and (isinstance(self.group_size,
                                                 bool) or not isinstance(self.group_size, int)
                                      or self.group_size < 1):
            raise NanoserveError("group_size must be -1 (per row) or a positive int such as 32, "
                                 f"64, 128, got {self.group_size!r}")
        if self.act_order and self.method != "gptq":
            raise NanoserveError("act_order (desc_act) is a GPTQ option; it does not apply to "
                                 f"method={self.method!r}")
        if not isinstance(self.static_groups, bool):
            raise NanoserveError(f"static_groups must be True or False, got {self.static_groups!r}")
        if self.static_groups and self.method != "gptq":
            raise NanoserveError("static_groups is a GPTQ option; it does not apply to "
                                 f"method={self.method!r}")
        if not isinstance(self.lm_head, bool):
            raise NanoserveError(f"lm_head must be True or False, got {self.lm_head!r}")

    def hf_config(self) -> dict:
        """The quantization_config block of config.json (AutoGPTQ / transformers naming)."""
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": self.sym, "damp_percent": self.damp,
                "true_sequential": True, "lm_head": self.lm_head,
                "checkpoint_format": "gptq", "quantizer": f"nanoserve-{self.method}"}


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]       # N, K
    group_size: int              # the one used (−1: per row)


@dataclass
class QuantizeResult:
    config: QuantizeConfig
    # full module name → codes, zeros, scales, g_idx
    qweights: dict[str, QuantizedWeight]
    layers: list[LayerReport] = field(default_factory=list)
    # per block: ‖y_q − y‖² / ‖y‖² on calibration
    block_errors: list[float] = field(default_factory=list)
    # AWQ: the α chosen per group (first linear)
    awq_alphas: dict[str, float] = field(default_factory=dict)


class _Stop(Exception):
    pass


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name prefix, the transformer blocks) of a nanoserve model."""
    arch = model.config.arch
    if arch == "gpt2":
        return "transformer.h", model.transformer.h
    if arch == "llama":
        return "model.layers", model.model.layers
    raise NanoserveError(f"quantization supports gpt2 and llama models, not {arch!r}")


def block_groups(model: nn.Module,
                 block: nn.Module | None = None) -> list[tuple[str | None, list[str]]]:
    """Per block, in execution order: (the op producing the input, the linears reading it).

    The first element is where AWQ folds 1/s (None: nothing it can fold into, e.g. a GELU or the
    attention output of a fused c_attn; AWQ then only clips). A mixture-of-experts `block` lists
    each expert's linears (the router stays in float, as vLLM keeps it)."""
    cfg = model.config
    if cfg.arch == "gpt2":
        return [("ln_1", ["attn.c_attn"]), (None, ["attn.c_proj"]), ("ln_2", ["mlp.c_fc"]),
                (None, ["mlp.c_proj"])]
    # v → o only when v's outputs line up one-to-one with o's inputs (no GQA sharing)
    v_to_o = "self_attn.v_proj" if cfg.n_kv_heads == cfg.n_heads else None
    # the norms feeding the attention and the MLP: Gemma's sandwich names the MLP's
    # pre_feedforward_layernorm; OLMo 2's post-norm blocks feed both the raw residual stream
    # (nothing to fold into: AWQ only clips)
    attn_norm, mlp_norm = {"pre_norm": ("input_layernorm", "post_attention_layernorm"),
                           "sandwich": ("input_layernorm", "pre_feedforward_layernorm"),
                           "post_norm": (None, None)}[cfg.block]
    attn = [(attn_norm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (v_to_o, ["self_attn.o_proj"])]
    if block is not None and hasattr(block.mlp, "experts"):
        groups = attn + [g for e in range(len(block.mlp.experts)) for g in (
            (None, [f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"]),
            (None, [f"mlp.experts.{e}.down_proj"]))]
        # Qwen2-MoE's shared expert (models/moe_shared.py) too; its gate, a [1, C] linear, stays
        # in float with the router
        if hasattr(block.mlp, "shared_expert"):
            groups += [(None, ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]),
                       (None, ["mlp.shared_expert.down_proj"])]
        return groups
    return attn + [(mlp_norm, ["mlp.gate_proj", "mlp.up_proj"]), ("mlp.up_proj", ["mlp.down_proj"])]


def _group_size(group_size: int, k: int) -> int:
    return group_size if group_size != -1 and k % group_size == 0 else -1


@torch.no_grad()
def block_inputs(model: nn.Module, block: nn.Module, calib: torch.Tensor,
                 batch_size: int) -> list[tuple]:
    """Block 0's positional arguments for each calibration batch (hidden states first)."""
    captured = []

    def hook(module, args):
        captured.append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
        raise _Stop

    handle = block.register_forward_pre_hook(hook)
    try:
        for i in range(0, calib.shape[0], batch_size):
            try:
                model(calib[i:i + batch_size])
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


def run_block(block: nn.Module, inputs: list[tuple]) -> list[torch.Tensor]:
    return [block(*args) for args in inputs]


@torch.no_grad()
def quantize_model(model: nn.Module, calib: torch.Tensor | None, config: QuantizeConfig,
                   batch_size: int = 8, progress: bool = True) -> QuantizeResult:
    """Quantize every linear of every block in place (weights become Ŵ); returns the codes.

    calib: token ids [n_samples, seqlen] (GPTQ and AWQ need it; RTN uses it only to report
    block errors and accepts None).
    """
    if config.method != "rtn" and calib is None:
        raise NanoserveError(f"{config.method} needs calibration text: pass token ids [n_samples, "
                             "seqlen]")
    if calib is not None and (
        calib.dim() != 2 or calib.shape[0] == 0 or calib.dtype not in (torch.int32, torch.int64)
    ):
        raise NanoserveError(f"calibration ids must be an integer tensor [n_samples, seqlen], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
    if getattr(model.config, "num_experts", 0) and config.method != "rtn":
        raise NanoserveError(f"method={config.method!r} on a mixture-of-experts model is not "
                             "supported: each expert sees only the calibration tokens routed to "
                             "it, maybe none; supported: method='rtn'")
    prefix, blocks = decoder_blocks(model)
    device = next(model.parameters()).device
    result = QuantizeResult(config=config, qweights={})
    inputs = block_inputs(model, blocks[0], calib.to(device),
                          batch_size) if calib is not None else None
    if config.lm_head:
        _check_lm_head(model, config)
        untie_lm_head(model)
    n_linears = sum(len(n) for b in blocks for _, n in block_groups(model, b)) + config.lm_head
    bar = tqdm(total=n_linears,
               desc=f"{config.method} {config.bits}-bit", unit="layer", disable=not progress)
    for i, block in enumerate(blocks):
        groups = block_groups(model, block)
        ref = run_block(block, inputs) if inputs is not None else None
        if config.method == "awq":
            _awq_block(block, groups, inputs, config, result, f"{prefix}.{i}.")
        for _prev, names in groups:
            if config.method == "gptq":
                lins = {n: block.get_submodule(n) for n in names}
                stats = {n: GPTQ(lin.weight) for n, lin in lins.items()}
                with capture_inputs(lins, lambda n, x, stats=stats: stats[n].add_batch(x)):
                    run_block(block, inputs)
            for n in names:
                lin = block.get_submodule(n)
                N, K = lin.weight.shape
                gs = _group_size(config.group_size, K)
                if config.method == "gptq":
                    qw = stats[n].quantize(config.bits, gs, config.sym, config.blocksize,
                                           config.damp, config.act_order, config.static_groups)
                else:
                    qw = quantize_rtn(lin.weight, config.bits, gs, config.sym)
                lin.weight.copy_(qw.dequantize().to(lin.weight.dtype))
                result.qweights[f"{prefix}.{i}.{n}"] = qw
                result.layers.append(LayerReport(f"{prefix}.{i}.{n}", (N, K), gs))
                bar.update()
        if inputs is not None:
            outs = run_block(block, inputs)
            err = sum(((o - r).float() ** 2).sum().item() for o, r in zip(outs, ref))
            result.block_errors.append(
                err / max(sum((r.float() ** 2).sum().item() for r in ref), 1e-30)
            )
            inputs = [(o, *args[1:]) for o, args in zip(outs, inputs)]
    if config.lm_head:
        _quantize_lm_head(model, calib, config, result, batch_size)
        bar.update()
    bar.close()
    return result


def _check_lm_head(model: nn.Module, config: QuantizeConfig) -> None:
    """Refuse, before any work, an LM head the GPTQ layout cannot hold (its zero points are packed
    32 / bits to a word along the outputs: the vocabulary)."""
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise NanoserveError(f"the LM head is a {type(head).__name__}, not a linear layer: it "
                             "cannot be quantized")
    per = 32 // config.bits
    if head.out_features % per:
        raise NanoserveError(f"lm_head=True: the LM head's {head.out_features} outputs (the "
                             f"vocabulary) are not a multiple of {per}, which {config.bits}-bit "
                             "packing needs (zero points are packed along the outputs); keep the "
                             "head in float")


def untie_lm_head(model: nn.Module) -> None:
    """Give a tied LM head its own copy of the embedding matrix, and say so in the config (the
    checkpoint is then written untied, with the head's tensors beside the float embedding)."""
    if not model.config.tie_word_embeddings:
        return
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(),
                                        requires_grad=False)
    model.config.tie_word_embeddings = False


def final_norm(model: nn.Module) -> str:
    """The name of the norm whose outputs the LM head reads (where AWQ folds its scales)."""
    return "transformer.ln_f" if model.config.arch == "gpt2" else "model.norm"


def _quantize_lm_head(model: nn.Module, calib: torch.Tensor | None, config: QuantizeConfig,
                      result: QuantizeResult, batch_size: int) -> None:
    """Quantize the LM head after every block, on the inputs the quantized model gives it."""
    head = model.lm_head
    N, K = head.weight.shape
    gs = _group_size(config.group_size, K)
    if config.method == "rtn":
        qw = quantize_rtn(head.weight, config.bits, gs, config.sym)
    else:
        xs = []
        with capture_inputs({"lm_head": head}, lambda n, x: xs.append(x.reshape(-1, K))):
            for i in range(0, calib.shape[0], batch_size):
                model(calib[i:i + batch_size].to(head.weight.device))
        x = torch.cat(xs)                                                    # T, K
        if config.method == "gptq":
            stats = GPTQ(head.weight)
            stats.add_batch(x)
            qw = stats.quantize(config.bits, gs, config.sym, config.blocksize, config.damp,
                                config.act_order, config.static_groups)
        else:
            res = awq_search([head], x, config.bits, gs, config.sym)
            apply_awq(model.get_submodule(final_norm(model)), [head], res)
            result.awq_alphas["lm_head"] = res.alpha
            qw = quantize_rtn(head.weight, config.bits, gs, config.sym)
    head.weight.copy_(qw.dequantize().to(head.weight.dtype))
    result.qweights["lm_head"] = qw
    result.layers.append(LayerReport("lm_head", (N, K), gs))


def _awq_block(block: nn.Module, groups: Sequence[tuple[str | None, list[str]]],
               inputs: list[tuple],
               config: QuantizeConfig, result: QuantizeResult, prefix: str) -> None:
    """Search and apply AWQ scales and clipping for each group of one block (weights stay float)."""
    for prev, names in groups:
        lins = [block.get_submodule(n) for n in names]
        K = lins[0].in_features
        gs = _group_size(config.group_size, K)
        xs = []
        with capture_inputs({names[0]: lins[0]}, lambda n, x, xs=xs,
                            K=K: xs.append(x.reshape(-1, K))):
            run_block(block, inputs)
        x = torch.cat(xs)                                                    # T, K
        # q and k feed attention scores, which clipping hurts (the reference code skips them)
        clip = not any(n.endswith(("q_proj", "k_proj", "c_attn")) for n in names)
        if prev is not None:
            res = awq_search(lins, x, config.bits, gs, config.sym, clip=clip)
            apply_awq(block.get_submodule(prev), lins, res)
            result.awq_alphas[prefix + names[0]] = res.alpha
        elif clip:
            for lin in lins:
                apply_clip(lin, search_clip(lin.weight.float(), x, config.bits, gs, config.sym), gs)


def calibration_ids(tokenizer, text: str, nsamples: int = 32, seqlen: int = 128,
                    seed: int = 0) -> torch.Tensor:
    """[nsamples, seqlen] token ids: windows of `text` at random offsets (seeded), as GPTQ's and
    AWQ's reference code draw them from their calibration sets."""
    if nsamples < 1 or seqlen < 2:
        raise NanoserveError(f"need nsamples ≥ 1 and seqlen ≥ 2, got nsamples={nsamples}, "
                             f"seqlen={seqlen}")
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if len(ids) <= seqlen:
        raise NanoserveError(f"the calibration text has {len(ids)} tokens; windows of "
                             f"seqlen={seqlen} need more")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (nsamples,), generator=g)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])  # nsamples, seqlen
