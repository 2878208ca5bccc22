"""The Triton path's fused Llama layers (nanoserve/models/triton_layers.py) against the torch
modules they replace.

Every pre-norm family runs fused: q, k, v and gate, up from one GEMM each, RoPE from a table built
once and fused with the K/V store in a decode step, the residual add folded into the next norm,
silu·mul in one kernel. On tiny random HF checkpoints (norms and biases randomised), step by step
through a prefill and decode steps over a NaN-poisoned pool, the fused model's logits equal the
plain model's on the torch backend within 1e-4 (fp32) — GQA and MHA, Llama 3's RoPE scaling,
Qwen2's biases, sliding windows, Qwen3's q/k norms, SmolLM3's NoPE layers, Phi-3's partial RoPE with
LongRoPE's factor, MoE layers. Sandwich and post-norm blocks keep their forward. The weights are
regrouped, not copied: the state dict and the parameters are those loaded, an in-place change of a
projection's weight reaches the stacked GEMM, and a wrapper put on a projection afterwards (as a
LoRA adapter is) is called, never bypassed. Controls: RoPE turning the wrong way, and gate and up
exchanged, miss by more than ten times the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from testdata import HF_CASES

from nanoserve.kv import KVCache
from nanoserve.models.loader import load_model
from nanoserve.models.triton_layers import TritonLlamaModel, use_triton_layers

FUSED = ["llama-mha", "llama-gqa", "llama3-rope", "qwen2-bias", "mistral-window", "qwen3-window",
         "smollm3", "phi3", "mixtral", "qwen3-moe"]
UNFUSED = ["gpt2", "gemma2", "gemma3", "olmo2"]  # GPT-2; sandwich and post-norm blocks
TOL = 1e-4  # fp32 logits: the same math in another order


def _step_logits(model, cfg, backend, batch, prefill=9):
    """Logits [steps, B, V]: a prefill of `prefill` tokens, then one decode step per token; the
    pool's unused slots hold NaN (a kernel reading past a context returns NaN)."""
    B, T = batch.shape
    cache = KVCache(cfg, batch_size=B, max_seq_len=T, block_size=4, attention_backend=backend)
    for pool in (cache.pool.k, cache.pool.v):
        pool.fill_(float("nan"))
    steps = [model(batch[:, :prefill], cache=cache, last_only=True)[:, -1]]
    for t in range(prefill, T):
        steps.append(model(batch[:, t:t + 1], cache=cache, last_only=True)[:, -1])
    return torch.stack(steps)  # steps, B, V


def _batch(cfg):
    return torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))


def test_every_case_is_listed():
    assert sorted(FUSED + UNFUSED) == sorted(HF_CASES)


@pytest.mark.parametrize("case", FUSED + UNFUSED)
@torch.no_grad()
def test_fused_layers_give_the_torch_modules_logits(hf_checkpoints, case):
    path = hf_checkpoints[case][0]
    plain, cfg, _ = load_model(path)
    fused, _, _ = load_model(path)
    swapped = use_triton_layers(fused)
    assert (type(getattr(fused, "model", None)) is TritonLlamaModel) == (case in FUSED)
    assert swapped["fused_llama_layers"] == (cfg.n_layers if case in FUSED else 0)
    ref = _step_logits(plain, cfg, "torch", _batch(cfg))
    got = _step_logits(fused, cfg, "triton", _batch(cfg))
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= TOL, f"{case}: max |Δ logits| = {err:.2e}"


def test_the_stacked_gemms_are_used_where_they_stack(hf_checkpoints):
    fused, cfg, _ = load_model(hf_checkpoints["qwen3-moe"][0])  # layer 1 dense, 0 and 2 MoE
    use_triton_layers(fused)
    layers = fused.model.layers
    assert all(layer.self_attn.qkv_proj is not None for layer in layers)
    assert getattr(layers[1].mlp, "gate_up_proj", None) is not None
    assert not hasattr(layers[0].mlp, "gate_up_proj")  # experts keep their own


@torch.no_grad()
def test_weights_are_regrouped_not_copied(hf_checkpoints):
    path = hf_checkpoints["qwen2-bias"][0]
    fused, cfg, _ = load_model(path)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    count = sum(p.numel() for p in fused.parameters())
    use_triton_layers(fused)
    after = fused.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sum(p.numel() for p in fused.parameters()) == count
    attn = fused.model.layers[0].self_attn
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    q_dim = cfg.n_heads * cfg.head_dim
    attn.q_proj.weight.mul_(2)  # in place: the stacked weight sees it
    attn.q_proj.bias.add_(1)
    want = attn.q_proj(x)
    assert torch.equal(attn.qkv_proj(x)[..., :q_dim], want)
    assert attn.qkv_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr()


