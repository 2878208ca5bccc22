"""CUDA graphs for decode steps: capture the decode forward once per batch-size bucket, then replay
it (what vLLM, nano-vllm and mini-sglang do).

**Why.** A decode step at small batch launches a few hundred small kernels (about a dozen per
layer), and on a GPU the host can take longer to launch them than the device takes to run them:
the step is bound by Python and the driver, not by the GPU. A CUDA graph records the launches
once and replays all of them with one call.

**The price.** A graph replays exactly what it recorded: the same shapes, the same memory
addresses, no host logic in between. Hence
- *buckets*: one graph per batch size in `graph_buckets` (1, 2, 4, 8, then every 16); a step with
  B rows replays the smallest bucket ≥ B, and its extra rows are padding (slot −1: nothing is
  written; context 1 on block 0: a read whose result is thrown away);
- *static buffers* (`DecodeBuffers`): the forward's inputs live in tensors allocated once, at the
  largest bucket; each step copies its values into their first rows (`fill`) before the replay;
- *only pure decode steps*: every row one new token and one logit, on the Triton backend (the
  torch backend's fresh-block zeroing has a shape that changes every step). Prefill, chunked
  prefill and speculative verification run eagerly, as does everything on a CPU.
- the forward must not read anything back to the host: ModelRunner.execute reads nothing
  (tests/test_no_host_sync.py), and the split-KV count is fixed per bucket from the longest
  context the model allows (empty splits are neutral).
`LLM(..., enforce_eager=True)` turns graphs off. Taught in notebooks/02_* (the model runner).
"""

from __future__ import annotations

import torch

from ..kv.triton_backend import TritonAttentionMetadata


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def pick_bucket(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `batch` rows; None when none does (run eagerly)."""
    return next((b for b in buckets if b >= batch), None)


class DecodeBuffers:
    """The static inputs of the decode graphs, allocated once for `max_batch` rows of up to
    `max_blocks` blocks; `meta(b)` and the slices below are what a graph of bucket b reads."""

    def __init__(self, max_batch: int, max_blocks: int, max_context: int,
                 device: torch.device | str):
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, 1, **long)  # Bm, 1
        self.positions = torch.zeros(max_batch, 1, **long)  # Bm, 1
        self.slot_mapping = torch.full((max_batch, 1), -1, **long)  # Bm, 1
        int32 = dict(dtype=torch.int32, device=device)  # what the kernels read (triton_backend)
        self.block_tables = torch.zeros(max_batch, max_blocks, **int32)  # Bm, M
        self.context_lens = torch.ones(max_batch, **int32)  # Bm
        self.logit_index = torch.zeros(max_batch, 1, **long)  # Bm, 1: a decode row's only token
        self.rows = torch.arange(max_batch, **long)  # Bm: real-token indices of a full decode batch
        # unused by decode
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.max_context = max_context

    def meta(self, b: int) -> TritonAttentionMetadata:
        """Bucket b's attention metadata: views of the static buffers (their addresses never
        change)."""
        slots = self.slot_mapping[:b]  # b, 1
        return TritonAttentionMetadata(slots, self.block_tables[:b], self.context_lens[:b],
                                       cu_seqlens=self.cu_seqlens[:b + 1], src=self.rows[:b],
                                       dst=slots.view(-1), max_context=self.max_context,
                                       max_query_len=1, decode=True,
                                       prefix_lens=self.cu_seqlens[:b])

    def fill(self, inputs, b: int) -> int:
        """Copy one eager decode step's inputs (a ForwardInputs with B ≤ b rows) into the first B
        rows; rows B..b−1 become padding. Returns B. Device-to-device copies only."""
        meta = inputs.meta
        B, M = meta.block_tables.shape
        self.input_ids[:B].copy_(inputs.input_ids)
        self.positions[:B].copy_(inputs.positions)
        self.slot_mapping[:B].copy_(meta.slot_mapping)
        self.block_tables[:B, :M].copy_(meta.block_tables)
        # never read (past each row's context), but no stale values
        self.block_tables[:B, M:].zero_()
        self.context_lens[:B].copy_(meta.context_lens)
        self.pad(B, b)
        return B

    def pad(self, start: int, end: int) -> None:
        """Rows start..end−1 write nothing (slot −1) and read one key of block 0."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.block_tables[start:end] = 0
        self.context_lens[start:end] = 1


class CudaGraphRunner:
    """Decode graphs for a ModelRunner: `capture()` once, then `run(inputs)` for each decode step
    whose batch fits a bucket (`fits`)."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.runner, self.buckets = runner, graph_buckets(max_num_seqs)
        max_blocks = -(-max_model_len // runner.block_size)
        self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, max_model_len, runner.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def fits(self, num_rows: int) -> bool:
        """Whether a decode step of `num_rows` rows can replay a graph."""
        return pick_bucket(num_rows, self.buckets) is not None

    def _inputs(self, b: int):
        from .model_runner import ForwardInputs

        buf = self.buffers
        return ForwardInputs(buf.input_ids[:b], buf.positions[:b], buf.logit_index[:b], buf.meta(b))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, all in one memory pool. The buffers hold
        padding meanwhile, so the recorded forwards write no K/V."""
        self.buffers.pad(0, self.buckets[-1])
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            inputs = self._inputs(b)
            self.runner.execute(inputs)  # warm-up: Triton compiles its kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.runner.execute(inputs)  # b, 1, V
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def run(self, inputs) -> torch.Tensor:
        """Logits [B, 1, V] of a decode step, by replaying its bucket's graph."""
        b = pick_bucket(inputs.input_ids.shape[0], self.buckets)
        graph, out = self.graphs[b]
        B = self.buffers.fill(inputs, b)
        graph.replay()
        self.num_replays += 1
        return out[:B]
