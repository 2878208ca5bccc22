"""`LLM`: the offline, user-facing façade over `LLMEngine` (vLLM's name): load once, then generate.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, max_tokens=100, seed=0))
    print(out[0].text)

Taught in notebooks/00_* to 03_*.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig
from ..errors import NanoserveError, RequestFailedError
from ..extension_points import extension
from .block_allocator import BlockAllocator
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .request import Prompt
from .sampler import SamplingParams

OFFLINE_BATCHED_TOKENS = 4096  # LLM's token budget per step (the engine's and the server's: 512)


class LLM:
    """Load a model once, then generate from prompts (text or token-id lists) with continuous
    batching. Keyword arguments set up the engine (nanoserve/config/: cache size, prefix caching,
    scheduling, ...; an unknown one is an error naming the closest). `lora`: a PEFT LoRA adapter
    directory, merged into the weights before the first request, or with `lora_merge=False` applied
    beside each target layer (a quantized base; nanoserve/lora/).

    Offline, nobody waits on a stream's next token, so `LLM` takes a larger token budget per step
    than the engine's default (`max_num_batched_tokens` 4096 against 512, as vLLM's CPU default):
    fewer, fuller prefill steps, and the decodes join a full batch sooner (measured on the peer
    workloads: benchmarks/RESULTS.md, "Fourth step"). A server keeps 512: a 4096-token prefill step
    would hold every stream's next token for most of a second."""

    def __init__(self, model: str = "demo", lora: str | None = None, lora_merge: bool = True,
                 **kwargs):
        kwargs.setdefault("max_num_batched_tokens", OFFLINE_BATCHED_TOKENS)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        e = self.engine
        if lora is not None:
            self._use_lora(lora, lora_merge)
        self.model, self.config, self.tokenizer = e.model, e.config, e.tokenizer
        self.model_name = e.model_name
        self.device, self.dtype = e.device, e.dtype
        self.max_model_len = e.max_model_len
        self.runner = e.runner

    def _use_lora(self, path: str, merge: bool) -> None:
        """Merged: W + s·BA in place, so the engine's layers (and CUDA graphs) read the same
        tensors. Unmerged: the target layers are swapped for LoRALinear ones, and decode CUDA graphs
        are recorded again."""
        lora = extension("lora")  # nanoserve/lora/
        e = self.engine
        self.lora = lora.load_lora_adapter(path, e.config)
        if merge:
            lora.merge_lora(e.model, self.lora)
            return
        lora.apply_lora(e.model, self.lora, e.dtype)
        if e.runner.graphs is not None:  # graphs recorded the layers as they were
            e.runner.graphs.capture()

    @property
    def block_allocator(self) -> BlockAllocator:
        """The engine's KV block pool bookkeeping (for inspecting prefix hits and free blocks)."""
        return self.engine.block_allocator

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The token ids the engine would run for `prompt` (BOS included for Llama-family
        models)."""
        return self.engine.inputs.encode_prompt(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or a list of either), all
        scheduled together; outputs come back in the prompts' order. `params`: one SamplingParams
        for every prompt, or a list with one per prompt (as vLLM's). A request that fails inside
        the engine raises RequestFailedError (the others are aborted: generate returns all or none).
        `lora_request`: a LoRARequest for every prompt, or a list with one (or None) per prompt; the
        engine must have been made with enable_lora=True (nanoserve/lora/serving.py)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = self._params_per_prompt(params, len(prompts))
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise NanoserveError(f"got {len(loras)} lora_request for {len(prompts)} prompts; give "
                                 "one, or one each")
        # every prompt validated (and tokenized, once; its adapter read) before any compute is spent
        reqs = [self.engine.new_request(p, sp, lora_request=lr) for p, sp,
                lr in zip(prompts, per_prompt, loras)]
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(reqs), desc="generate", unit="req",
                   disable=not (len(reqs) > 1 if use_tqdm is None else use_tqdm))
        start, n_out = time.perf_counter(), 0
        try:
            for req in reqs:
                self.engine.enqueue(req)
                ids.append(req.output.request_id)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        done[out.request_id] = out
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{n_out / (time.perf_counter() - start):.1f}")
        finally:
            for rid in ids:  # interrupted: nothing stays queued or holds blocks
                self.engine.abort_request(rid)
            bar.close()
        return [done[rid] for rid in ids]

    @staticmethod
    def _params_per_prompt(params, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise NanoserveError("params must be a SamplingParams or a list of them, one per "
                                 f"prompt; got {type(params).__name__}")
        if len(params) != n:
            raise NanoserveError(f"got {len(params)} SamplingParams for {n} prompts; give one, or "
                                 "one per prompt")
        bad = [i for i, p in enumerate(params) if not isinstance(p, SamplingParams)]
        if bad:
            raise NanoserveError(f"params[{bad[0]}] is a {type(params[bad[0]]).__name__}, not a "
                                 "SamplingParams")
        return list(params)

    def stream_request(self, prompt: Prompt, params: SamplingParams | None = None
                       ) -> Iterator[tuple[str, RequestOutput]]:
        """Yield (text delta, output so far) as the first sample grows; aborted if abandoned."""
        params = params or SamplingParams()
        rid = self.engine.add_request(prompt, params)
        req = self.engine.requests[rid]
        out, sent = req.samples[0].out, 0
        try:
            while not out.finish_reason:
                self.engine.step()
                if req.output.error is not None:
                    raise RequestFailedError(f"request {rid} failed: {req.output.error}")
                if len(out.text) > sent or out.finish_reason:  # out.text holds only settled text
                    yield out.text[sent:], req.output
                    sent = len(out.text)
        finally:
            self.engine.abort_request(rid)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens are produced."""
        params = params or SamplingParams()
        if params.n != 1:
            raise NanoserveError(f"stream() yields one text; got n={params.n}, use generate() for "
                                 "n > 1")
        for delta, _ in self.stream_request(prompt, params):
            if delta:
                yield delta

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of one full forward without a cache: for teaching and
        checks."""
        ids = self.engine.inputs.check_token_ids(token_ids)
        if len(ids) > self.max_model_len:
            raise NanoserveError(f"{len(ids)} tokens exceed the model's context of "
                                 f"{self.max_model_len}")
        # (split over ranks, every rank runs its share: parallel/workers.py)
        return self.runner.logits(ids)
