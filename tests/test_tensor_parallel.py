"""Tensor parallelism (nanoserve/parallel/): a model split over 2 (or 4) gloo processes on this CPU
must compute what one process computes.

Oracle: the same checkpoint in one process (itself proven against transformers in
test_models_parity.py). Logits within 1e-5 (fp32; the all-reduces sum the rows' partial products in
another order) and 64 greedy tokens identical, on GPT-2 (fused qkv, biases, tied and
vocabulary-padded: 257 ids over 2 ranks), a GQA Llama (untied head), Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms) over 4 ranks, which has 2 KV heads: each rank keeps a replica of the one its
query heads share. Negative control: a row-parallel layer that skips its all-reduce. Refused by
name: heads not divisible by the ranks, OLMo 2's whole-projection q/k norm, MoE.
"""

from __future__ import annotations

import gc

import pytest
import torch

from nanoserve import LLM, NanoserveError
from nanoserve.parallel import tensor_parallel
from nanoserve.parallel.launch import tp_forward, tp_greedy
from nanoserve.parallel.tensor_parallel import tp_unsupported

IDS = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 90]


@pytest.mark.parametrize("case,world",
                         [("gpt2", 2), ("llama-gqa", 2), ("qwen2-bias", 2), ("qwen3-window", 4)])
def test_split_logits_equal_one_process(hf_checkpoints, case, world):
    path = hf_checkpoints[case][0]
    want = LLM(str(path), dtype="float32").logits(IDS)
    got = tp_forward(path, IDS, world)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_greedy_tokens_equal_one_process(hf_checkpoints):
    path = hf_checkpoints["llama-gqa"][0]
    from nanoserve import SamplingParams

    want = LLM(str(path), dtype="float32").generate([IDS],
                                                    SamplingParams(temperature=0, max_tokens=64,
                                                                          ignore_eos=True),
                                                    use_tqdm=False)
    assert tp_greedy(path, IDS, 64, 2) == want[0].outputs[0].token_ids


class _NoAllReduce(tensor_parallel.RowParallelLinear):
    def forward(self, x):  # each rank keeps its partial product: the mutant
        y = torch.nn.functional.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


# (module level: the spawned ranks import it by name)
def _shard_without_all_reduce(model, rank, world_size):
    tensor_parallel.shard_model(model, rank, world_size)
    for m in model.modules():
        if isinstance(m, tensor_parallel.RowParallelLinear):
            m.__class__ = _NoAllReduce


def test_a_row_parallel_layer_without_its_all_reduce_is_caught(hf_checkpoints):
    path = hf_checkpoints["llama-gqa"][0]
    want = LLM(str(path), dtype="float32").logits(IDS)
    got = tp_forward(path, IDS, 2, shard=_shard_without_all_reduce)
    assert (got - want).abs().max().item() > 1e-2


def test_an_mlp_over_two_processes_sums_its_partials_by_one_all_reduce():
    """launch.mlp_over_ranks, notebook 16's hand-over: each rank's partial sum alone is not the MLP
    (the control), their sum plus the bias is, and after the all-reduce every rank holds it."""
    from torch import nn
    from torch.nn import functional as F

    from nanoserve.parallel.launch import mlp_over_ranks

    torch.manual_seed(0)
    up, down, x = nn.Linear(16, 64), nn.Linear(64, 16), torch.randn(5, 16)
    with torch.no_grad():
        whole = down(F.gelu(up(x)))
    ranks = mlp_over_ranks(up, down, x, world_size=2)
    assert [r["units"] for r in ranks] == [(0, 31), (32, 63)]
    assert all(torch.allclose(r["output"], whole, atol=1e-5) for r in ranks)
    assert torch.allclose(ranks[0]["partial"] + ranks[1]["partial"] + down.bias, whole, atol=1e-5)
    assert not torch.allclose(ranks[0]["partial"] + down.bias, whole, atol=1e-2)


@pytest.mark.parametrize("case,world,match", [("llama-gqa", 4, "n_heads=6 is not divisible by 4"),
                                               ("olmo2", 2, "whole projection"),
                                               ("mixtral", 2, "mixture-of-experts")])
def test_what_cannot_be_split_is_refused_by_name(hf_checkpoints, case, world, match):
    model = LLM(str(hf_checkpoints[case][0]), dtype="float32").model
    assert match in tp_unsupported(model.config, world)
    with pytest.raises(NanoserveError, match=match):
        tensor_parallel.shard_model(model, 0, world)


def test_a_quantized_model_is_refused_before_any_weight_is_split(hf_checkpoints):
    model = LLM(str(hf_checkpoints["llama-gqa"][0]), dtype="float32", quantization="int8").model
    with pytest.raises(NanoserveError, match="splits float nn.Linear layers, not a"):
        tensor_parallel.shard_model(model, 0, 2)


# (module level: the spawned ranks import it by name)
def _rank_with_exit_hook(rank, world_size, folder):
    import atexit
    from pathlib import Path

    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)  # a collective, as every sharded forward makes
    Path(folder, f"ran{rank}").write_text(str(t.tolist()))
    atexit.register(lambda: Path(folder,
                                 f"finalized{rank}").write_text("Python shut down normally"))


