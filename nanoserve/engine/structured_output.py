"""Structured outputs: a grammar as a token mask (vLLM's `structured_outputs`, OpenAI's
`response_format`).

A request may constrain its output to a JSON schema, any JSON object, a regular expression, one of a
list of strings, or a Lark grammar (`StructuredOutputsParams`, exactly one). Before each token is
drawn, a *matcher* — a parser over the grammar, advanced by every token the sample emitted —
computes the set of tokens that keep the output a prefix of some string in the language, as a
bitmask (bit t of word t // 32 is token t); the sampler sets every other logit to -inf, so the
draw (greedy or not, any temperature) can only continue legally. When the grammar is complete the
mask allows only EOS, and a matcher that has stopped ends the sample ("stop").

The grammar engine is llguidance (the `structured` extra): a Rust library with no Python
dependencies that builds masks on the CPU in microseconds for a 50k vocabulary (so it serves CPU and
GPU engines alike: the mask is built on the host and moved once per step), reads tiktoken
vocabularies directly, supports JSON Schema, regexes and Lark grammars, and can roll tokens back
(which speculative verification needs); vLLM ("guidance" backend), SGLang and llama.cpp use it.
xgrammar needs torch and an HF tokenizer object; outlines-core has no context-free grammars.

Masking costs the grammar's work per row on the host, in the step (vLLM overlaps it with the
forward; this engine does not): benchmarks/bench_structured.py measures it per step. Taught in
notebooks/11_*.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import string
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from ..errors import GrammarError, NanoserveError, first_line
from .bitmask import apply_bitmask, apply_row_bitmasks, unpack_bitmask  # noqa: F401
from .grammar_limits import GrammarLimits, check_constraint
from .sampling_params import StructuredOutputsParams
from .scheduler import QueueFullError

__all__ = ["GrammarCompiler", "StructuredOutputsParams", "apply_bitmask", "token_bitmask"]


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """A request's constraint in llguidance's input form."""
    from llguidance import LLMatcher

    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    options = compact if params.disable_any_whitespace else None
    if params.json is not None:
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (json.JSONDecodeError, ValueError) as e:
            raise NanoserveError(f"structured outputs: json is not a JSON schema: {e}") from None
    if params.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(_escape(c) for c in params.choice))
    return LLMatcher.grammar_from_lark(params.grammar)


def _escape(text: str) -> str:
    """A literal for llguidance's (Rust) regex syntax: every ASCII punctuation character escaped."""
    return "".join("\\" + c if c in string.punctuation else c for c in text)


