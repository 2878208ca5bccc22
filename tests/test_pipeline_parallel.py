"""Pipeline parallelism (nanoserve/parallel/pipeline.py): the blocks in stages over gloo processes,
micro-batches.

The oracle is one process's forward (LLM.logits, itself proven against HF transformers): logits
within 1e-5 for a batch of 4 sequences through 2 stages in 2 micro-batches on GPT-2 and a GQA Llama,
and through 3 stages in 4 micro-batches on Gemma 2 (a final soft-cap on the last stage); 64 greedy
tokens equal one process's. The recorded schedule keeps its order: a stage starts a micro-batch only
after the stage before finished it. The negative
control: a last stage that skips its blocks misses the logits.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, NanoserveError
from nanoserve.parallel.pipeline import pp_forward, pp_greedy, split_layers

BATCH = [[5, 17, 99, 3, 42, 8, 77], [8, 77, 1, 64, 23, 11, 90], [1, 2, 3, 4, 5, 6, 7],
         [9, 9, 9, 1, 1, 1, 2]]


@pytest.mark.parametrize("case,stages,microbatches",
                         [("gpt2", 2, 2), ("llama-gqa", 2, 2), ("gemma2", 3, 4)])
def test_stages_give_one_process_logits(hf_checkpoints, case, stages, microbatches):
    path = hf_checkpoints[case][0]
    want = torch.stack([LLM(str(path), dtype="float32").logits(ids) for ids in BATCH])  # B, T, V
    got, spans = pp_forward(path, BATCH, stages, microbatches)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert [len(r) for r in spans] == [microbatches] * stages
    for s in range(1, stages):  # micro-batch i reaches stage s only once stage s − 1 finished it
        assert all(spans[s][i][0] >= spans[s - 1][i][1] for i in range(microbatches))


def test_greedy_tokens_through_the_stages_are_one_process_s(hf_checkpoints):
    path = hf_checkpoints["llama-gqa"][0]
    from nanoserve import SamplingParams

    want = LLM(str(path), dtype="float32").generate([BATCH[0]],
                                                    SamplingParams(temperature=0, max_tokens=64,
                                                                              ignore_eos=True),
                                                    use_tqdm=False)
    assert pp_greedy(path, BATCH[0], 64, 2) == want[0].outputs[0].token_ids


def test_a_stage_that_skips_its_blocks_is_caught(hf_checkpoints):
    path = hf_checkpoints["gpt2"][0]
    want = torch.stack([LLM(str(path), dtype="float32").logits(ids) for ids in BATCH])
    got, _ = pp_forward(path, BATCH, 2, 2, skip_blocks=True)
    assert not torch.allclose(got, want, atol=1e-3)


def test_split_layers_and_refusals():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(NanoserveError, match="a model of 2 blocks splits into 1..2 stages"):
        split_layers(2, 3)
    with pytest.raises(NanoserveError, match="sequences of one length"):
        pp_forward("demo", [[1, 2], [1, 2, 3]], 2)
    with pytest.raises(NanoserveError, match="microbatches=3: 1..2"):
        pp_forward("demo", [[1, 2], [3, 4]], 2, 3)
