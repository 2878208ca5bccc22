"""The engine: `LLMEngine` (add_request / step / abort_request) and the user-facing `LLM`.

Data flows one way, as in vLLM and nano-vllm:

    request → Scheduler (which sequences, how many tokens) → BlockAllocator (slots)
            → ModelRunner (one batched forward) → sampler → outputs / stream

Every `step()` runs one forward over everything the continuous scheduler picked — prefill
chunks and decode tokens side by side — samples a token for each sequence that reached the end
of its tokens, applies stop conditions, and frees the blocks of what finished. `LLM.generate`
drives it to completion with a progress bar; `LLM.stream` yields text as it appears.
`SamplingParams(n > 1)` samples share the prompt's blocks (fork after prefill, copy-on-write).
Taught in notebooks/00_* to 03_*.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, max_tokens=100, seed=0))
    print(out[0].text)
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import NanoserveError, RequestFailedError, is_fatal
from ..kv.cache import kv_bytes_per_token, num_blocks_for_budget
from ..models.loader import load_model
from ..spec.proposers import DraftModelProposer, NgramDraft
from ..spec.spec_decode import SpecDecodeConfig, SpecDecoder
from .block_allocator import BlockAllocator
from .model_runner import ModelRunner
from .outputs import CompletionOutput, IncrementalText, RequestOutput
from .request import Prompt, Request, Sample
from .sampler import SamplingParams, make_generator, sample_next
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence as SequenceState
from .sequence import SequenceStatus

logger = logging.getLogger("nanoserve")
__all__ = ["LLMEngine", "EngineStats"]


def _nan_rows(logits: torch.Tensor | list[torch.Tensor]) -> set[int]:
    """Rows whose logits hold a NaN: [B, V], or a list of [k, V] (speculative verification)."""
    flags = torch.stack([x.isnan().any() for x in logits]) if isinstance(logits, list) else logits.isnan().any(-1)
    return {i for i, bad in enumerate(flags.tolist()) if bad}


def _mask_from(logits: torch.Tensor | list[torch.Tensor], first: int):
    """Logits with ids ≥ `first` at -inf (never sampled): [B, V] or a list of [k, V]."""
    if isinstance(logits, list):
        return [_mask_from(x, first) for x in logits]
    return torch.cat([logits[..., :first], torch.full_like(logits[..., first:], float("-inf"))], dim=-1)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for monitoring; requests count once whatever their n."""

    num_running: int  # requests admitted to the batch (a preempted one waits again)
    num_waiting: int  # requests in the waiting queue
    num_blocks: int  # KV blocks in the pool ...
    num_free_blocks: int  # ... and how many no sequence holds (cached prefix blocks count as free)
    prefix_cache_hits: int  # prompt blocks found in the prefix cache ...
    prefix_cache_queries: int  # ... out of all full prompt blocks looked up
    num_preemptions: int


