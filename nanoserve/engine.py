"""The user-facing API: `LLM(model).generate(prompts, SamplingParams(...))`.

This first engine runs requests one after another: prefill the prompt into a contiguous
KV cache, then decode one token per forward until a stop condition. Batching arrives with
the schedulers; the API stays the same. Taught in notebooks/00_* and notebooks/01_*.

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
from .kv_cache import KVCache
from .loader import load_model
from .sampling import SamplingParams, make_generator, sample_next

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated ids, a final stop/EOS id included
    finish_reason: str | None = None  # "stop" | "length"
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

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


class LLM:
    """Load a model once, then generate from prompts (text or token-id lists)."""

    def __init__(self, model: str = "demo", dtype: str | torch.dtype | None = None, device: str | None = None):
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
    @torch.inference_mode()
    def _decode_loop(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids until max_tokens or the context is full (stops are the caller's)."""
        n_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        cache = KVCache(self.config, 1, len(prompt_ids) + n_new, self.dtype, self.device)
        generator = make_generator(params.seed, self.device)
        ids = torch.tensor([prompt_ids], device=self.device)  # 1, T
        seen = ids[0] if params.repetition_penalty != 1.0 else None
        for _ in range(n_new):
            logits = self.model(ids, cache=cache, last_only=True)[0, -1]  # V
            token = sample_next(logits, params, seen, generator)
            yield token
            ids = torch.tensor([[token]], device=self.device)
            if seen is not None:
                seen = torch.cat([seen, ids[0]])

    def stream_outputs(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, RequestOutput]]:
        """Generate for one prompt, yielding (text delta, output so far); the last yield is finished."""
        arrival = time.perf_counter()
        prompt_ids = self.encode_prompt(prompt)
        out = RequestOutput(prompt if isinstance(prompt, str) else None, prompt_ids, arrival_time=arrival)
        text = IncrementalText(self.tokenizer, params.stop, prompt_ids)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        pending = ""
        for token in self._decode_loop(prompt_ids, params):
            if out.first_token_time is None:
                out.first_token_time = time.perf_counter()
            out.token_ids.append(token)
            if token in stop_ids:
                out.finish_reason = "stop"
                break
            delta, hit = text.add(token)
            out.text = text.text
            if hit:
                out.finish_reason, pending = "stop", delta
                break
            yield delta, out
        out.finish_reason = out.finish_reason or "length"
        out.finish_time = time.perf_counter()
        final = pending + text.flush()
        out.text = text.text
        yield final, out

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
            *_, (_, out) = self.stream_outputs(prompt, params)
            outputs.append(out)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens are produced."""
        params = params or SamplingParams()
        for delta, _ in self.stream_outputs(prompt, params):
            if delta:
                yield delta

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of one full forward without a cache: for teaching and checks."""
        ids = self.check_token_ids(token_ids)
        if len(ids) > self.max_model_len:
            raise NanoserveError(f"{len(ids)} tokens exceed the model's context of {self.max_model_len}")
        return self.model(torch.tensor([ids], device=self.device))[0].float()
