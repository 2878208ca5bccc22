"""What one HTTP request may ask of the server, bounded before the work starts.

A server shares one engine, one event loop and a few worker threads among every client, so the
work a single request can ask for must be bounded before any of it is done: a batch of a million
prompts, a text of a million tokens to tokenize, a thousand chat messages to render. Each bound
here is checked as early as its quantity is known (the number of prompts before any is tokenized;
the tokens as each prompt is tokenized), and a request over one gets a 400 that names the limit,
its value, and what the request asked for. The body's size (`--max-body-bytes`, 4 MiB) bounds
everything else a client can send; grammars have their own limits (engine/grammar_limits.py).

    max_prompts_per_request        prompts in one /v1/completions batch
    max_prompt_tokens_per_request  tokens over all of them; also what /tokenize and /detokenize take
    max_chat_messages              messages in one chat (/v1/chat/completions, /tokenize)
    shutdown_grace_s               on SIGTERM, how long responses in flight may finish before they
                                   are cut and the server exits

`nanoserve serve --max-prompts-per-request N --max-prompt-tokens-per-request N
--max-chat-messages N --shutdown-grace S` sets them. Taught in notebooks/09_*.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError, check


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_prompts_per_request: int = 1024
    max_prompt_tokens_per_request: int = 262_144
    max_chat_messages: int = 1024
    shutdown_grace_s: float = 5.0

    def __post_init__(self) -> None:
        for name in (
            "max_prompts_per_request",
            "max_prompt_tokens_per_request",
            "max_chat_messages",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r} must be an integer ≥ 1",
            )
        check(
            isinstance(self.shutdown_grace_s, (int, float)) and self.shutdown_grace_s >= 0,
            f"shutdown_grace_s={self.shutdown_grace_s!r} must be a number of seconds ≥ 0",
        )

    def check_prompts(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise NanoserveError(
                f"prompt holds {count} prompts; this server takes at most "
                f"max_prompts_per_request={self.max_prompts_per_request} in one request"
            )

    def check_tokens(self, count: int, what: str = "the prompts") -> None:
        if count > self.max_prompt_tokens_per_request:
            raise NanoserveError(
                f"{what}: {count} tokens; this server takes at most "
                f"max_prompt_tokens_per_request={self.max_prompt_tokens_per_request} "
                "in one request"
            )

    def check_messages(self, count: int) -> None:
        if count > self.max_chat_messages:
            raise NanoserveError(
                f"messages holds {count} messages; this server takes at most "
                f"max_chat_messages={self.max_chat_messages} in one chat"
            )
