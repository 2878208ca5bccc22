"""`LLMEngine`: add_request / step / abort_request, continuous batching over a paged KV cache.

Data flows one way, as in vLLM and nano-vllm:

    request → InputProcessor (validate, tokenize) → Scheduler (which sequences, how many tokens;
    block slots from the BlockAllocator) → ModelRunner (one batched forward) → sampler (one
    batched draw) → Request.emit (text, stop conditions) → Scheduler.postprocess (sequence state)

`step()` reads as that: schedule → forward → update → sample; the scheduler owns every sequence's state. Speculation:
drafts join the rows before the forward (`_speculate`), verified after it (`SpecDecoder.accept`). n > 1 samples fork
after prefill (copy-on-write). A fault in one request fails it alone (`_fail_request`). Logprobs: engine/logprobs.py.
Taught in notebooks/00_* to 03_*.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from ..errors import NanoserveError, RequestFailedError, is_fatal
from ..kv.cache import num_blocks_for_budget
from ..kv.quant import kv_quant
from ..lora.serving import LoRAManager
from ..models.loader import load_model
from ..parallel.workers import ParallelConfig, make_runner, start_workers
from ..quant.online import check_quantization, quantize_on_load
from ..spec.spec_decode import SpecDecodeConfig, build_spec_decoder
from .block_allocator import BlockAllocator
from .grammar_limits import GrammarError, GrammarLimits
from .input_processor import InputProcessor
from .logprobs import record_prompt_logprobs, sampled_logprobs, wants_prompt_logits
from .outputs import EngineStats, RequestOutput
from .request import Prompt, Request, Sample, draw, logit_rows
from .sampler import SamplingParams, mask_from
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence as SequenceState
from .sequence import SequenceStatus
from .structured_output import mask_verification, row_bitmask

logger = logging.getLogger("nanoserve")
__all__ = ["LLMEngine", "EngineStats"]


class LLMEngine:
    """Continuous batching over a paged KV cache.

    KV cache: a pool of `num_blocks` blocks of `block_size` tokens, sized from `kv_cache_memory` bytes when given,
    else the bytes of 8 full-context sequences in the model's dtype; K/V in that dtype, or 8-bit with
    `kv_cache_dtype` "int8" / "fp8_e4m3" / "fp8_e5m2" (kv/quant.py). Prefix caching is on. Linears: 8-bit as they
    load with `quantization` "fp8" / "int8" / "llm.int8" (quant/online.py). Scheduling: at most `max_num_seqs`
    sequences and `max_num_batched_tokens` new tokens per step; chunked prefill on by default; `max_waiting` bounds
    the queue (None: unbounded). Attention (nanoserve/kv/): `attention_backend` "torch" (gather + SDPA), "triton"
    (nanoserve.kernels) or "cpu" (decode in C); None: triton on CUDA, cpu on the CPU, where they serve, else torch.
    On CUDA with triton, decode steps replay CUDA graphs unless `enforce_eager` (`cuda_graphs_off` says why not).
    `enable_lora`: requests may name a LoRA adapter (`lora_request`), `max_loras` of rank ≤ `max_lora_rank` per step.
    `tensor_parallel_size` / `pipeline_parallel_size`: the model split over as many ranks (nanoserve/parallel/).
    `grammar_limits`: what a structured-output constraint may ask for (engine/grammar_limits.py).
    """

    def __init__(self, model: str = "demo", dtype: str | torch.dtype | None = None, device: str | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, kv_cache_memory: int | None = None,
                 num_blocks: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, max_waiting: int | None = None,
                 attention_backend: str | None = None, speculative_model: str | None = None,
                 speculative: str | None = None, num_speculative_tokens: int = 4, speculative_adaptive: bool = True,
                 enforce_eager: bool = False, kv_cache_dtype: str = "auto", quantization: str | None = None,
                 speculative_cost: float | None = None, enable_lora: bool = False, max_loras: int = 4,
                 max_lora_rank: int = 16, speculative_tree=None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, grammar_limits: GrammarLimits | None = None):
        kv_quant(kv_cache_dtype)  # these and the speculative arguments are checked before any model loads
        check_quantization(quantization)
        spec_cfg = SpecDecodeConfig.from_args(speculative, num_speculative_tokens, speculative_model,
                                              speculative_adaptive, speculative_cost, speculative_tree)
        (parallel := ParallelConfig(tensor_parallel_size, pipeline_parallel_size)).check(spec_cfg, enable_lora)
        self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
        quantize_on_load(self.model, quantization)  # None: the checkpoint as it is
        self.model_name, self.max_model_len = str(model), self.config.max_position_embeddings
        self.device, self.dtype = next(self.model.parameters()).device, next(self.model.parameters()).dtype
        self.workers = start_workers(self, parallel, model)  # None, or the other ranks (parallel/workers.py)
        if num_blocks is None:  # from kv_cache_memory bytes; None: 8 full-context sequences
            num_blocks = num_blocks_for_budget(self.config, kv_cache_memory, block_size, self.dtype, kv_cache_dtype)
        sched_cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, max_waiting,
                                    max_loras if enable_lora else None)
        allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching, sliding_window=self.config.kv_window)
        self.scheduler = Scheduler(sched_cfg, allocator, self.max_model_len)
        lora = LoRAManager(self.model, self.config, max_loras, max_lora_rank, self.dtype) if enable_lora else None
        self.runner = make_runner(self.workers, self.model, num_blocks, block_size, attention_backend, kv_cache_dtype,
                                  lora)
        self.attention_backend = self.runner.attention_backend
        self.cuda_graphs_off = "enforce_eager=True" if enforce_eager else self.runner.use_cuda_graphs(
            max_num_seqs, self.max_model_len)  # decode steps replay CUDA graphs where they can; else why not
        self.inputs = InputProcessor(self.config, self.tokenizer, self.device, num_blocks, block_size,
                                     str(model), lora, grammar_limits)
        self.spec = None if spec_cfg is None else build_spec_decoder(spec_cfg, self)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_num_seqs = 0  # sequences in the latest forward (for occupancy plots)

    @property
    def block_allocator(self) -> BlockAllocator:
        """The KV block pool's bookkeeping (owned by the scheduler)."""
        return self.scheduler.block_allocator

    # ------------------------------------------------------------------ requests
    def new_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request=None) -> Request:
        """A validated request, queued nowhere yet (the batchers and the async engine queue it themselves), under
        `lora_request`'s adapter if given. Reads no scheduler state, so it may run while a step is in flight."""
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise NanoserveError(f"request id {rid!r} is already in use")
        return self.inputs.make_request(prompt, params, rid, priority, arrival_time, lora_request)

    def enqueue(self, req: Request) -> None:
        """Queue a request made by `new_request`; QueueFullError (and nothing registered) when full."""
        self.scheduler.add(req.samples[0].seq)
        self.requests[req.output.request_id] = req

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request=None) -> str:
        """Validate and queue a request; returns its id. NanoserveError for bad input, QueueFullError when full."""
        self.enqueue(req := self.new_request(prompt, params, request_id, priority, arrival_time, lora_request))
        return req.output.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its sequences leave the scheduler and their blocks return to the pool."""
        if (req := self.requests.pop(request_id, None)) is None:
            return
        for s in req.samples:
            if s.out.finish_reason is None:
                self.scheduler.finish(s.seq, SequenceStatus.ABORTED)
                s.out.finish_reason = "abort"
                s.out.text = s.text.text
        req.output.finish_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """The engine's state now, for monitoring (a server's /metrics)."""
        return EngineStats.of(self.scheduler, len(self.requests))

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """Schedule → forward → update → sample; the outputs of the requests that advanced (or failed).

        A fault while handling one request's row fails that request alone; a forward that raises fails every
        request in it (the fault cannot be pinned to a row); only a fatal error (errors.is_fatal: broken
        bookkeeping, a device fault) escapes and stops the engine."""
        sched = self.scheduler.schedule()
        self.last_num_seqs = len(sched.seqs)
        if not self._prepare(sched):
            return []
        done: dict[str, RequestOutput] = {}  # the outputs that advanced this step, by request id
        drafts = self._speculate(sched, done) if self.spec is not None else {}  # spec hook 1: {row: Proposal}
        start = time.perf_counter()
        logits = self._guarded(sched.seqs, done, self._forward, sched, drafts)  # [B, V], or [1 + γ, V] per row
        if logits is not None:
            to_sample = self._update(sched, logits, drafts, done)  # spec hook 2 inside: accept the drafts
            self._guarded([s.seq for _, s, _ in to_sample], done, self._sample, logits, to_sample, done)
        if self.spec is not None:  # spec hook 3: the step's time, for the controller's cost estimates
            self.spec.record_step(drafts, time.perf_counter() - start)
        return self._collect(done)

    def _prepare(self, sched: SchedulerOutput) -> bool:
        """Before the forward: copy-on-write copies, first-scheduled times; False when nothing runs."""
        for seq in sched.preempted if self.spec is not None else ():  # recomputed later: its draft cache too
            self.spec.proposer.free(seq)
        if not sched.seqs:
            return False
        for src, dst in sched.copies:  # before anyone writes into the copies
            self.runner.kv.copy_block(src, dst)
        now = time.perf_counter()
        for out, seq in ((self.requests[s.request_id].output, s) for s in sched.seqs):
            if out.first_scheduled_time is None:
                out.first_scheduled_time, out.num_cached_tokens = now, seq.num_cached_tokens
        return True

    def _forward(self, sched: SchedulerOutput, drafts: dict) -> torch.Tensor | list[torch.Tensor]:
        """logits [B, V], or a list: [1 + γ, V] per verification row, [n, V] per n-token chunk scoring its
        prompt (prompt logprobs), [1, V] per other row. Ids past the tokenizer's get -inf: never sampled."""
        num_logits = [1 + len(drafts[i].draft_ids) if i in drafts else n if wants_prompt_logits(
            self.requests[seq.request_id].output.prompt_logprobs, seq) else 1 for i, (seq, n) in enumerate(
            zip(sched.seqs, sched.num_new))]
        trees = self.spec.tree_kwargs(drafts, len(sched.seqs)) if drafts else {}  # Medusa's token trees, if any
        logits = self.runner.run(sched.seqs, sched.num_new, num_logits if max(num_logits) > 1 else None, **trees)
        if self.inputs.usable_vocab_size < self.config.vocab_size:
            logits = mask_from(logits, self.inputs.usable_vocab_size)
        return logits

    def _update(self, sched: SchedulerOutput, logits, drafts: dict, done: dict) -> list[tuple]:
        """After the forward: a verification row accepts its drafts and emits; every other row's computed tokens
        advance. Returns (request, sample, row of logits) for each sample due a token."""
        to_sample: list[tuple[Request, Sample, int]] = []
        for row, seq in enumerate(sched.seqs):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # its request failed earlier in this step
            self._guarded([seq], done, self._update_row, req, seq, row, sched.num_new[row], logits[row],
                          drafts.get(row), to_sample, done)
        return to_sample

    def _update_row(self, req: Request, seq: SequenceState, row: int, num_new: int, logits: torch.Tensor, proposal,
                    to_sample: list, done: dict) -> None:
        if proposal is not None:  # accept / reject the drafts, roll back, emit like any step
            if bool(logits.isnan().any()):
                raise RequestFailedError(f"the model produced NaN logits for request {seq.request_id!r} while "
                                         "verifying its drafts")
            s = req.samples[seq.sample_index]
            tokens = self.spec.accept(proposal, mask_verification(s.matcher, proposal.draft_ids, logits))  # grammar
            lps = sampled_logprobs(logits[proposal.logit_rows], [req.params] * len(tokens), tokens, self.tokenizer)
            tokens, finished = req.emit_all(s, tokens, lps)
            self.scheduler.postprocess(seq, tokens, finished)
            done[seq.request_id] = req.output
            return
        if wants_prompt_logits(req.output.prompt_logprobs, seq):
            record_prompt_logprobs(req.output.prompt_logprobs, seq, logits, req.params, self.tokenizer)
        self.scheduler.advance(seq, num_new)
        if seq.num_computed_tokens < len(seq):
            return  # a prefill chunk: no token to sample yet
        samples = [req.samples[seq.sample_index]]
        if len(req.samples) < req.params.n:  # prefill done: the other samples fork from here
            samples += self._fork(req, seq)
        to_sample += [(req, s, row) for s in samples]

    def _sample(self, logits, to_sample: list[tuple[Request, Sample, int]], done: dict) -> None:
        """One batched draw for every sample due a token (one device→host transfer), then emit each."""
        bitmasks = self._grammar_masks(to_sample, logits, done)  # a failing mask fails its row alone
        alive = [i for i, (req, _, _) in enumerate(to_sample)
                 if req.output.request_id in self.requests]
        to_sample, bitmasks = [to_sample[i] for i in alive], [bitmasks[i] for i in alive]
        if not to_sample:
            return
        x = logit_rows(logits, [row for _, _, row in to_sample])  # R, V
        tokens, nan, lps = draw(x, [(r, s) for r, s, _ in to_sample], self.tokenizer, bitmasks)
        for (req, s, _), token, has_nan, lp in zip(to_sample, tokens, nan, lps):
            if req.output.request_id in self.requests:
                self._guarded([s.seq], done, self._emit, req, s, token, has_nan, lp, done)

    def _grammar_masks(self, to_sample: list, logits, done: dict) -> list:
        """Each row's grammar mask (None without a grammar), computed one row at a time, so that a
        row whose grammar fails or runs over its time budget fails its request alone
        (grammar_limits.py)."""
        vocab = logits.shape[-1] if isinstance(logits, torch.Tensor) else logits[0].shape[-1]
        budget_s = self.inputs.grammars.limits.mask_budget_ms / 1e3
        bitmasks = []
        for req, s, _ in to_sample:
            bitmask = None
            if s.matcher is not None and req.output.request_id in self.requests:
                bitmask = self._guarded([s.seq], done, row_bitmask, s.matcher, vocab, budget_s,
                                        req.output.request_id)
            bitmasks.append(bitmask)
        return bitmasks

    def _emit(self, req: Request, s: Sample, token: int, has_nan: bool, lp, done: dict) -> None:
        """One sampled token: into the output (stop conditions, logprobs), then into the sequence."""
        if has_nan:
            raise RequestFailedError(f"the model produced NaN logits for request {req.output.request_id!r} at "
                                     f"position {len(s.seq)} (an overflow in {self.dtype}?)")
        finished = req.emit(s, token, lp)
        self.scheduler.postprocess(s.seq, [token], finished)
        done[req.output.request_id] = req.output

    def _collect(self, done: dict[str, RequestOutput]) -> list[RequestOutput]:
        for rid, out in done.items():
            if out.finished:
                out.finish_time = time.perf_counter()
                self.requests.pop(rid, None)
        return list(done.values())

    # ------------------------------------------------------------------ speculation, forks, faults
    def _speculate(self, sched: SchedulerOutput, done: dict) -> dict:
        """Spec hook 1: drafts for the decoding rows that speculate, appended (with KV slots) to their
        sequences; returns {row: Proposal}. If drafting fails, the drafting requests fail and leave
        `sched` (one batched draft forward: the fault cannot be pinned to a row)."""
        budget = self.scheduler.config.max_num_batched_tokens - sched.num_tokens  # leftover: no saturation
        rows = self.spec.plan(sched, self.requests, budget)  # [(row, seq, γ, params, generator)]
        if not rows:
            return {}
        proposals = self._guarded([r[1] for r in rows], done, self.spec.draft, sched, rows, self.runner.kv)
        if proposals is None:
            keep = [i for i, seq in enumerate(sched.seqs) if seq.request_id in self.requests]
            sched.seqs, sched.num_new = [sched.seqs[i] for i in keep], [sched.num_new[i] for i in keep]
            return {}
        return proposals

    def _fork(self, req: Request, parent: SequenceState) -> list[Sample]:
        children = []
        for i in range(1, req.params.n):
            sample = self.inputs.new_sample(req, child := parent.child(i), i)
            self.scheduler.fork(parent, child)
            req.samples.append(sample)  # at once: if a later step of the fork fails, aborting frees it
            req.output.outputs.append(sample.out)
            children.append(sample)
        return children

    def _guarded(self, seqs: list[SequenceState], done: dict, fn, *args):
        """fn(*args); if it raises a non-fatal error, the requests of `seqs` fail (and None is returned)."""
        try:
            return fn(*args)
        except Exception as e:
            if is_fatal(e):
                raise
            for rid in dict.fromkeys(seq.request_id for seq in seqs):
                if rid in self.requests:
                    done[rid] = self._fail_request(self.requests[rid], e)
            return None

    def _fail_request(self, req: Request, error: Exception) -> RequestOutput:
        """End one request with `error`: every sample stops, every block returns to the pool."""
        rid = req.output.request_id
        logger.error("request %s failed: %s: %s", rid, type(error).__name__, error, exc_info=error)
        self.abort_request(rid)
        for s in req.samples:
            if s.out.finish_reason == "abort":
                s.out.finish_reason = "error"
        req.output.error = f"{type(error).__name__}: {error}"
        req.output.error_is_bad_input = isinstance(error, GrammarError)  # the client's constraint
        return req.output
