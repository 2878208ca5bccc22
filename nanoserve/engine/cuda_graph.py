"""CUDA graphs for decode and verification steps: capture the forward once per batch-size bucket,
then replay it (what vLLM, nano-vllm and mini-sglang do).

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
- *decode steps*: every row one new token and one logit, on the Triton backend (the torch
  backend's fresh-block zeroing has a shape that changes every step);
- *verification steps* (speculative decoding, a chain of drafts): every row up to T = 1 + γ new
  tokens, each returning its logits. One graph per (batch bucket, T) for T = 2 .. 1 + γ
  (`VerifyBuffers`): a row with fewer tokens is padded at its end (slot −1: not written; the
  causal mask keeps its real tokens from seeing the padding), and every row counts as T tokens,
  so the packed layout the flash kernel reads has one shape per bucket. Their logits land in one
  shared buffer, so the graphs of all T cost the memory of the largest.
  Prefill, chunked prefill and token trees run eagerly, as does everything on a CPU.
- the forward must not read anything back to the host: ModelRunner.execute reads nothing
  (tests/test_no_host_sync.py), and the split-KV count is fixed per bucket from the longest
  context the model allows (empty splits are neutral).
`LLM(..., enforce_eager=True)` turns graphs off. Taught in notebooks/02_* (the model runner).
"""

from __future__ import annotations

from functools import partial

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


class VerifyBuffers:
    """The static inputs of the verification graphs: up to `max_batch` rows of exactly
    `max_tokens` new tokens (the graph of bucket (b, T) reads b rows of T tokens). The per-row
    tables are shared by every bucket (their first b rows); the per-token ones are a bucket's own
    (`views`: a [b, T] slice of a wider tensor would not be contiguous)."""

    def __init__(self, max_batch: int, max_tokens: int, max_blocks: int, max_context: int,
                 device: torch.device | str):
        int32 = dict(dtype=torch.int32, device=device)
        self.device = device
        self.max_tokens, self.max_context = max_tokens, max_context
        self.block_tables = torch.zeros(max_batch, max_blocks, **int32)  # Bm, M
        self.context_lens = torch.ones(max_batch, **int32)  # Bm: prefix + T
        self.prefix_lens = torch.zeros(max_batch, **int32)  # Bm: tokens cached before the step
        self.buckets: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (b, T): its views

    def views(self, b: int, T: int) -> dict[str, torch.Tensor]:
        """Bucket (b, T)'s inputs: contiguous copies' places, made once (their addresses are what
        the graph records)."""
        if (b, T) not in self.buckets:
            dev = self.device
            self.buckets[b, T] = {
                "input_ids": torch.zeros(b, T, dtype=torch.long, device=dev),
                "positions": torch.zeros(b, T, dtype=torch.long, device=dev),
                "slot_mapping": torch.full((b, T), -1, dtype=torch.long, device=dev),
                "logit_index": torch.arange(T, device=dev).repeat(b, 1),  # b, T: every position
                "cu_seqlens": torch.arange(0, (b + 1) * T, T, dtype=torch.int32, device=dev),
                "src": torch.arange(b * T, device=dev),  # every token counts as real
            }
        return self.buckets[b, T]

    def meta(self, b: int, T: int) -> TritonAttentionMetadata:
        """Bucket (b, T)'s attention metadata: rows of T tokens after `prefix_lens` cached ones."""
        v = self.views(b, T)
        return TritonAttentionMetadata(v["slot_mapping"], self.block_tables[:b],
                                       self.context_lens[:b], cu_seqlens=v["cu_seqlens"],
                                       src=v["src"], dst=v["slot_mapping"].view(-1),
                                       max_context=self.max_context, max_query_len=T,
                                       decode=False, prefix_lens=self.prefix_lens[:b])

    def fill(self, inputs, b: int, T: int) -> int:
        """Copy one eager verification forward's inputs (B ≤ b rows of at most T tokens, each
        row's real tokens first) into bucket (b, T)'s buffers; the rest becomes padding. Returns
        B. Device-to-device copies only."""
        meta, v = inputs.meta, self.views(b, T)
        B, M = meta.block_tables.shape
        n = inputs.input_ids.shape[1]
        v["input_ids"][:B, :n].copy_(inputs.input_ids)
        v["input_ids"][:B, n:] = 0
        v["positions"][:B, :n].copy_(inputs.positions)
        v["positions"][:B, n:] = inputs.positions[:, -1:]  # a real position: RoPE stays in range
        v["slot_mapping"][:B, :n].copy_(meta.slot_mapping)
        v["slot_mapping"][:B, n:] = -1
        self.block_tables[:B, :M].copy_(meta.block_tables)
        self.block_tables[:B, M:].zero_()
        self.prefix_lens[:B].copy_(meta.prefix_lens)
        torch.add(meta.prefix_lens, T, out=self.context_lens[:B])
        self.pad(B, b, T)
        return B

    def pad(self, start: int, end: int, T: int) -> None:
        """Rows start..end−1 write nothing (slot −1) and read nothing cached."""
        v = self.views(end, T)
        v["input_ids"][start:end] = 0
        v["positions"][start:end] = 0
        v["slot_mapping"][start:end] = -1
        self.block_tables[start:end] = 0
        self.prefix_lens[start:end] = 0
        self.context_lens[start:end] = T


