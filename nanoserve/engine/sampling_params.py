"""`SamplingParams`: one request's settings, with vLLM's names, validated on construction.

Every value is checked here, once, in the dtype it is used in (float32): a top_p of 1e-300 is a
positive Python float but 0 in float32. A bad value raises NanoserveError naming it and what is
allowed (the server turns that into a 400). The pipeline that uses them is in sampler.py.

What the extras mean (OpenAI's and vLLM's definitions):

- `presence_penalty` / `frequency_penalty` (OpenAI, in [-2, 2]): subtract `presence` from the
  logit of every token already *generated* and `frequency × count` for each time it was;
  `repetition_penalty` (CTRL) counts the prompt too and divides instead.
- `min_p` (Nguyen et al. 2024): after temperature, drop tokens whose probability is below
  min_p × the most likely token's.
- `logit_bias`: {token id: bias in [-100, 100]} added to the logits first (-100 bans a token).
- `detokenize=False` (vLLM's): the output keeps its token ids and gets no text, nor do its
  logprobs' tokens — the decoding work per token is skipped (a benchmark comparing with engines
  that return ids only); stop strings need the text, so they are refused with it.
- `min_tokens`: until this many tokens are out, stop tokens cannot be sampled and stop strings
  are not looked for; `include_stop_str_in_output` keeps the stop string in the text.
- `structured_outputs`: a JSON schema, regex, choice or grammar the output must match
  (structured_output.py).
- `logprobs=k`: each generated token's log-probability plus the k most likely tokens'; and
  `prompt_logprobs=k`: the same for every prompt token after the first. They are *raw*
  log-probabilities, `log_softmax` of the model's logits before any setting above (vLLM's
  default, `logprobs_mode="raw_logprobs"`), so they do not depend on how the request samples.
- `max_tokens=0`, only with prompt_logprobs: the prompt is scored alone, prefilled, and the request
  ends ("length") without sampling a token (what a server's `echo` with `max_tokens: 0` runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..config.kv_eviction import KVEvictionConfig
from ..errors import NanoserveError, check, is_int

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI's and vLLM's seed fields
# the most top log-probabilities one position returns (OpenAI's and vLLM's default bound)
MAX_LOGPROBS = 20
_F32 = torch.finfo(torch.float32)


KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputsParams' kinds


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's fields; exactly one is set)."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar
    # JSON: separators ", " and ": " and no other whitespace (vLLM's field; its default is False,
    # flexible whitespace, where a small model can spend its whole budget on newlines inside the
    # braces)
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise NanoserveError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                                 f"{', '.join(set_) or 'none'}")
        checks = {"json": isinstance(self.json, (dict, str)),
                  "json_object": self.json_object is True,
                  "regex": isinstance(self.regex, str) and self.regex != "",
                  "choice": isinstance(self.choice, list) and bool(self.choice)
                  and all(isinstance(c, str) and c for c in self.choice),
                  "grammar": isinstance(self.grammar, str) and self.grammar.strip() != ""}
        if not checks[set_[0]]:
            allowed = {"json": "a JSON schema (object or string)", "json_object": "true",
                       "regex": "a non-empty string",
                       "choice": "a non-empty list of non-empty strings",
                       "grammar": "a Lark grammar (a non-empty string)"}[set_[0]]
            raise NanoserveError(f"structured outputs: {set_[0]}={getattr(self, set_[0])!r:.100} "
                                 f"must be {allowed}")

    @property
    def kind(self) -> str:
        """Which of KINDS is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self):
        """The constraint itself: the schema, the regex, the choices or the grammar."""
        return getattr(self, self.kind)

    def key(self) -> tuple:
        """What two requests must share to share a compiled grammar (a schema dict by its JSON)."""
        value = self.value
        if isinstance(value, (dict, list)):
            value = json.dumps(value)  # key order kept: a schema's property order is its output's
        return self.kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """One request's sampling settings (vLLM's names), validated on construction."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    # keep the smallest set with probability ≥ top_p (Holtzman et al. 2019); 1 = off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with p ≥ min_p · max p; 0 = off
    # CTRL's rule (Keskar et al. 2019), see apply_repetition_penalty
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's, on generated tokens; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, on generated tokens; 0 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    max_tokens: int = 64
    min_tokens: int = 0  # no stop token or stop string before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output ...)
    include_stop_str_in_output: bool = False  # (... unless this is set)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1  # parallel samples of one prompt (they share the prompt's KV blocks)
    logprobs: int | None = None  # per generated token: its logprob + the top-k's; None = off
    prompt_logprobs: int | None = None  # the same for each prompt token after the first; None = off
    # a grammar the output must match
    structured_outputs: StructuredOutputsParams | dict | None = None
    # False: token ids only, no text (nor the logprobs' decoded tokens); vLLM's field
    detokenize: bool = True
    # which K/V this request's sequences keep (config/kv_eviction.py); None: all of them
    kv_eviction: KVEvictionConfig | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # max_tokens=0 scores a prompt and samples nothing: only with prompt_logprobs (its purpose)
        scores_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        check(is_int(self.max_tokens) and (self.max_tokens > 0 or scores_only),
               f"max_tokens={self.max_tokens!r} must be an integer ≥ 1 (0 only with "
               "prompt_logprobs: the prompt is scored and nothing is generated)")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens!r} must be an integer in [0, "
               f"max_tokens={self.max_tokens}]")
        check(is_int(self.n) and self.n >= 1, f"n={self.n!r} must be an integer ≥ 1")
        check(_is_number(self.temperature) and 0 <= self.temperature < float("inf")
               and (self.temperature == 0 or self.temperature >= 1e-6),
               f"temperature={self.temperature!r} must be 0 (greedy) or a finite number ≥ 1e-6")
        check(is_int(self.top_k) and self.top_k >= 0,
              f"top_k={self.top_k!r} must be an integer ≥ 0 (0 = off)")
        check(_is_number(self.top_p) and _F32.tiny <= self.top_p <= 1,
               f"top_p={self.top_p!r} must be in (0, 1] and a normal float32 (≥ {_F32.tiny:.3g}); "
               "1 = off")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
              f"min_p={self.min_p!r} must be in [0, 1]; 0 = off")
        penalty = self.repetition_penalty
        check(_is_number(penalty) and _F32.tiny <= penalty <= _F32.max,
               f"repetition_penalty={self.repetition_penalty!r} must be > 0 and a normal float32 "
               f"({_F32.tiny:.3g} to {_F32.max:.3g}); 1 = off")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(_is_number(v) and -2 <= v <= 2,
                  f"{name}={v!r} must be a number in [-2, 2]; 0 = off")
        biases = self.logit_bias
        check(isinstance(biases, dict) and all(_is_bias(k, b) for k, b in biases.items()),
            f"logit_bias={self.logit_bias!r:.200} must map token ids (integers ≥ 0) to numbers in "
            "[-100, 100]")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop),
              f"stop={self.stop!r} must be non-empty strings")
        check(isinstance(self.detokenize, bool),
              f"detokenize={self.detokenize!r} must be True or False")
        check(self.detokenize or not self.stop,
              f"stop={self.stop!r} needs detokenize=True (stop strings are "
                                                "looked for in the text)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
                   f"{name}={v!r} must be None (off) or an integer in [0, {MAX_LOGPROBS}] (0: only "
                   "the chosen token's)")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        grammar = self.structured_outputs
        check(grammar is None or isinstance(grammar, StructuredOutputsParams),
               f"structured_outputs={self.structured_outputs!r:.100} must be "
               "StructuredOutputsParams or a dict of it")
        check(self.structured_outputs is None or self.min_tokens == 0,
               "min_tokens cannot be combined with structured_outputs (the grammar decides where "
               "the output ends)")
        if isinstance(self.kv_eviction, dict):
            self.kv_eviction = KVEvictionConfig(**self.kv_eviction)
        check(self.kv_eviction is None or isinstance(self.kv_eviction, KVEvictionConfig),
              f"kv_eviction={self.kv_eviction!r:.100} must be None, KVEvictionConfig or a dict "
              "of it")
        seed_ok = is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)
        check(self.seed is None or seed_ok,
               f"seed={self.seed!r} must be None or an integer in [{SEED_MIN}, {SEED_MAX} - (n - "
               f"1)] (sample i of n={self.n} is seeded seed + i, a signed 64-bit value)")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, no randomness."""
        return self.temperature == 0

    @property
    def reshapes_logits(self) -> bool:
        """Whether anything besides temperature / top-k / top-p changes the sampled law: a penalty,
        a bias, min-p or min_tokens (such rows decode plainly, never speculatively). A grammar does
        not
        count: its mask is applied in the sampler and, per draft position, in verification."""
        penalties = (self.repetition_penalty != 1.0 or self.presence_penalty != 0
                     or self.frequency_penalty != 0)
        return penalties or bool(self.logit_bias) or self.min_p > 0 or self.min_tokens > 0


def _is_bias(token_id, bias) -> bool:
    """One logit_bias entry: a token id ≥ 0 and a number in [-100, 100] (OpenAI's range)."""
    return is_int(token_id) and token_id >= 0 and _is_number(bias) and -100 <= bias <= 100


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