class GrammarCompiler:
    """Builds one matcher per sample for one tokenizer; the llguidance vocabulary is built once, on
    first use.

    Compiled grammars are kept (the most recently used, as many as `limits.cache_bytes` holds when
    each is counted at the most its lexer can grow to: `GrammarLimits.cache_entries`) and each
    request gets a copy: copies share the compiled lexer's caches, so many requests under one
    schema compute their masks faster than as many separately compiled matchers, and the compile
    is paid once (measured: benchmarks/RESULTS.md, structured outputs).

    Compiling is a client's program run on the server, so it is bounded (grammar_limits.py): checked
    against `limits` first, then compiled, with its first mask, in a small pool of threads whose
    stacks are deep (STACK_BYTES) under a deadline. The lock guards only the cache and the table of
    compiles in flight, never a compile: a slow one holds one pool thread, not every request. Two
    requests for the same constraint share one compile."""

    STACK_BYTES = 256 << 20  # address space reserved per pool thread; pages committed only as used

    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None,
                 limits: GrammarLimits | None = None):
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.limits = limits or GrammarLimits()
        self._ll_tokenizer = None
        # key -> a matcher at the grammar's start, never advanced
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._in_flight: dict[tuple, Future] = {}  # key -> its compile, queued or running
        self._waiters: dict[tuple, int] = {}  # key -> requests waiting for it now
        # the cache, the tables above and the vocabulary; never held while compiling
        self._lock = threading.Lock()

    def row_bitmask(self, matcher, vocab_size: int, request_id: str) -> torch.Tensor:
        """One row's mask of next tokens within GrammarLimits.mask_budget_ms (`row_bitmask`)."""
        return row_bitmask(matcher, vocab_size, self.limits.mask_budget_ms / 1e3, request_id)

    @staticmethod
    def mask_verification(matcher, draft_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Speculative verification's logits under the grammar (`mask_verification`)."""
        return mask_verification(matcher, draft_ids, logits)

    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (token bytes, EOS), built on first use."""
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    from llguidance.tiktoken import lltokenizer_from_encoding
                except ImportError:
                    raise NanoserveError("structured outputs need llguidance: pip install "
                                         "'nanoserve[structured]'"
                                         ) from None
                encoding = getattr(self.tokenizer, "encoding", None)
                if (
                    encoding is None
                    or self.eos_id is None
                    or getattr(self.tokenizer, "presplit", None)
                    or getattr(self.tokenizer, "normalization", None)
                ):
                    raise NanoserveError(
                        "structured outputs need a plain tiktoken-backed tokenizer with an EOS "
                        f"token; this model's ({type(self.tokenizer).__name__}) is not one "
                        "(SentencePiece vocabularies are not supported)")
                self._ll_tokenizer = lltokenizer_from_encoding(
                    encoding, n_vocab=self.vocab_size, eos_token=self.eos_id
                )
            return self._ll_tokenizer

    @property
    def num_cached(self) -> int:
        """Compiled grammars kept now (a server's /metrics)."""
        return len(self._compiled)

    @property
    def cached_bytes_bound(self) -> int:
        """The most the kept grammars can hold (each at GrammarLimits.grammar_bytes_bound)."""
        return self.num_cached * self.limits.grammar_bytes_bound()

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher at the start of the grammar; NanoserveError when the grammar does not
        compile."""
        return self.compile(params).deep_copy()

    def compile(self, params: StructuredOutputsParams):
        """The cached matcher at the grammar's start, shared: never advance it, copy it
        (`deep_copy`). Waits for the compile at most `limits.compile_timeout_s`; GrammarError past
        it or over a limit."""
        key, future = self.submit(params)
        try:
            result = future.result(timeout=self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:  # (TimeoutError itself from Python 3.11)
            raise self._give_up(key, future) from None
        except BaseException:
            self._leave(key)
            raise
        self._leave(key)
        return result

    async def compile_async(self, params: StructuredOutputsParams):
        """`compile` for an event loop: waits without holding a thread (the compile runs in the
        pool, shared with any other request for the same constraint)."""
        key, future = self.submit(params)
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(ready.set))
        try:
            await asyncio.wait_for(ready.wait(), self.limits.compile_timeout_s)
        except asyncio.TimeoutError:
            raise self._give_up(key, future) from None
        except BaseException:  # (the request was cancelled: its client left)
            self._leave(key)
            raise
        self._leave(key)
        return future.result()

    def submit(self, params: StructuredOutputsParams) -> tuple[tuple, Future]:
        """(the constraint's key, a future of its compiled matcher), without waiting: done at once
        when cached, the same future as a compile of the same constraint in flight, else a new job
        for the pool. Each call is a waiter on the key until `_leave` or `_give_up`; QueueFullError
        (429) when `limits.max_queued_compiles` compiles are queued or running already."""
        key = params.key()
        with self._lock:
            self._waiters[key] = self._waiters.get(key, 0) + 1
            proto = self._compiled.get(key)
            if proto is not None:
                self._compiled.move_to_end(key)
                future: Future = Future()
                future.set_result(proto)
                return key, future
            future = self._in_flight.get(key)
            if future is None:
                if len(self._in_flight) >= self.limits.max_queued_compiles:
                    self._leave_locked(key)
                    most = self.limits.max_queued_compiles
                    raise GrammarBusyError(
                        f"structured outputs: {len(self._in_flight)} constraints are compiling "
                        f"already (GrammarLimits.max_queued_compiles={most}); retry")
                pool = shared_pool(self.limits.compile_threads, self.STACK_BYTES)
                future = pool.submit(self._compile, params, key)
                self._in_flight[key] = future
            return key, future

    def _leave(self, key: tuple) -> None:
        with self._lock:
            self._leave_locked(key)

    def _leave_locked(self, key: tuple) -> None:
        self._waiters[key] -= 1
        if not self._waiters[key]:
            del self._waiters[key]

    def _give_up(self, key: tuple, future: Future) -> NanoserveError:
        """A waiter's deadline passed. A compile that never started is cancelled once no one waits
        for it, and its waiter was only busy behind others (429, retry); one that ran is too slow
        for its limits (400)."""
        with self._lock:
            self._leave_locked(key)
            started = future.running() or future.done()
            if not started and key not in self._waiters and future.cancel():
                self._in_flight.pop(key, None)
        if not started:
            return GrammarBusyError(
                f"structured outputs: the constraint waited GrammarLimits.compile_timeout_s="
                f"{self.limits.compile_timeout_s} s behind other compiles without starting; retry")
        return GrammarError("structured outputs: compiling the constraint took longer than "
                            f"GrammarLimits.compile_timeout_s={self.limits.compile_timeout_s} s; "
                            "simplify it")

    def _compile(self, params: StructuredOutputsParams, key: tuple):
        """In a pool thread: check, compile, compute the first mask (off the step; it is also the
        most expensive one), cache."""
        from llguidance import LLMatcher

        try:
            check_constraint(params.kind, params.value, self.limits)
            proto = LLMatcher(self.ll_tokenizer(), llguidance_grammar(params), log_level=0,
                              limits=self.limits.parser_limits())
            if proto.is_error():
                raise GrammarError("structured outputs: the constraint does not compile: "
                                   f"{first_line(proto.get_error())}")
            probe = proto.deep_copy()  # shares the lexer's caches: its first mask warms every copy
            first = token_bitmask([probe], self.vocab_size)
            if probe.is_error() or not bool(first.any()):
                why = first_line(probe.get_error()) if probe.is_error() else "no token can start it"
                raise GrammarError(f"structured outputs: the constraint admits no output ({why})")
            with self._lock:
                self._compiled[key] = proto
                if len(self._compiled) > self.limits.cache_entries():
                    self._compiled.popitem(last=False)
            return proto
        finally:
            with self._lock:
                self._in_flight.pop(key, None)


class GrammarBusyError(QueueFullError):
    """The compile pool is full, or a request's compile never started before its deadline: the
    server is busy, not the constraint wrong (HTTP 429, retry later)."""


_POOLS: dict[int, ThreadPool] = {}  # one pool of each size per process, shared by every engine
_POOLS_LOCK = threading.Lock()


def shared_pool(size: int, stack_bytes: int) -> ThreadPool:
    """The process's compile pool of `size` threads (started on first use; never stopped)."""
    with _POOLS_LOCK:
        if size not in _POOLS:
            _POOLS[size] = ThreadPool(size, stack_bytes, f"nanoserve-grammar-{size}")
        return _POOLS[size]


class ThreadPool:
    """`size` daemon threads, started at once, each with a stack of `stack_bytes`, running submitted
    calls in order. (concurrent.futures' pool starts its threads lazily, after whatever stack size
    the process set meanwhile; a native compiler that recurses once per grammar rule needs the deep
    one.)"""

    def __init__(self, size: int, stack_bytes: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        old = threading.stack_size(stack_bytes)
        try:
            for i in range(size):
                threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
        finally:
            threading.stack_size(old)

    def submit(self, fn, *args) -> Future:
        """A future of fn(*args), run by the first free thread."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)


def token_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each matcher's next step: int32 [R, ceil(V / 32)], bit t % 32 of word t
    // 32. (One row after another: llguidance's own thread pool was slower here, its threads
    competing with torch's for the same cores.)"""
    words = (vocab_size + 31) // 32
    out = torch.empty(len(matchers), words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        # llguidance writes the words in place
        m.unsafe_compute_mask_ptr(out[i].data_ptr(), words * 4)
    return out


def row_bitmask(matcher, vocab_size: int, budget_s: float, request_id: str) -> torch.Tensor:
    """One row's mask, int32 [1, W], as token_bitmask computes it; GrammarError when the matcher is
    in error (a parser limit hit) or the mask took longer than `budget_s` (its request fails, the
    others' step goes on; GrammarLimits.mask_budget_ms)."""
    start = time.thread_time()  # CPU time: a busy machine or a GIL wait is not the grammar's
    bitmask = token_bitmask([matcher], vocab_size)
    took = time.thread_time() - start
    if matcher.is_error():
        raise GrammarError(f"request {request_id!r}: its structured output grammar failed "
                           f"({first_line(matcher.get_error())})")
    if took > budget_s:
        raise GrammarError(f"request {request_id!r}: its structured output grammar took "
                           f"{took * 1e3:.0f} ms for one token's mask, over "
                           f"GrammarLimits.mask_budget_ms={budget_s * 1e3:g}")
    return bitmask


def mask_rows(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [R, V] with each row that has a matcher (not None) limited to its grammar's next
    tokens; the same tensor when no row has one. One masked fill for the whole step."""
    return apply_row_bitmasks(logits, matcher_bitmasks(matchers, logits.shape[-1]))


def matcher_bitmasks(matchers: list, vocab_size: int) -> list:
    """Each matcher's mask of next tokens, int32 [1, W]; None for a row without a matcher."""
    bitmasks = []
    for matcher in matchers:
        if matcher is None:
            bitmasks.append(None)
        else:
            bitmasks.append(token_bitmask([matcher], vocab_size))
    return bitmasks


def mask_verification(matcher, draft_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Speculative decoding: the verification logits [γ+1, V] of one row, position j limited to the
    grammar's tokens after drafts 0..j−1. A draft the grammar refuses sits at -inf in its position's
    row, so verification rejects it (greedy: it is not the argmax; sampling: p(draft) = 0) and
    resamples from the masked row; the rows after it are never used. The matcher ends where it began
    (rolled back)."""
    if matcher is None:
        return logits
    steps, consumed = [], 0
    for j in range(len(draft_ids) + 1):
        steps.append(token_bitmask([matcher], logits.shape[-1]))
        if j == len(draft_ids) or matcher.try_consume_tokens([draft_ids[j]]) != 1:
            break
        consumed += 1
    steps += [steps[-1]] * (len(draft_ids) + 1 - len(steps))  # after a refused draft: never reached
    matcher.rollback(consumed)
    return apply_bitmask(logits, torch.cat(steps))
