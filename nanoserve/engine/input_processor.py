"""Input processing: a prompt and its SamplingParams become a validated `Request` (vLLM's
Processor).

Every check a request needs happens here, once, before anything is queued: the prompt is
encoded (or its token ids checked against the vocabulary), it must leave room for one new token
in the context, and the whole request must fit the KV pool. Nothing here reads the scheduler's
state, only the model's configuration and the pool's size, so it may run on any thread while a
step is in flight (the server validates in a worker thread). Taught in notebooks/03_*.
"""

from __future__ import annotations

import time
from collections import abc

import torch

from ..errors import NanoserveError
from ..extension_points import extension
from ..tokenizers.specials import encode_with_special_tokens
from .outputs import CompletionOutput, IncrementalText, RequestOutput
from .request import Prompt, Request, Sample
from .sampler import SamplingParams, make_generator
from .sequence import Sequence


class InputProcessor:
    """Validates prompts and builds requests for one model and one KV pool."""

    def __init__(self, config, tokenizer, device: torch.device, num_blocks: int, block_size: int,
                 model_name: str = "", lora=None, grammar_limits=None,
                 split_special_tokens: bool = False):
        self.config, self.tokenizer, self.device = config, tokenizer, device
        # "<|endoftext|>" in a text prompt: the special token's id (HF's and vLLM's default), or
        # with split_special_tokens thirteen ordinary tokens (tokenizers/specials.py)
        self.split_special_tokens = split_special_tokens
        # the engine's LoRAManager with enable_lora: it checks and reads a request's adapter
        self.lora = lora
        self.num_blocks, self.block_size, self.model_name = num_blocks, block_size, model_name
        self.max_model_len = config.max_position_embeddings
        # Llama-family prompts start with BOS (as their tokenizers do); GPT-2's do not.
        has_bos = tokenizer is not None and tokenizer.bos_id is not None
        self.add_bos = config.adds_bos and has_bos
        self.eos_ids = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_id is not None:
            self.eos_ids.add(tokenizer.eos_id)
        # ids a prompt may hold and sampling may give: the model's, but only those the tokenizer can
        # decode when the embedding is padded past it (models/loader.check_vocabulary)
        self.usable_vocab_size = (config.vocab_size if tokenizer is None
                                  else min(tokenizer.vocab_size, config.vocab_size))
        eos = None if tokenizer is None else tokenizer.eos_id
        # structured outputs: a request's grammar compiled off the step (structured_output.py)
        compiler = extension("structured_outputs").GrammarCompiler
        self.grammars = compiler(tokenizer, config.vocab_size, eos, grammar_limits)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text -> token ids (BOS added for Llama-family models); id lists are checked as they
        are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise NanoserveError(f"the model {self.model_name!r} was loaded without a "
                                     "tokenizer (its checkpoint has none), so prompts must be "
                                     "lists of token ids, not text")
            if not prompt:
                raise NanoserveError("prompt is empty; give at least one character or token id")
            ids = self.encode_text(prompt, self.add_bos)
        else:
            ids = self.check_token_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise NanoserveError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                f"the prompt must be at most {self.max_model_len - 1} tokens to leave room for one "
                "new token")
        return ids

    def encode_text(self, text: str, bos: bool) -> list[int]:
        """Text -> ids, special-token text as the token's id unless split_special_tokens."""
        if self.split_special_tokens:
            return self.tokenizer.encode(text, bos=bos)
        return encode_with_special_tokens(text, self.tokenizer, bos=bos)

    def check_token_ids(self, token_ids: abc.Sequence[int]) -> list[int]:
        """The ids as ints, each a token the model embeds and the tokenizer decodes."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise NanoserveError("prompt token id list is empty; give at least one token id")
        bad = [t for t in ids if not 0 <= t < self.usable_vocab_size]
        if bad:
            raise NanoserveError(
                f"token id {bad[0]} is outside the vocabulary; allowed ids are "
                f"0..{self.usable_vocab_size - 1}")
        return ids

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Tokens that will be generated at most; a request the whole pool cannot hold is
        refused."""
        n_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        bs = self.block_size
        need = -(-(len(prompt_ids) + n_new - 1) // bs) + (params.n - 1) * (n_new // bs + 1)
        if need > self.num_blocks:
            raise NanoserveError(
                f"request needs up to {need} KV blocks ({len(prompt_ids)} prompt + {n_new} new "
                f"tokens, n={params.n}, block_size={bs}) but the whole pool has {self.num_blocks}; "
                "lower max_tokens or n, or give the cache more memory")
        return n_new

    def make_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str,
                     priority: int = 0,
                     arrival_time: float | None = None, lora_request=None) -> Request:
        """A validated request with its first sequence, queued nowhere yet; under `lora_request`'s
        adapter."""
        params = params or SamplingParams()
        if lora_request is not None:
            if self.lora is None:
                raise NanoserveError(f"lora_request={lora_request!r}: this engine serves no "
                                     "adapters; start it with enable_lora=True")
            self.lora.add(lora_request)  # read from disk the first time, checked against the model
        if params.stop and self.tokenizer is None:
            raise NanoserveError(f"stop={params.stop!r}: stop strings need a tokenizer and this "
                                 "model has none; use stop_token_ids")
        bad = [t for t in params.logit_bias if t >= self.usable_vocab_size]
        if bad:
            raise NanoserveError(f"logit_bias: token id {bad[0]} is outside the vocabulary; "
                                 f"allowed ids are 0..{self.usable_vocab_size - 1}")
        prompt_ids = self.encode_prompt(prompt)
        max_new = self.check_fits(prompt_ids, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        # prompt logprobs need every prompt position's logits: such a request never reads the prefix
        # cache
        seq = Sequence(prompt_ids, request_id=request_id, priority=priority,
                            arrival_time=arrival,
                            skip_prefix_cache=params.prompt_logprobs is not None,
                            lora_int_id=0 if lora_request is None else lora_request.lora_int_id,
                            kv_eviction=evicting(params))
        out = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, prompt_ids,
                            arrival_time=arrival,
                            prompt_logprobs=None if params.prompt_logprobs is None else [None])
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        req = Request(params, out, max_new, stop_ids, grammar=grammar)
        req.samples.append(self.new_sample(req, seq, 0))
        out.outputs = [req.samples[0].out]
        return req

    def new_sample(self, req: Request, seq: Sequence, i: int) -> Sample:
        """Sample i of a request: its sequence, its random stream (seed + i), its text."""
        p = req.params
        seed = None if p.seed is None else p.seed + i  # sample i of n == a single run with seed + i
        seen = None  # the ids a repetition penalty looks at: prompt and output
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(seq.token_ids, device=self.device)
        logprobs = None if p.logprobs is None else []
        out = CompletionOutput(i, logprobs=logprobs,
                               cumulative_logprob=None if logprobs is None else 0.0)
        text = IncrementalText(self.tokenizer if p.detokenize else None, p.stop,
                               req.output.prompt_token_ids,
                               p.include_stop_str_in_output)  # no tokenizer: ids only, no text
        # each sample walks the grammar alone
        matcher = None if req.grammar is None else req.grammar.deep_copy()
        return Sample(seq, make_generator(seed, self.device), text, out, seen, matcher)


def evicting(params: SamplingParams):
    """The request's KV eviction config when it evicts (engine/kv_eviction.py); else None."""
    config = params.kv_eviction
    return config if config is not None and config.evicts else None
