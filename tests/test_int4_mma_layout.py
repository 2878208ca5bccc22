"""The MMA layout of 4-bit codes (kernels/int4_tiles.py, quant/qlinear.py; issue 43, item 3).

Golden words, written out by hand from the layout's definition (in each tile of 128 rows, word r
holds rows r, 16 + r, ..., 112 + r, nibble j row 16·j + r): codes equal to row // 16 pack, in the
MMA layout, to 0x76543210 in every word (nibble j = j); in GPTQ's order (word r: rows 8·r ..
8·r + 7) to (r // 2) · 0x11111111. Every kernel path (the GEMV by multiply-adds at M = 1 and 2, by
tl.dot at M = 16, split-K, the gather path, the tiled GEMM, dequantize_int4) reads MMA-layout codes
to the fp64 oracle of tests/test_kernels_dequant.py in the interpreter; negative control: the same
words read as GPTQ's order miss by far. A model's layers reordered in place by `use_mma_layout`
(stacked q/k/v and gate/up: one tensor, views of it) give the same logits and the same state dict;
layers that cannot take it (act-order, groups of 32) keep GPTQ's order.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.dequant_matmul import (
    dequant_gemm,
    dequant_gemv,
    dequant_matmul,
    dequantize_int4,
    dequantize_int4_mma,
)
from nanoserve.kernels.int4_tiles import from_mma_layout, mma_row_order, to_mma_layout
from test_kernels_dequant import TOL, _activations, _gptq_case, _pack_words, _rel

from nanoserve.errors import NanoserveError
from nanoserve.quant.qlinear import QuantLinear, use_mma_layout


def _mma_case(K=256, N=72, group=128, seed=0):
    tensors, w = _gptq_case(K, N, group, False, seed=seed)
    return {**tensors, "qweight": to_mma_layout(tensors["qweight"])}, w, tensors["qweight"]


def test_golden_words_and_the_round_trip():
    codes = (torch.arange(256) // 16 % 8)[None, :].expand(8, 256)  # N, K: row k's code k // 16
    gptq = _pack_words(codes).t().contiguous()  # K/8, N
    mma = to_mma_layout(gptq)
    assert (mma == 0x76543210).all()
    r = torch.arange(32)[:, None]  # word row (two tiles of 16)
    assert torch.equal(gptq, (r % 16 // 2 * 0x11111111).to(torch.int32).expand(32, 8))
    assert torch.equal(from_mma_layout(mma), gptq)
    assert mma_row_order(256)[:8].tolist() == [0, 16, 32, 48, 64, 80, 96, 112]
    with pytest.raises(ValueError, match="K=200 is not a multiple of it"):
        to_mma_layout(torch.zeros(25, 8, dtype=torch.int32))


@pytest.mark.parametrize("M,split_k", [(1, 1), (2, 1), (1, 2), (16, 1), (16, 2), (3, 1)])
def test_the_gemv_reads_the_mma_layout(M, split_k):
    tensors, w, _ = _mma_case(seed=M)
    a = _activations(M, 256, seed=M)
    c = dequant_gemv(a, **tensors, group_size=128, split_k=split_k, mma_layout=True)
    assert _rel(c, a.double() @ w.t()) < TOL
    as_gptq = dequant_gemv(a, **tensors, group_size=128, split_k=split_k)  # negative control
    assert _rel(as_gptq, a.double() @ w.t()) > 0.3


def test_the_other_paths_read_it_too():
    """The gather path (no group_size), the GEMM (M = 32) and dequantize_int4."""
    tensors, w, gptq = _mma_case(K=384, N=40, seed=7)
    a = _activations(32, 384)
    for c in (dequant_gemm(a, **tensors, group_size=128, mma_layout=True),
              dequant_gemm(a, **tensors, mma_layout=True),
              dequant_gemv(a[:5], **tensors, mma_layout=True),
              dequant_matmul(a[:2], **tensors, group_size=128, mma_layout=True)):
        assert _rel(c, a[:c.shape[0]].double() @ w.t()) < TOL
    assert torch.equal(dequantize_int4_mma(**tensors),
                       dequantize_int4(**{**tensors, "qweight": gptq}))
    with pytest.raises(ValueError, match="K=200 is not a multiple of 128"):
        small, _ = _gptq_case(200, 72, 64, False)
        dequant_gemv(a[:1, :200], **small, mma_layout=True)


@torch.no_grad()
def test_a_model_reordered_in_place_computes_and_saves_the_same(tmp_path):
    import transformers
    from testdata import tiny_hf_checkpoint

    from nanoserve.models.loader import load_model
    from nanoserve.models.triton_layers import use_triton_layers
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import save_quantized

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    tiny_hf_checkpoint(cfg, tmp_path / "float", seed=4)
    model = load_model(str(tmp_path / "float"), dtype="float32")[0]
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=128, lm_head=True),
                         progress=False)
    path = save_quantized(model, res, tmp_path / "q")
    model = load_model(str(path), dtype="float32")[0]
    use_triton_layers(model)  # q/k/v and gate/up stacked: their codes views of one tensor each
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    want, state = model(ids), {k: v.clone() for k, v in model.state_dict().items()}
    attn = model.model.layers[0].self_attn
    before = attn.qkv_proj.qweight.clone()
    # every layer (q, k, v, their stack, o, gate, up, their stack, down; the head)
    assert use_mma_layout(model) == 2 * 9 + 1
    assert attn.q_proj.mma_layout and attn.qkv_proj.mma_layout and model.lm_head.mma_layout
    assert torch.equal(attn.qkv_proj.qweight, to_mma_layout(before))  # reordered in place, once
    assert attn.q_proj.qweight.data_ptr() == attn.qkv_proj.qweight.data_ptr()  # still a view
    # on a CPU the codes in GPTQ's order ran the C kernel (kernels/cpu_packed_gemv.c), those in the
    # MMA layout run dequantize + F.linear: the same weights, float sums in another order
    torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
    saved = model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], v) for k, v in state.items())  # GPTQ's order on the way out
    assert use_mma_layout(model) == 0  # once
    with pytest.raises(NanoserveError, match="MMA layout cannot load a state dict"):
        model.lm_head.load_state_dict({k[len("lm_head."):]: v for k, v in state.items()
                                       if k.startswith("lm_head.")})


def test_layers_that_cannot_take_it_keep_gptqs_order():
    act_order, _ = _gptq_case(256, 64, 128, True)
    small_groups, _ = _gptq_case(256, 64, 32, False)
    layers = []
    for tensors, group in ((act_order, 128), (small_groups, 32)):
        q = QuantLinear(256, 64, 4, group, False, torch.float32)
        for name, t in tensors.items():
            getattr(q, name).copy_(t)
        layers.append(q)
    model = torch.nn.Sequential(*layers)
    assert use_mma_layout(model) == 0
    assert "act-order" in layers[0].mma_layout_problem()
    assert "groups of 32 rows" in layers[1].mma_layout_problem()
