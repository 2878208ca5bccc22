"""The user-facing API: `LLM(model).generate(prompts, SamplingParams(...))`.

This engine runs requests one after another on the paged KV cache: the block manager gives
the prompt its blocks (reusing cached ones for a shared prefix), the model runner prefills
what is not cached, then decodes one token per forward until a stop condition. With
`SamplingParams(n > 1)` the n samples share the prompt's blocks (fork) and decode as one
batch, copying a shared block only when one writes into it (copy-on-write). Scheduling
several requests at once arrives with the batchers; the API stays the same.
Taught in notebooks/00_*, 01_* and 02_*.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, max_tokens=100, seed=0))
    print(out[0].text)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .errors import NanoserveError
from .loader import load_model
from .model_runner import ModelRunner
from .paged import BlockAllocator, num_blocks_for_budget
from .sampling import SamplingParams, make_generator, sample_next
from .sequence import Sequence as SequenceState


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """K and V, every layer, one token."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name); a request with SamplingParams(n=k) has k of them."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated ids, a final stop/EOS id included
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    # the first sample, for the common n = 1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        return all(o.finish_reason for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class IncrementalText:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Decoding the whole list each time is simple and always consistent with `decode`
    (O(n²) in characters, fine for the lengths here). Text that could still become part of a
    stop string, and a trailing incomplete UTF-8 character, are held back until they settle.
    """

    def __init__(self, tokenizer, stop: list[str], prompt_ids: Sequence[int] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        # A few prompt tokens decoded in front of the output, then cut off again: whether a
        # continuation starts with a space can depend on what precedes it (SentencePiece drops
        # the space of a text's first word, but not of a continuation).
        self.context = list(prompt_ids[-4:])
        self.context_text = tokenizer.decode(self.context)
        self.ids: list[int] = []
        self.text = ""  # final text so far (stop string excluded)
        self.emitted = 0

    def add(self, token_id: int | None) -> tuple[str, bool]:
        """Append a token (None: no text, e.g. EOS); return (new text, whether a stop string hit)."""
        if token_id is not None:
            self.ids.append(token_id)
        full = self.tokenizer.decode(self.context + self.ids)[len(self.context_text):]
        for s in self.stop:
            at = full.find(s)
            if at >= 0:
                self.text = full[:at]
                return self.flush(), True
        self.text = full
        safe = len(full.rstrip("\ufffd")) - self.hold
        if safe <= self.emitted:
            return "", False
        delta = full[self.emitted:safe]
        self.emitted = safe
        return delta, False

    def flush(self) -> str:
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


@dataclass(eq=False)
class _Sample:
    """Decoding state of one sample: its sequence (token ids, blocks), random stream and text."""

    seq: SequenceState
    generator: torch.Generator | None
    text: IncrementalText
    out: CompletionOutput
    seen: torch.Tensor | None  # token ids for the repetition penalty


class LLM:
    """Load a model once, then generate from prompts (text or token-id lists).

    KV cache: a pool of `num_blocks` blocks of `block_size` tokens, sized from `kv_cache_memory`
    bytes when given, else to hold 8 full-context sequences. Prefix caching is on by default.
    """

    def __init__(self, model: str = "demo", dtype: str | torch.dtype | None = None, device: str | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, kv_cache_memory: int | None = None,
                 num_blocks: int | None = None):
        self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
        self.model_name = str(model)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = self.config.max_position_embeddings
        # Llama-family prompts start with BOS (as their tokenizers do); GPT-2's do not.
        self.add_bos = self.config.arch == "llama" and self.tokenizer.bos_id is not None
        self.eos_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_id is not None:
            self.eos_ids.add(self.tokenizer.eos_id)
        if num_blocks is None:
            budget = kv_cache_memory or 8 * kv_bytes_per_token(self.config, self.dtype) * self.max_model_len
            num_blocks = num_blocks_for_budget(self.config, budget, block_size, self.dtype)
        self.block_manager = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(self.model, num_blocks, block_size)

    # ------------------------------------------------------------------ input checks
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text -> token ids (BOS added for Llama-family models); id lists are checked as they are."""
        if isinstance(prompt, str):
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
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise NanoserveError(
                f"token id {bad[0]} is outside the vocabulary; allowed ids are 0..{self.config.vocab_size - 1}")
        return ids

    # ------------------------------------------------------------------ generation
    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
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

    @torch.inference_mode()
    def stream_outputs(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[int, str, RequestOutput]]:
        """Generate for one prompt, yielding (sample index, text delta, output so far) per new token;
        the output is finished when the generator is exhausted. Blocks are always returned."""
        arrival = time.perf_counter()
        prompt_ids = self.encode_prompt(prompt)
        n_new = self._check_fits(prompt_ids, params)
        bm, runner = self.block_manager, self.runner
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        req = RequestOutput(prompt if isinstance(prompt, str) else None, prompt_ids, arrival_time=arrival)
        first = SequenceState(prompt_ids)
        samples: list[_Sample] = []
        try:
            bm.allocate(first)
            req.num_cached_tokens = first.num_cached_tokens
            logits = runner.run([first], [len(first) - first.num_computed_tokens])  # 1, V  (prefill)
            for i in range(params.n):
                seq = first
                if i:  # the other samples share the prompt's blocks
                    seq = SequenceState(prompt_ids, num_computed_tokens=first.num_computed_tokens)
                    bm.fork(first, seq)
                seed = None if params.seed is None else params.seed + i  # sample i == a run with seed + i
                seen = torch.tensor(prompt_ids, device=self.device) if params.repetition_penalty != 1.0 else None
                samples.append(_Sample(seq, make_generator(seed, self.device),
                                       IncrementalText(self.tokenizer, params.stop, prompt_ids),
                                       CompletionOutput(i), seen))
            req.outputs = [s.out for s in samples]
            logits = logits.expand(params.n, -1)  # n, V
            for step in range(n_new):
                running = [s for s in samples if s.out.finish_reason is None]
                for s, row in zip(running, logits):
                    token = sample_next(row, params, s.seen, s.generator)
                    if s.seen is not None:
                        s.seen = torch.cat([s.seen, torch.tensor([token], device=self.device)])
                    delta = self._append(s, token, stop_ids)
                    if step == n_new - 1 and s.out.finish_reason is None:
                        s.out.finish_reason = "length"
                    if req.first_token_time is None:
                        req.first_token_time = time.perf_counter()
                    if s.out.finish_reason:
                        delta += s.text.flush()
                        s.out.text = s.text.text
                        bm.free(s.seq)
                    if s.out.finish_reason and all(o.finish_reason for o in req.outputs):
                        req.finish_time = time.perf_counter()
                    yield s.out.index, delta, req
                running = [s for s in samples if s.out.finish_reason is None]
                if not running:
                    break
                for s in running:  # room for the sampled token's K/V (copy a shared block first)
                    if not bm.can_append(s.seq):
                        raise NanoserveError(f"KV cache pool exhausted ({bm.num_blocks} blocks); "
                                             "give the cache more memory or lower n / max_tokens")
                    cow = bm.append_slot(s.seq)
                    if cow is not None:
                        runner.kv.copy_block(*cow)
                logits = runner.run([s.seq for s in running], [1] * len(running))  # B, V  (decode)
        finally:  # finished, failed or abandoned by the caller: every block goes back to the pool
            for s in samples:
                if s.seq.block_table:
                    bm.free(s.seq)
            if first.block_table:
                bm.free(first)

    def _append(self, s: _Sample, token: int, stop_ids: set[int]) -> str:
        """Record a sampled token: stop ids end the sample; otherwise its text, checked for stop strings."""
        s.seq.append_token(token)
        s.out.token_ids.append(token)
        if token in stop_ids:
            s.out.finish_reason = "stop"
            return ""
        delta, hit = s.text.add(token)
        s.out.text = s.text.text
        if hit:
            s.out.finish_reason = "stop"
        return delta

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or a list of either)."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        for p in prompts:  # validate everything before spending compute on anything
            self.encode_prompt(p)
        outputs = []
        bar = tqdm(prompts, desc="generate", unit="req",
                   disable=not (len(prompts) > 1 if use_tqdm is None else use_tqdm))
        for prompt in bar:
            *_, (_, _, out) = self.stream_outputs(prompt, params)
            outputs.append(out)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens are produced."""
        params = params or SamplingParams()
        if params.n != 1:
            raise NanoserveError(f"stream() yields one text; got n={params.n}, use generate() for n > 1")
        for _, delta, _ in self.stream_outputs(prompt, params):
            if delta:
                yield delta

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of one full forward without a cache: for teaching and checks."""
        ids = self.check_token_ids(token_ids)
        if len(ids) > self.max_model_len:
            raise NanoserveError(f"{len(ids)} tokens exceed the model's context of {self.max_model_len}")
        return self.model(torch.tensor([ids], device=self.device))[0].float()