class CudaGraphRunner:
    """Decode graphs for a ModelRunner: `capture()` once, then `run(inputs)` for each decode step
    whose batch fits a bucket (`fits`); with `max_verify_tokens` > 1, verification graphs too
    (`fits_verify`, `run_verify`)."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int,
                 max_verify_tokens: int = 1):
        self.runner, self.buckets = runner, graph_buckets(max_num_seqs)
        max_blocks = -(-max_model_len // runner.block_size)
        self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, max_model_len, runner.device)
        Bm, V = self.buckets[-1], runner.config.vocab_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits = torch.zeros(Bm, 1, V, device=runner.device)  # Bm, 1, V: every decode graph's
        self.verify = None  # VerifyBuffers, when verification steps replay graphs too
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if max_verify_tokens > 1:
            self.verify = VerifyBuffers(Bm, max_verify_tokens, max_blocks, max_model_len,
                                        runner.device)
            # Bm, Tm, V: every verification graph's
            self.verify_logits = torch.zeros(Bm, max_verify_tokens, V, device=runner.device)
        self.pool = None  # the graphs' one memory pool
        self.num_replays = 0

    def fits(self, num_rows: int) -> bool:
        """Whether a decode step of `num_rows` rows can replay a graph."""
        return pick_bucket(num_rows, self.buckets) is not None

    def fits_verify(self, num_rows: int, num_tokens: int) -> bool:
        """Whether a verification forward of `num_rows` rows of at most `num_tokens` new tokens
        can replay a graph."""
        return (self.verify is not None and num_tokens <= self.verify.max_tokens
                and self.fits(num_rows))

    def _inputs(self, b: int):
        from .model_runner import ForwardInputs

        buf = self.buffers
        return ForwardInputs(buf.input_ids[:b], buf.positions[:b], buf.logit_index[:b], buf.meta(b))

    def verify_inputs(self, b: int, T: int):
        """Bucket (b, T)'s ForwardInputs: what its graph records."""
        from .model_runner import ForwardInputs

        v = self.verify.views(b, T)
        return ForwardInputs(v["input_ids"], v["positions"], v["logit_index"],
                             self.verify.meta(b, T))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, all in one memory pool; with verification,
        one per (bucket, T) too. The buffers hold padding meanwhile, so the recorded forwards write
        no K/V. Each graph copies its logits into a buffer its kind shares, so the graphs of all
        buckets cost the memory of the largest."""
        self.buffers.pad(0, self.buckets[-1])
        for b in reversed(self.buckets):
            self.graphs[b] = self._record(partial(self._decode_forward, b))
        if self.verify is None:
            return
        for T in range(self.verify.max_tokens, 1, -1):
            for b in reversed(self.buckets):
                self.verify.pad(0, b, T)
                self.verify_graphs[b, T] = self._record(partial(self._verify_forward, b, T))

    def _decode_forward(self, b: int) -> None:
        self.logits[:b].copy_(self.runner.execute(self._inputs(b)))  # b, 1, V

    def _verify_forward(self, b: int, T: int) -> None:
        self.verify_logits[:b, :T].copy_(self.runner.execute(self.verify_inputs(b, T)))

    def _record(self, forward):
        """A CUDA graph of `forward`, run once first outside the capture (Triton compiles its
        kernels then)."""
        forward()
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        torch.cuda.synchronize()
        return graph

    def run(self, inputs) -> torch.Tensor:
        """Logits [B, 1, V] of a decode step, by replaying its bucket's graph. A view of the shared
        buffer: read it before the next replay (stream order sees to that on a GPU)."""
        b = pick_bucket(inputs.input_ids.shape[0], self.buckets)
        B = self.buffers.fill(inputs, b)
        self.graphs[b].replay()
        self.num_replays += 1
        return self.logits[:B]

    def run_verify(self, inputs) -> torch.Tensor:
        """Logits [B, T, V] of a verification forward (every position of each row), by replaying
        its bucket's graph; row i's first n_i positions are its own. A view of the shared buffer:
        read it before the next replay."""
        b = pick_bucket(inputs.input_ids.shape[0], self.buckets)
        T = inputs.input_ids.shape[1]
        B = self.verify.fill(inputs, b, T)
        self.verify_graphs[b, T].replay()
        self.num_replays += 1
        return self.verify_logits[:B, :T]
