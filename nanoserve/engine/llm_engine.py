"""`LLMEngine`: add_request / step / abort_request, continuous batching over a paged KV cache.

Data flows one way, as in vLLM and nano-vllm:

    request → InputProcessor (validate, tokenize) → Scheduler (which sequences, how many tokens;
    block slots from the BlockAllocator) → ModelRunner (one batched forward) → sampler (one
    batched draw) → Request.emit (text, stop conditions) → Scheduler.postprocess (sequence state)

`step()` reads as that: schedule → forward → update → sample; the scheduler owns every sequence's
state. Extensions that take part in a step do it as step hooks (`StepHook`: speculative decoding
drafts before the forward and verifies the rows it claimed after it). n > 1 samples fork after
prefill (copy-on-write). A fault in one request fails it alone (`isolated`, `_fail_request`).
Logprobs: engine/logprobs.py. Taught in notebooks/00_* to 03_*.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import EngineConfig
from ..errors import ConfigError, GrammarError, NanoserveError, RequestFailedError, is_fatal
from ..extension_points import extension
from ..kv.cache import num_blocks_for_budget
from ..models.loader import load_model
from .block_allocator import BlockAllocator
from .input_processor import InputProcessor, evicting
from .logprobs import record_prompt_logprobs, wants_prompt_logits
from .model_runner import ModelRunner
from .outputs import EngineStats, RequestOutput
from .request import Prompt, Request, Sample, draw, logit_rows
from .sampler import SamplingParams, mask_from
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger("nanoserve")
__all__ = ["LLMEngine", "EngineStats", "EngineStep", "StepHook"]


@dataclass
class EngineStep:
    """One step's working state as it flows through `LLMEngine.step()`: the scheduler's decision,
    the outputs that advanced, and what step hooks add. A hook may lengthen a row (speculation
    appends its drafts through the scheduler) and claim it: the row then returns
    `num_logits[row]` positions' logits and `handlers[row](logits)` handles them instead of the
    core, which advances and samples every other row."""

    sched: SchedulerOutput
    # advanced or failed, by request id
    done: dict[str, RequestOutput] = field(default_factory=dict)
    num_logits: dict[int, int] = field(default_factory=dict)  # claimed rows: logits each returns
    handlers: dict[int, Callable] = field(default_factory=dict)  # claimed rows: handler(logits)
    trees: list | None = None  # per row, a token tree's parents (None: a chain); None: no trees

    def drop_rows_of(self, requests: dict) -> None:
        """Leave out the rows whose request is no longer in `requests` (it failed this step)."""
        keep = [i for i, seq in enumerate(self.sched.seqs) if seq.request_id in requests]
        self.sched.seqs = [self.sched.seqs[i] for i in keep]
        self.sched.num_new = [self.sched.num_new[i] for i in keep]


class StepHook(Protocol):
    """An extension that takes part in every step (speculative decoding: spec/spec_decode.py)."""

    def before_forward(self, engine: LLMEngine, step: EngineStep) -> None:
        """After scheduling, before the forward: may lengthen and claim rows (see EngineStep)."""

    def after_forward(self, engine: LLMEngine, step: EngineStep, logits) -> None:
        """After the forward, before any row is handled: may decide for its claimed rows at once
        (speculation verifies every row's drafts in one batch)."""

    def after_step(self, engine: LLMEngine, step: EngineStep) -> None:
        """After every row was handled and sampled."""


class LLMEngine:
    """Continuous batching over a paged KV cache, set up by one `EngineConfig` (config/engine.py).

    KV cache: a pool of `num_blocks` blocks of `block_size` tokens, sized from `kv_cache_memory`
    bytes when given, else the bytes of 8 full-context sequences in the model's dtype; K/V in that
    dtype, or 8-bit (`kv_cache_dtype`, kv/quant.py). Prefix caching is on. Scheduling: at most
    `max_num_seqs` sequences and `max_num_batched_tokens` new tokens per step; chunked prefill on by
    default; `max_waiting` bounds the queue. Attention: `attention_backend` (nanoserve/kv/). On CUDA
    with triton, decode steps replay CUDA graphs unless `enforce_eager` (`cuda_graphs_off` says why
    not). The optional sections — speculative decoding, LoRA adapters, tensor or pipeline ranks,
    grammar limits — each set up their own part (nanoserve/spec/, lora/, parallel/).

        LLMEngine(EngineConfig.from_kwargs("demo", max_num_seqs=8))
        LLMEngine.from_kwargs("demo", max_num_seqs=8)          (the same)
    """

    def __init__(self, config: EngineConfig):
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"LLMEngine takes an EngineConfig, got {type(config).__name__}; "
                              "LLMEngine.from_kwargs(model, **kwargs) builds one from keyword "
                              "arguments")
        self.engine_config = config
        load, cache = config.load, config.cache
        parallel = None  # the extension that splits the model over ranks, when it is split
        if config.parallel.world_size > 1:
            parallel = extension("parallel")
            parallel.pin_rank_device(config.parallel)  # under torchrun: each rank's GPU, first
        self.model, self.config, self.tokenizer = load_model(load.model, load.dtype, load.device,
                                                             tokenizer_path=load.tokenizer)
        if load.quantization is not None:  # 8-bit linears as the model loads
            extension("quantization").quantize_on_load(self.model, load.quantization)
        self.model_name = str(load.model)
        self.max_model_len = self.config.max_position_embeddings
        weight = next(self.model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.workers = None  # the other ranks, when there are some
        if parallel is not None:
            self.workers = parallel.start_workers(self, config.parallel, load.model)
        num_blocks = cache.num_blocks
        if num_blocks is None:  # from kv_cache_memory bytes; None: 8 full-context sequences
            num_blocks = num_blocks_for_budget(self.config, cache.kv_cache_memory, cache.block_size,
                                               self.dtype, cache.kv_cache_dtype)
        allocator = BlockAllocator(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                   sliding_window=self.config.kv_window)
        lora = None
        if config.lora is not None:
            lora = extension("lora").LoRAManager(self.model, self.config, config.lora.max_loras,
                                                 config.lora.max_lora_rank, self.dtype)
        max_loras = None if config.lora is None else config.lora.max_loras
        self.scheduler = Scheduler(config.scheduler, allocator, self.max_model_len, max_loras)
        runner_args = (self.model, num_blocks, cache.block_size, cache.attention_backend,
                       cache.kv_cache_dtype)
        if parallel is None:
            self.runner = ModelRunner(*runner_args)
        else:  # rank 0's runner, which tells the other ranks what to run
            self.runner = parallel.make_runner(self.workers, *runner_args)
        if lora is not None:  # each forward under its rows' adapters
            self.runner.around_forward.append(lora.batch_context)
        self.attention_backend = self.runner.attention_backend
        self.cuda_graphs_off = "enforce_eager=True"  # why decode steps run eagerly (None: graphs)
        if not load.enforce_eager:
            spec = config.speculative  # verification graphs too, for rows of up to 1 + γ tokens
            verify_tokens = 1 if spec is None else spec.verify_tokens
            self.cuda_graphs_off = self.runner.use_cuda_graphs(config.scheduler.max_num_seqs,
                                                               self.max_model_len, verify_tokens)
        self.inputs = InputProcessor(self.config, self.tokenizer, self.device, num_blocks,
                                     cache.block_size, self.model_name, lora,
                                     config.structured_outputs, load.split_special_tokens)
        self.step_hooks: list = []  # extensions that take part in each step (StepHook)
        self.spec = None  # the speculative decoder, when speculation is on (spec/spec_decode.py)
        if config.speculative is not None:
            self.spec = extension("speculative").build_spec_decoder(config.speculative, self)
            self.step_hooks.append(self.spec)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_num_seqs = 0  # sequences in the latest forward (for occupancy plots)
        # tokens in the latest forward: prompt chunks, decode tokens, drafts (a server's /metrics)
        self.last_num_tokens = 0
        # async scheduling: each step launched before the last one's tokens reach the host
        self.overlap = None
        if config.scheduler.async_scheduling:
            self.overlap = extension("async_scheduling").OverlappedStep(self)

    @classmethod
    def from_kwargs(cls, model: str = "demo", **kwargs) -> LLMEngine:
        """An engine from flat keyword arguments (`max_num_seqs=8`; config/args.py's
        ENGINE_ARGS)."""
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def block_allocator(self) -> BlockAllocator:
        """The KV block pool's bookkeeping (owned by the scheduler)."""
        return self.scheduler.block_allocator

    # ------------------------------------------------------------------ requests
    def new_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request=None) -> Request:
        """A validated request, queued nowhere yet (the batchers and the async engine queue it
        themselves), under `lora_request`'s adapter if given. Reads no scheduler state, so it may
        run while a step is in flight."""
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise NanoserveError(f"request id {rid!r} is already in use")
        if params is not None and evicting(params) is not None:  # checked; its hook on first use
            extension("kv_eviction").admit(params.kv_eviction, self)
        return self.inputs.make_request(prompt, params, rid, priority, arrival_time, lora_request)

    def enqueue(self, req: Request) -> None:
        """Queue a request made by `new_request`; QueueFullError (and nothing registered) when
        full."""
        self.scheduler.add(req.samples[0].seq)
        self.requests[req.output.request_id] = req

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request=None) -> str:
        """Validate and queue a request; returns its id. NanoserveError for bad input,
        QueueFullError when full."""
        req = self.new_request(prompt, params, request_id, priority, arrival_time, lora_request)
        self.enqueue(req)
        return req.output.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its sequences leave the scheduler and their blocks return to the
        pool."""
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
        """One iteration: the outputs of the requests that advanced (or failed). With
        async_scheduling, a step whose tokens come back one step late (engine/async_step.py);
        else `sync_step`."""
        if self.overlap is not None:
            return self.overlap.step()
        return self.sync_step()

    def sync_step(self) -> list[RequestOutput]:
        """Schedule → forward → update → sample; the outputs of the requests that advanced (or
        failed).

        A fault while handling one request's row fails that request alone; a forward that raises
        fails every request in it (the fault cannot be pinned to a row); only a fatal error
        (errors.is_fatal: broken bookkeeping, a device fault) escapes and stops the engine."""
        step = EngineStep(self.scheduler.schedule())
        self.last_num_seqs = len(step.sched.seqs)
        self.last_num_tokens = 0
        if not self._prepare(step.sched):
            return []
        # e.g. speculation: drafts join their rows (spec/spec_decode.py)
        for hook in self.step_hooks:
            hook.before_forward(self, step)
        self.last_num_tokens = step.sched.num_tokens  # the drafts included
        logits = self.isolated(step.sched.seqs, step.done, self._forward, step)  # [B, V] or per row
        if logits is not None:
            for hook in self.step_hooks:
                hook.after_forward(self, step, logits)
            to_sample = self._update(step, logits)
            self._sample(step, logits, to_sample)
        for hook in self.step_hooks:  # e.g. speculation: the step's time, for its cost estimates
            hook.after_step(self, step)
        return self._collect(step.done)

    def _prepare(self, sched: SchedulerOutput) -> bool:
        """Before the forward: copy-on-write copies, first-scheduled times; False when nothing
        runs."""
        if not sched.seqs:
            return False
        for src, dst in sched.copies:  # before anyone writes into the copies
            self.runner.kv.copy_block(src, dst)
        now = time.perf_counter()
        for seq in sched.seqs:
            out = self.requests[seq.request_id].output
            if out.first_scheduled_time is None:
                out.first_scheduled_time = now
                out.num_cached_tokens = seq.num_cached_tokens
        return True

    def _forward(self, step: EngineStep) -> torch.Tensor | list[torch.Tensor]:
        """logits [B, V], or a list: [k, V] per row that returns k > 1 positions' logits (a claimed
        row's, or an n-token chunk scoring its prompt for prompt logprobs), [1, V] per other row.
        Ids past the tokenizer's get -inf: never sampled."""
        sched = step.sched
        num_logits = [self._logits_wanted(row, seq, n, step)
                      for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_new))]
        wanted = num_logits if max(num_logits) > 1 else None
        if step.trees is None:
            logits = self.runner.run(sched.seqs, sched.num_new, wanted)
        else:  # some rows are token trees (Medusa's)
            logits = self.runner.run(sched.seqs, sched.num_new, wanted, trees=step.trees)
        if self.inputs.usable_vocab_size < self.config.vocab_size:
            logits = mask_from(logits, self.inputs.usable_vocab_size)
        return logits

    def _logits_wanted(self, row: int, seq: Sequence, num_new: int, step: EngineStep) -> int:
        """How many of a row's last positions return logits: what a step hook that claimed the row
        asked for; all of a prompt chunk scoring its prompt (prompt logprobs); else one."""
        if row in step.num_logits:
            return step.num_logits[row]
        if wants_prompt_logits(self.requests[seq.request_id].output.prompt_logprobs, seq):
            return num_new
        return 1

    def _update(self, step: EngineStep, logits) -> list[tuple[Request, Sample, int]]:
        """After the forward: a claimed row goes to its hook's handler; every other row's computed
        tokens advance. Returns (request, sample, row of logits) for each sample due a token."""
        to_sample: list[tuple[Request, Sample, int]] = []
        sched = step.sched
        for row, seq in enumerate(sched.seqs):
            if seq.request_id not in self.requests:
                continue  # its request failed earlier in this step
            handler = step.handlers.get(row)
            if handler is not None:  # e.g. speculation: accept the drafts, emit
                self.isolated([seq], step.done, handler, logits[row])
            else:
                self.isolated([seq], step.done, self._update_row, seq, row, sched.num_new[row],
                              logits[row], to_sample, step.done)
        return to_sample

    def _update_row(self, seq: Sequence, row: int, num_new: int, logits: torch.Tensor,
                    to_sample: list, done: dict) -> None:
        req = self.requests[seq.request_id]
        if wants_prompt_logits(req.output.prompt_logprobs, seq):
            record_prompt_logprobs(req.output.prompt_logprobs, seq, logits, req.params,
                                   self.tokenizer)
        self.scheduler.advance(seq, num_new)
        if seq.num_computed_tokens < len(seq):
            return  # a prefill chunk: no token to sample yet
        samples = [req.samples[seq.sample_index]]
        if len(req.samples) < req.params.n:  # prefill done: the other samples fork from here
            samples += self._fork(req, seq)
        if req.max_new == 0:  # max_tokens=0: the prompt is scored, no token is drawn
            self._finish_unsampled(req, samples, done)
            return
        for sample in samples:
            to_sample.append((req, sample, row))

    def _finish_unsampled(self, req: Request, samples: list[Sample], done: dict) -> None:
        """End samples at their prefill, with no token: finish reason "length" (max_tokens=0 was
        reached), blocks back to the pool (the prompt's full blocks stay in the prefix cache)."""
        for sample in samples:
            sample.out.finish_reason = "length"
            self.scheduler.finish(sample.seq)
        done[req.output.request_id] = req.output

    def _sample(self, step: EngineStep, logits,
                to_sample: list[tuple[Request, Sample, int]]) -> None:
        """One batched draw for every sample due a token (one device→host transfer), then emit each.
        A failing draw fails every request in it; a failing mask or emit, its own request."""
        bitmasks = self._grammar_masks(to_sample, logits, step.done)  # a failing mask fails its row
        alive = [i for i, (req, _,
                           _) in enumerate(to_sample) if req.output.request_id in self.requests]
        to_sample = [to_sample[i] for i in alive]
        bitmasks = [bitmasks[i] for i in alive]
        if not to_sample:
            return
        seqs = [sample.seq for _, sample, _ in to_sample]
        drawn = self.isolated(seqs, step.done, self._draw, logits, to_sample, bitmasks)
        if drawn is None:
            return
        for (req, sample, _), token, has_nan, lp in zip(to_sample, *drawn):
            if req.output.request_id in self.requests:
                self.isolated([sample.seq], step.done, self._emit, req, sample, token, has_nan, lp,
                              step.done)

    def _draw(self, logits, to_sample: list[tuple[Request, Sample, int]], bitmasks: list) -> tuple:
        """(tokens, which rows held NaN, logprobs): one batched draw over the rows due a token."""
        rows = logit_rows(logits, [row for _, _, row in to_sample])  # R, V
        pairs = [(req, sample) for req, sample, _ in to_sample]
        return draw(rows, pairs, self.tokenizer, bitmasks)

    def _grammar_masks(self, to_sample: list, logits, done: dict) -> list:
        """Each row's grammar mask (None without a grammar), computed one row at a time, so that a
        row whose grammar fails or runs over its time budget fails its request alone
        (grammar_limits.py)."""
        vocab = logits.shape[-1] if isinstance(logits, torch.Tensor) else logits[0].shape[-1]
        bitmasks = []
        for req, s, _ in to_sample:
            bitmask = None
            if s.matcher is not None and req.output.request_id in self.requests:
                bitmask = self.isolated([s.seq], done, self.inputs.grammars.row_bitmask, s.matcher,
                                        vocab, req.output.request_id)
            bitmasks.append(bitmask)
        return bitmasks

    def _emit(self, req: Request, s: Sample, token: int, has_nan: bool, lp, done: dict) -> None:
        """One sampled token: into the output (stop conditions, logprobs), then into the
        sequence."""
        if has_nan:
            raise self.nan_error(req, len(s.seq))
        finished = req.emit(s, token, lp)
        self.scheduler.postprocess(s.seq, [token], finished)
        done[req.output.request_id] = req.output

    def nan_error(self, req: Request, position: int) -> RequestFailedError:
        """The error that fails a request whose logits held NaN at `position`."""
        return RequestFailedError("the model produced NaN logits for request "
                                  f"{req.output.request_id!r} at position {position} (an "
                                  f"overflow in {self.dtype}?)")

    def _collect(self, done: dict[str, RequestOutput]) -> list[RequestOutput]:
        for rid, out in done.items():
            if out.finished:
                out.finish_time = time.perf_counter()
                self.requests.pop(rid, None)
        return list(done.values())

    # ------------------------------------------------------------------ forks, faults
    def _fork(self, req: Request, parent: Sequence) -> list[Sample]:
        children = []
        for i in range(1, req.params.n):
            child = parent.child(i)
            sample = self.inputs.new_sample(req, child, i)
            self.scheduler.fork(parent, child)
            # at once: if a later step of the fork fails, aborting frees it
            req.samples.append(sample)
            req.output.outputs.append(sample.out)
            children.append(sample)
        return children

    def isolated(self, seqs: list[Sequence], done: dict, fn, *args):
        """fn(*args), a fault in it kept to the requests of `seqs`: on a non-fatal error they fail
        (their outputs go into `done`) and None is returned; the rest of the step goes on."""
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