class LLMEngine:
    """Continuous batching over a paged KV cache.

    KV cache: a pool of `num_blocks` blocks of `block_size` tokens, sized from `kv_cache_memory`
    bytes when given, else to hold 8 full-context sequences. Prefix caching is on by default.
    Scheduling: at most `max_num_seqs` sequences and `max_num_batched_tokens` new tokens per
    step; chunked prefill on by default; `max_waiting` bounds the queue (None: unbounded).
    Attention: `attention_backend` "torch" (gather + SDPA) or "triton" (the paged kernels of
    nanoserve.kernels); None picks triton on CUDA and torch on CPU (see kv_cache.py).
    """

    def __init__(self, model: str = "demo", dtype: str | torch.dtype | None = None, device: str | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, kv_cache_memory: int | None = None,
                 num_blocks: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, max_waiting: int | None = None,
                 attention_backend: str | None = None, speculative_model: str | None = None,
                 speculative: str | None = None, num_speculative_tokens: int = 4, speculative_adaptive: bool = True):
        spec_cfg = None
        if speculative_model is not None or speculative is not None:  # checked before any model loads
            spec_cfg = SpecDecodeConfig(speculative or "draft", num_speculative_tokens, speculative_model,
                                        speculative_adaptive)
            spec_cfg.validate()
        self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
        self.model_name = str(model)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = self.config.max_position_embeddings
        tok = self.tokenizer  # None for a checkpoint without one: prompts are token ids, outputs have no text
        # Llama-family prompts start with BOS (as their tokenizers do); GPT-2's do not.
        self.add_bos = self.config.arch == "llama" and tok is not None and tok.bos_id is not None
        self.eos_ids = set(self.config.eos_token_ids)
        if tok is not None and tok.eos_id is not None:
            self.eos_ids.add(tok.eos_id)
        # ids a prompt may hold and sampling may give: the model's, but only those the tokenizer can
        # decode when the embedding is padded past it (loader.check_vocabulary)
        self.usable_vocab_size = self.config.vocab_size if tok is None else min(tok.vocab_size, self.config.vocab_size)
        if num_blocks is None:
            budget = kv_cache_memory or 8 * kv_bytes_per_token(self.config, self.dtype) * self.max_model_len
            num_blocks = num_blocks_for_budget(self.config, budget, block_size, self.dtype)
        sched_cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, max_waiting)
        self.scheduler = Scheduler(sched_cfg, BlockAllocator(num_blocks, block_size, enable_prefix_caching),
                                   self.max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, block_size, attention_backend)
        self.attention_backend = self.runner.attention_backend
        self.spec = None if spec_cfg is None else self._build_spec(spec_cfg, num_blocks, block_size)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_num_seqs = 0  # sequences in the latest forward (for occupancy plots)

    def _build_spec(self, cfg: SpecDecodeConfig, num_blocks: int, block_size: int) -> SpecDecoder:
        max_len = self.max_model_len
        if cfg.method == "ngram":
            proposer, cost = NgramDraft(cfg.ngram_max, cfg.ngram_min), 0.0  # no model: drafting is ~free
        else:
            try:
                draft, dcfg, dtok = load_model(cfg.draft_model, dtype=self.dtype, device=self.device)
            except NanoserveError as e:
                raise NanoserveError(f"speculative model {cfg.draft_model!r} could not be loaded: {e}") from e
            if dcfg.vocab_size != self.config.vocab_size:
                raise NanoserveError(f"the draft model's vocabulary ({dcfg.vocab_size} tokens) differs from the "
                                     f"target's ({self.config.vocab_size}); speculative decoding needs one shared "
                                     "tokenizer")
            probe = "Speculative decoding needs one shared tokenizer: ÀÉ 123 !?"
            if dtok is not None and self.tokenizer is not None and dtok.encode(probe) != self.tokenizer.encode(probe):
                raise NanoserveError("the draft model's tokenizer encodes text differently from the target's; "
                                     "speculative decoding needs one shared tokenizer")
            max_len = min(max_len, dcfg.max_position_embeddings)
            proposer = DraftModelProposer(draft, num_blocks, block_size, self.attention_backend)
            cost = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in self.model.parameters())
        return SpecDecoder(cfg, proposer, self.block_manager, max_len, cost)

    @property
    def block_manager(self) -> BlockAllocator:
        return self.scheduler.bm

    @block_manager.setter
    def block_manager(self, bm: BlockAllocator) -> None:
        self.scheduler.bm = bm

    # ------------------------------------------------------------------ input checks
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text -> token ids (BOS added for Llama-family models); id lists are checked as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise NanoserveError(f"the model {self.model_name!r} was loaded without a tokenizer (its checkpoint "
                                     "has none), so prompts must be lists of token ids, not text")
            if not prompt:
                raise NanoserveError("prompt is empty; give at least one character or token id")
            ids = self.tokenizer.encode(prompt, bos=self.add_bos)
        else:
            ids = self.check_token_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise NanoserveError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                f"the prompt must be at most {self.max_model_len - 1} tokens to leave room for one new token")
        return ids

    def check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise NanoserveError("prompt token id list is empty; give at least one token id")
        bad = [t for t in ids if not 0 <= t < self.usable_vocab_size]
        if bad:
            raise NanoserveError(
                f"token id {bad[0]} is outside the vocabulary; allowed ids are 0..{self.usable_vocab_size - 1}")
        return ids

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Tokens that will be generated at most; a request the whole pool cannot hold is refused."""
        n_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        bm = self.block_manager
        need = bm.blocks_needed(len(prompt_ids) + n_new - 1) + (params.n - 1) * (n_new // bm.block_size + 1)
        if need > bm.num_blocks:
            raise NanoserveError(
                f"request needs up to {need} KV blocks ({len(prompt_ids)} prompt + {n_new} new tokens, n={params.n}, "
                f"block_size={bm.block_size}) but the whole pool has {bm.num_blocks}; "
                "lower max_tokens or n, or give the cache more memory")
        return n_new

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises NanoserveError for bad input, QueueFullError when full."""
        req = self.new_request(prompt, params, request_id, priority, arrival_time)
        self.enqueue(req)
        return req.output.request_id

    def enqueue(self, req: Request) -> None:
        """Queue a request made by `new_request`; QueueFullError (and nothing registered) when full."""
        self.scheduler.add(req.samples[0].seq)
        self.requests[req.output.request_id] = req

    def new_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        """A validated request with its first sequence, not queued anywhere (the batchers use it too).

        It reads only the model's configuration and the pool's size, never the scheduler's state, so
        it may run while a step is in flight on another thread (AsyncLLMEngine relies on that)."""
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise NanoserveError(f"stop={params.stop!r}: stop strings need a tokenizer and this model has none; "
                                 "use stop_token_ids")
        prompt_ids = self.encode_prompt(prompt)
        max_new = self.check_fits(prompt_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise NanoserveError(f"request id {rid!r} is already in use")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        seq = SequenceState(prompt_ids, request_id=rid, priority=priority, arrival_time=arrival)
        out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, prompt_ids, arrival_time=arrival)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        req = Request(params, out, max_new, stop_ids)
        req.samples.append(self._new_sample(req, seq, 0))
        out.outputs = [req.samples[0].out]
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: its sequences leave the scheduler and their blocks return to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for s in req.samples:
            if s.out.finish_reason is None:
                self._finish(s.seq, SequenceStatus.ABORTED)
                s.out.finish_reason = "abort"
                s.out.text = s.text.text
        req.output.finish_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """The engine's state now, for monitoring (a server's /metrics)."""
        waiting = {seq.request_id for seq in self.scheduler.waiting}
        bm = self.block_manager
        return EngineStats(num_running=len(self.requests) - len(waiting), num_waiting=len(waiting),
                           num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks(),
                           prefix_cache_hits=bm.stats.hits, prefix_cache_queries=bm.stats.hits + bm.stats.misses,
                           num_preemptions=self.scheduler.num_preemptions)

    def _new_sample(self, req: Request, seq: SequenceState, i: int) -> Sample:
        p = req.params
        seed = None if p.seed is None else p.seed + i  # sample i of n == a single run with seed + i
        seen = torch.tensor(seq.token_ids, device=self.device) if p.repetition_penalty != 1.0 else None
        return Sample(seq, make_generator(seed, self.device),
                       IncrementalText(self.tokenizer, p.stop, req.output.prompt_token_ids), CompletionOutput(i), seen)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; return the outputs of requests that advanced.

        A fault while handling one request fails that request alone (`_fail_request`): its output
        ends with `error` set and its blocks return to the pool, the other rows go on. A forward that
        raises fails every request in it (the fault cannot be pinned to a row). Only a fatal error
        (`errors.is_fatal`: broken bookkeeping, a device fault) propagates and stops the engine."""
        sched = self.scheduler.schedule()
        self.last_num_seqs = len(sched.seqs)
        if self.spec is not None:
            for seq in sched.preempted:  # recomputed later: the draft's cache is rebuilt then too
                self.spec.proposer.free(seq)
        if not sched.seqs:
            return []
        for src, dst in sched.copies:  # copy-on-write before anyone writes into the copies
            self.runner.kv.copy_block(src, dst)
        now = time.perf_counter()
        for seq in sched.seqs:
            out = self.requests[seq.request_id].output
            if out.first_scheduled_time is None:
                out.first_scheduled_time = now
                out.num_cached_tokens = seq.num_cached_tokens
        advanced: dict[str, RequestOutput] = {}
        proposals = self._speculate(sched, advanced) if self.spec is not None else {}
        if not sched.seqs:
            return list(advanced.values())
        logits = self._guarded(sched.seqs, advanced, self._forward, sched, proposals)
        if logits is None:
            return list(advanced.values())
        if self.usable_vocab_size < self.config.vocab_size:  # padded embedding rows the tokenizer cannot decode
            logits = _mask_from(logits, self.usable_vocab_size)
        nan_rows = _nan_rows(logits)  # one host sync for the whole batch
        for row, seq in enumerate(sched.seqs):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # its request failed earlier in this step
            self._guarded([seq], advanced, self._process_row, req, seq, logits[row], proposals.get(row),
                          row in nan_rows, advanced)
        for rid, out in advanced.items():
            if out.finished:
                out.finish_time = time.perf_counter()
                self.requests.pop(rid, None)
        return list(advanced.values())

    def _forward(self, sched, proposals: dict) -> torch.Tensor | list[torch.Tensor]:
        """logits [B, V]; with drafts, [1 + γ, V] per verification row and [1, V] per other row."""
        if not proposals:
            return self.runner.run(sched.seqs, sched.num_new)
        num_logits = [1 + len(proposals[i].draft_ids) if i in proposals else 1 for i in range(len(sched.seqs))]
        return self.runner.run(sched.seqs, sched.num_new, num_logits)

    def _guarded(self, seqs: list[SequenceState], advanced: dict[str, RequestOutput], fn, *args):
        """fn(*args); if it raises a non-fatal error, the requests of `seqs` fail (returns None)."""
        try:
            return fn(*args)
        except Exception as e:
            if is_fatal(e):
                raise
            for rid in dict.fromkeys(seq.request_id for seq in seqs):
                if rid in self.requests:
                    advanced[rid] = self._fail_request(self.requests[rid], e)
            return None

    def _process_row(self, req: Request, seq: SequenceState, logits: torch.Tensor, proposal, has_nan: bool,
                     advanced: dict[str, RequestOutput]) -> None:
        """After the forward: accept drafts or sample the row's next token, apply stop conditions."""
        if has_nan:
            raise RequestFailedError(f"the model produced NaN logits for request {seq.request_id!r} at position "
                                     f"{len(seq)} (an overflow in {self.dtype}?)")
        if proposal is not None:  # accept / reject the drafts, roll back, then emit like any step
            s, finished = req.samples[seq.sample_index], False
            for token in self.spec.accept(proposal, logits):
                finished = self._append_token(req, s, token)
                if finished:
                    break
            self.block_manager.mark_computed(seq)
            if finished:
                self._finish(seq)
            else:
                seq.needs_slot = True
            advanced[seq.request_id] = req.output
            return
        row_logits = logits if logits.dim() == 1 else logits[-1]  # V
        self.block_manager.mark_computed(seq)  # full blocks with KV become prefix-cache hits
        if seq.num_computed_tokens < len(seq):
            return  # a prefill chunk: no token to sample yet
        samples = [req.samples[seq.sample_index]]
        if len(req.samples) < req.params.n:  # prefill done: the other samples fork from here
            samples += self._fork(req, seq)
        for s in samples:
            if self._sample(req, s, row_logits):
                self._finish(s.seq)
            else:
                s.seq.needs_slot = True
        advanced[seq.request_id] = req.output

    def _fail_request(self, req: Request, error: Exception) -> RequestOutput:
        """End one request with `error`: every sample stops, every block returns to the pool."""
        rid = req.output.request_id
        logger.error("request %s failed: %s: %s", rid, type(error).__name__, error, exc_info=error)
        self.abort_request(rid)
        for s in req.samples:
            if s.out.finish_reason == "abort":
                s.out.finish_reason = "error"
        req.output.error = f"{type(error).__name__}: {error}"
        return req.output

    def _speculate(self, sched, advanced: dict[str, RequestOutput]) -> dict:
        """Draft tokens for the decoding rows that speculate this step and append them (with KV
        slots) to their sequences; returns {row: Proposal}. See nanoserve/spec/spec_decode.py.
        If drafting fails, the speculating requests fail and leave `sched` (one batched draft
        forward: the fault cannot be pinned to a row)."""
        budget = self.scheduler.config.max_num_batched_tokens - sched.num_tokens  # leftover: no saturation
        rows, where = [], []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new)):
            if n != 1 or seq.num_computed_tokens + 1 != len(seq) or budget <= 0:
                continue  # a prefill chunk, or no budget left
            req = self.requests[seq.request_id]
            if len(req.samples) < req.params.n:
                continue  # about to fork its samples: the first token is drawn plainly
            s = req.samples[seq.sample_index]
            gamma = min(self.spec.choose_gamma(seq, req.params, req.max_new - len(s.out.token_ids)), budget)
            if gamma > 0:
                rows.append((seq, gamma, req.params, s.generator))
                where.append(i)
                budget -= gamma
                s.out.spec_stats = self.spec.state(seq).stats
        if not rows:
            return {}
        drafted = self._guarded([r[0] for r in rows], advanced, self.spec.propose_and_extend, rows)
        if drafted is None:
            keep = [i for i, seq in enumerate(sched.seqs) if seq.request_id in self.requests]
            sched.seqs, sched.num_new = [sched.seqs[i] for i in keep], [sched.num_new[i] for i in keep]
            return {}
        proposals = {}
        for i, prop in zip(where, drafted):
            if prop.draft_ids:
                sched.num_new[i] += len(prop.draft_ids)
                proposals[i] = prop
        for src, dst in self.spec.copies:  # drafts that landed in a shared block
            self.runner.kv.copy_block(src, dst)
        return proposals

    def _finish(self, seq: SequenceState, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        self.scheduler.finish(seq, status)
        if self.spec is not None:
            self.spec.free(seq)

    def _fork(self, req: Request, parent: SequenceState) -> list[Sample]:
        children = []
        for i in range(1, req.params.n):
            child = SequenceState(list(parent.token_ids), request_id=parent.request_id, sample_index=i,
                                  priority=parent.priority, arrival_time=parent.arrival_time)
            sample = self._new_sample(req, child, i)
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            req.samples.append(sample)  # at once: if a later step of the fork fails, aborting frees it
            req.output.outputs.append(sample.out)
            children.append(sample)
        return children

    def _sample(self, req: Request, s: Sample, logits: torch.Tensor) -> bool:
        """Draw the sample's next token and apply the stop conditions; True when it finished."""
        return self._append_token(req, s, sample_next(logits, req.params, s.seen, s.generator))

    def _append_token(self, req: Request, s: Sample, token: int) -> bool:
        """Add a generated token to the sample and its output; True when a stop condition hit."""
        now = time.perf_counter()
        if s.seen is not None:
            s.seen = torch.cat([s.seen, torch.tensor([token], device=self.device)])
        s.seq.append_token(token)
        s.out.token_ids.append(token)
        s.out.token_times.append(now)
        if req.output.first_token_time is None:
            req.output.first_token_time = now
        if token in req.stop_ids:
            s.out.finish_reason = "stop"
        else:
            _, hit = s.text.add(token)
            if hit:
                s.out.finish_reason = "stop"
            elif len(s.out.token_ids) >= req.max_new:
                s.out.finish_reason = "length"
        if s.out.finish_reason:
            s.text.flush()
        # while running, only settled text (no possible stop-string prefix, no cut UTF-8 character),
        # so that out.text only ever grows and a stream can send its new part
        s.out.text = s.text.text[: s.text.emitted]
        return s.out.finish_reason is not None