class _Shifted(torch.nn.Module):
    """A stand-in for a LoRA wrapper: the wrapped projection's output plus 1."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x) + 1.0


@torch.no_grad()
def test_a_wrapper_put_on_a_projection_later_is_called(hf_checkpoints):
    path = hf_checkpoints["llama-gqa"][0]
    plain, cfg, _ = load_model(path)
    fused, _, _ = load_model(path)
    use_triton_layers(fused)
    for model in (plain, fused):  # what LoRAManager does: replace the module by name
        attn = model.model.layers[1].self_attn
        attn.v_proj = _Shifted(attn.v_proj)
        mlp = model.model.layers[0].mlp
        mlp.up_proj = _Shifted(mlp.up_proj)
    ref = _step_logits(plain, cfg, "torch", _batch(cfg))
    got = _step_logits(fused, cfg, "triton", _batch(cfg))
    assert (got - ref).abs().max().item() <= TOL
    # and the wrapper matters: without it the logits move
    clean, _, _ = load_model(path)
    assert (_step_logits(clean, cfg, "torch", _batch(cfg)) - ref).abs().max().item() > 10 * TOL


@torch.no_grad()
def test_controls_rope_the_wrong_way_and_swapped_gate_miss(hf_checkpoints):
    path = hf_checkpoints["llama-gqa"][0]
    plain, cfg, _ = load_model(path)
    ref = _step_logits(plain, cfg, "torch", _batch(cfg))
    shifted, _, _ = load_model(path)
    use_triton_layers(shifted)
    cos, sin = shifted.model.rope_tables["global"]
    shifted.model.rope_tables["global"] = (cos, -sin)  # each pair turned the other way
    assert (_step_logits(shifted, cfg, "triton", _batch(cfg)) - ref).abs().max().item() > 10 * TOL
    swapped, _, _ = load_model(path)
    use_triton_layers(swapped)
    for layer in swapped.model.layers:
        gu = layer.mlp.gate_up_proj
        gu.weight = torch.cat(gu.weight.chunk(2)[::-1])  # up, then gate
    assert (_step_logits(swapped, cfg, "triton", _batch(cfg)) - ref).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias", "smollm3", "phi3"])
def test_through_the_engine_decode_steps_rotate_and_store_in_one_kernel(hf_checkpoints, case,
                                                                        monkeypatch):
    """The engine's paged views take the fused decode path (rotary_embedding_store_kv): greedy
    tokens and their top-5 logprobs as the torch backend's, over prompts of mixed lengths."""
    from nanoserve.kernels import rotary

    from nanoserve import LLM, SamplingParams

    calls = []
    fused_store = rotary.rotary_embedding_store_kv

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])  # the step's rows
        return fused_store(*args, **kwargs)

    monkeypatch.setattr(rotary, "rotary_embedding_store_kv", counted)
    path = str(hf_checkpoints[case][0])
    prompts = [list(range(5, 24)), [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, block_size=4)
        runs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    layers_with_rope = 3 if case == "smollm3" else llm.model.config.n_layers  # (NoPE: layer 3)
    assert len(calls) == 5 * layers_with_rope and set(calls) == {2}  # 5 decode steps, 2 rows
    for ref, got in zip(runs["torch"], runs["triton"]):
        assert got.token_ids == ref.token_ids
        for want, have in zip(ref.logprobs, got.logprobs):
            assert want.keys() == have.keys()
            assert max(abs(want[t].logprob - have[t].logprob) for t in want) <= TOL


def _quantize_projections(model, group_size=24):
    """q, k and v of every layer as 4-bit GPTQ layers (RTN), the same in every copy (the MLP's 100
    outputs cannot pack 8 codes a word)."""
    from nanoserve.quant.qlinear import QuantLinear
    from nanoserve.quant.rtn import quantize_rtn

    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(attn, name)
            qw = quantize_rtn(linear.weight.detach(), bits=4, group_size=group_size)
            setattr(attn, name, QuantLinear.from_quantized(qw, linear.bias, dtype=torch.float32))


@torch.no_grad()
def test_gptq_projections_stack_too(hf_checkpoints):
    """4-bit q, k, v stack into one GPTQ layer (codes, zeros, scales side by side); logits as the
    plain quantized model's. A GPTQ layer beside a float one does not stack."""
    from nanoserve.models.triton_layers import stack_linears
    from nanoserve.quant.qlinear import QuantLinear

    path = hf_checkpoints["llama-gqa"][0]
    plain, cfg, _ = load_model(path)
    fused, _, _ = load_model(path)
    for model in (plain, fused):
        _quantize_projections(model)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    use_triton_layers(fused)
    after = fused.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    for layer in fused.model.layers:
        assert type(layer.self_attn.qkv_proj) is QuantLinear
        assert layer.self_attn.qkv_proj.out_features == (cfg.n_heads + 2 * cfg.n_kv_heads) * 12
    mlp = fused.model.layers[0].mlp
    assert stack_linears([fused.model.layers[1].self_attn.q_proj, mlp.gate_proj]) is None
    ref = _step_logits(plain, cfg, "torch", _batch(cfg))
    got = _step_logits(fused, cfg, "triton", _batch(cfg))
    assert (got - ref).abs().max().item() <= TOL
    # control: the stack's scales in another order miss
    attn = fused.model.layers[0].self_attn
    attn.qkv_proj.scales = attn.qkv_proj.scales.flip(1)
    assert (_step_logits(fused, cfg, "triton", _batch(cfg)) - ref).abs().max().item() > 10 * TOL


@torch.no_grad()
def test_a_projection_given_its_own_copy_is_not_missed(hf_checkpoints):
    """A weight that stopped being a view of the stack (what .to() does to each tensor) is read
    from its own module again: a change to it reaches the output."""
    path = hf_checkpoints["llama-gqa"][0]
    plain, cfg, _ = load_model(path)
    fused, _, _ = load_model(path)
    use_triton_layers(fused)
    for model in (plain, fused):
        attn = model.model.layers[0].self_attn
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.clone() * 2)
        mlp = model.model.layers[1].mlp
        mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight.clone() * 2)
    ref = _step_logits(plain, cfg, "torch", _batch(cfg))
    assert (_step_logits(fused, cfg, "triton", _batch(cfg)) - ref).abs().max().item() <= TOL
