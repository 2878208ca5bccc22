"""One pipeline stage's model runner: `LLM(model, pipeline_parallel_size=N)`, rank s holding stage
s.

Every rank runs the same steps (rank 0 sends them: workers.py) and prepares the same inputs — the
token ids, positions, slot mapping and block tables of the step's rows — but computes only its stage
(pipeline.py):

    stage 0        embeddings + its blocks  ──send [b, T, C]──►
    stage s        ──recv──► its blocks ──send──►
    stage N − 1    ──recv──► its blocks, the final norm, the LM head at the rows' logit positions
                   ──send logits [b, K, V] back to stage 0──►  (rank 0 samples)

Each rank's paged KV pool holds its own layers (PagedKVCache `layers`: its blocks' numbers; the
layers keep their numbers, so a sliding-window layer is still the same layer), with the same block
numbers on every rank: the one block table of rank 0's allocator serves every stage.

Micro-batches: each forward's rows are cut into up to N parts that flow through the stages one after
the other (GPipe's order for a forward): while stage 1 computes part 0, stage 0 computes part 1.
Sends are asynchronous (`isend`), so no stage waits for the next to take its activations, and no two
stages can each wait on the other's send. Within a step, N stages and m parts take N + m − 1
part-times instead of N·m; steps themselves do not overlap (the scheduler needs a step's tokens
before it plans the next), which vLLM's "virtual engines" do by keeping N independent batches in
flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.model_runner import ModelRunner
from .pipeline import split_layers, stage_forward


class PipelineRunner(ModelRunner):
    """Stage `stage` of `num_stages` over `model` (already reduced to that stage:
    pipeline.keep_stage)."""

    def __init__(self, model, stage: int, num_stages: int, num_layers: int, num_blocks: int,
                 block_size: int,
                 attention_backend: str | None = None, kv_cache_dtype: str = "auto"):
        layers = split_layers(num_layers, num_stages)[stage]
        super().__init__(model, num_blocks, block_size, attention_backend, kv_cache_dtype,
                         kv_layers=layers)
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.microbatches = num_stages  # parts per forward (fewer when it has fewer rows)

    def _forward(self, seqs, num_new: list[int], num_logits: list[int], trees=None) -> torch.Tensor:
        """logits [B, K, V] on stage 0 (the last stage's, sent back); on the other stages [B, K, 0]:
        only rank 0 samples, and ModelRunner.run slices the same rows out of it."""
        B = len(seqs)
        # (the asynchronous sends, and each part's [b, K] for the logits coming back)
        sends, shapes = [], []
        # none empty
        for part in (r.tolist() for r in torch.arange(B).tensor_split(min(self.microbatches, B))):
            inputs = self.prepare([seqs[i] for i in part], [num_new[i] for i in part],
                                  [num_logits[i] for i in part])
            shapes.append(tuple(inputs.logit_index.shape))  # b, K
            # b, T, C activations; the last stage: b, K, V logits
            y = self._stage(inputs).contiguous()
            # (y kept alive until sent)
            sends.append((dist.isend(y, dst=0 if self.last else self.stage + 1), y))
        logits = [self._receive_logits(b, K) for b, K in shapes] if self.first else []
        for work, _ in sends:
            work.wait()
        if not self.first:
            return torch.empty(B, max(num_logits), 0)
        K = max(k for _, k in shapes)
        # B, K, V
        return torch.cat([torch.nn.functional.pad(x, (0, 0, 0, K - x.shape[1])) for x in logits])

    @torch.inference_mode()
    def _stage(self, inputs) -> torch.Tensor:
        """This stage's share of one forward: ids (stage 0) or the previous stage's activations in,
        ours out."""
        x = inputs.input_ids
        if not self.first:
            B, T = x.shape
            x = torch.empty(B, T, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.stage - 1)
        view = self.kv.bind(inputs.meta)
        y = stage_forward(self.model, x, inputs.positions, self.first, self.last, view,
                          inputs.logit_index)
        return y.float() if self.last else y

    def _receive_logits(self, b: int, K: int) -> torch.Tensor:
        # float32, as the last stage sent
        logits = torch.empty(b, K, self.config.vocab_size, device=self.device)
        dist.recv(logits, src=self.num_stages - 1)
        return logits

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of one full forward without a cache (LLM.logits), through every stage; [T,
        0] on the stages but the first."""
        T = len(ids)
        positions = torch.arange(T, device=self.device)[None]  # 1, T
        x = torch.tensor([ids], device=self.device)
        if not self.first:
            x = torch.empty(1, T, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.stage - 1)
        y = stage_forward(self.model, x, positions, self.first, self.last)
        if self.last:
            dist.send(y.float().contiguous(), dst=0)  # 1, T, V
        else:
            dist.send(y.contiguous(), dst=self.stage + 1)  # 1, T, C
        if not self.first:
            return torch.empty(T, 0)
        out = torch.empty(1, T, self.config.vocab_size, device=self.device)
        dist.recv(out, src=self.num_stages - 1)
        return out[0]