def test_finished_ranks_skip_the_interpreters_shutdown(tmp_path):
    """launch.spawn_ranks ends a rank that returned with os._exit: a gloo thread still freeing its
    last work's tensors at shutdown aborts the process (SIGABRT after the work is done:
    launch.exit_without_finalizing). The rank's work ran (its file, the all-reduced sum) and its
    atexit hook did not: no shutdown happened."""
    from nanoserve.parallel.launch import spawn_ranks

    spawn_ranks(_rank_with_exit_hook, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran0", "ran1"]
    assert (tmp_path / "ran1").read_text() == "[2.0, 2.0, 2.0]"


@pytest.fixture(scope="module")
def gptq_gpt2(hf_checkpoints, tmp_path_factory):
    """The tiny GPT-2, 4-bit GPTQ (round-to-nearest codes, groups of 8) saved as a GPTQ checkpoint:
    {group: dir}."""
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import save_quantized

    src, out = hf_checkpoints["gpt2"][0], {}
    for group in (8, 16):
        model = LLM(str(src), dtype="float32").model
        res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=group),
                             progress=False)
        out[group] = save_quantized(model, res, tmp_path_factory.mktemp(f"gptq{group}"),
                                    tokenizer_from=str(src))
    return out


def test_a_gptq_model_splits_by_its_codes(gptq_gpt2):
    """Each shard's Ŵ is exactly its slice of the whole layer's Ŵ (columns: any outputs; rows: whole
    groups), and the split model's logits over 2 processes equal one process's; the engine over 2
    ranks gives its tokens, and so does the engine in 2 pipeline stages."""
    from nanoserve.parallel.quant_shard import column_shard, row_shard
    from nanoserve.quant.qlinear import QuantLinear

    model = LLM(str(gptq_gpt2[8]), dtype="float32").model
    attn = model.transformer.h[0].attn
    assert isinstance(attn.c_attn, QuantLinear)
    whole_in, whole_out = attn.c_attn.dequantize(), attn.c_proj.dequantize()  # [3C, C], [C, C]
    # any outputs (8: the zeros' packing word)
    outputs = torch.tensor([0, 5, 13, 47, 96, 100, 101, 143])
    assert torch.equal(column_shard(attn.c_attn, outputs).dequantize(), whole_in[outputs])
    inputs = torch.arange(24, 48)  # rank 1 of 2: groups 3..5 of 8 inputs
    assert torch.equal(row_shard(attn.c_proj, inputs).dequantize(), whole_out[:, inputs])
    ids = IDS[:8]
    want = LLM(str(gptq_gpt2[8]), dtype="float32").logits(ids)
    assert torch.allclose(tp_forward(gptq_gpt2[8], ids, 2), want, rtol=1e-5, atol=1e-5)
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(str(gptq_gpt2[8]), dtype="float32").generate([ids], params,
                                                           use_tqdm=False)[0].outputs[0].token_ids
    split = LLM(str(gptq_gpt2[8]), dtype="float32", tensor_parallel_size=2)
    assert split.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == one
    del split
    gc.collect()  # (its workers stopped: the next engine starts a group of its own)
    # whole quantized blocks per stage
    staged = LLM(str(gptq_gpt2[8]), dtype="float32", pipeline_parallel_size=2)
    assert staged.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == one
    assert torch.allclose(staged.logits(ids), want, rtol=1e-5, atol=1e-5)
    del staged
    gc.collect()


def test_a_quantized_split_inside_a_group_is_refused_by_name(gptq_gpt2):
    """48 inputs in groups of 16 do not split into 2 whole numbers of groups: refused before
    anything is split."""
    model = LLM(str(gptq_gpt2[16]), dtype="float32").model
    with pytest.raises(NanoserveError,
                       match="quantized c_proj cannot be split: its 48 inputs in groups of 16"):
        tensor_parallel.shard_model(model, 0, 2)


def test_a_quantized_lm_head_splits_by_its_rows(tmp_path):
    """A GPTQ LM head (`lm_head=True`, vocabulary 264) over 2 ranks: shares of 136 and 128 rows
    (multiples of the 8-code word), the logits equal one process's."""
    import transformers
    from testdata import tiny_hf_checkpoint

    from nanoserve.parallel.tensor_parallel import ParallelLMHead
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import save_quantized

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
                                   max_position_embeddings=128, tie_word_embeddings=True)
    tiny_hf_checkpoint(cfg, tmp_path / "float", seed=5)
    model = LLM(str(tmp_path / "float"), dtype="float32").model
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=32, lm_head=True),
                         progress=False)
    path = save_quantized(model, res, tmp_path / "q", tokenizer_from=str(tmp_path / "float"))
    shares = []
    for rank in (0, 1):
        split = LLM(str(path), dtype="float32").model
        tensor_parallel._shard_vocab(split, rank, 2)
        assert isinstance(split.lm_head, ParallelLMHead)
        shares.append(split.lm_head.quantized.out_features)
    assert shares == [136, 128]
    want = LLM(str(path), dtype="float32").logits(IDS)
    assert torch.allclose(tp_forward(path, IDS, 2), want, rtol=1e-5, atol=1e-5)
