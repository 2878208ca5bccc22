"""Chat templates: turning a list of messages into the token ids a chat model was trained on.

A chat model is an ordinary language model fine-tuned on conversations laid out in one fixed
format, e.g. ChatML:

    <|im_start|>system\nYou are helpful.<|im_end|>\n
    <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n      (one string, broken here)

The format is part of the checkpoint: HF stores it as a Jinja template, the `chat_template` of
`tokenizer_config.json` (or a `chat_template.jinja` file beside it), rendered with the variables
`messages`, `add_generation_prompt` (end with the header of the assistant's turn),
`bos_token` / `eos_token`, and `tools` when the request has some (tool_calls.py). A model without
one was never taught a conversation format (the demo model, stories260K): the server refuses chat
requests for it rather than invent one.

Rendering gives text in which special tokens appear *as text* ("<|im_end|>"). Those must become
their single ids, never the ids of their characters, so `encode` cuts the text at every special
token and encodes only the pieces between them (tiktoken's `allowed_special="all"` does the
same; nanoserve/tokenizers/specials.py). No BOS is added: the template writes it when the model
wants one. (SentencePiece models put a "▁" before each piece's first word; HF's legacy Llama
tokenizer agrees, its newer mode may not.) Used by the OpenAI-compatible server,
nanoserve/serving/server.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import NanoserveError
from ..models.loader import resolve_model_path
from ..tokenizers import Tokenizer
from ..tokenizers.specials import encode_with_special_tokens

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplate:
    """A Jinja chat template with the strings it may use for BOS and EOS."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        # HF renders with these settings; a template is data from a checkpoint, hence the sandbox
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise NanoserveError(f"the chat template does not parse: {e}") from e
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               kwargs: dict | None = None,
               tools: list[dict] | None = None) -> str:
        """The template rendered; `kwargs` are extra variables (vLLM's chat_template_kwargs, e.g.
        enable_thinking), which cannot replace the ones set here; `tools` (function definitions) are
        passed as the variable `tools` when given, as transformers' apply_chat_template does."""
        import jinja2

        check_messages(messages)
        kwargs = kwargs or {}
        taken = sorted({"messages", "add_generation_prompt", "bos_token", "eos_token",
                        "tools"} & set(kwargs))
        if taken:
            raise NanoserveError(f"chat_template_kwargs may not set {', '.join(taken)} (set by the "
                                 "request itself)")
        try:
            if tools is not None:
                kwargs = {**kwargs, "tools": tools}
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "",
                                        eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            # raise_exception() in the template: e.g. roles out of order
            raise NanoserveError(f"the model's chat template rejected the messages: {e}") from e

    def encode(self, messages: list[dict], tokenizer: Tokenizer, add_generation_prompt: bool = True,
               kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """Render (see render), then encode with special tokens as their own ids."""
        if tokenizer is None:
            raise NanoserveError("chat needs a tokenizer and this model was loaded without one; "
                                 "use /v1/completions with token-id prompts")
        return encode_with_special_tokens(self.render(messages, add_generation_prompt, kwargs,
                                                      tools), tokenizer)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Jinja's `tojson` filter as HF's templates expect it: non-ASCII kept, options passed on."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise NanoserveError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(m.get("content"), str) or (calls and m.get("content") is None)):
            raise NanoserveError(f"messages[{i}] must have a role in {ROLES} and a string content "
                                 f"(null only beside an assistant's tool_calls), got {m!r:.200}")


def load_chat_template(model: str | os.PathLike,
                       tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
    """The chat template stored with a model (name, HF directory or .bin file); None if it has
    none."""
    path = resolve_model_path(model)
    folder = path if path.is_dir() else path.parent
    config = _read_json(folder / "tokenizer_config.json")
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        default = [t for t in source if isinstance(t, dict) and t.get("name") == "default"]
        source = default[0].get("template") if default else None
    if source is None and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if source is None:
        source = _read_json(folder / "chat_template.json").get("chat_template")
    if not source:
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token"), tokenizer, "bos_id"),
                        _token_text(config.get("eos_token"), tokenizer, "eos_id"))


def read_chat_template_file(path: str | os.PathLike,
                            tokenizer: Tokenizer | None = None) -> ChatTemplate:
    """A template given on its own (`nanoserve serve --chat-template FILE`)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise NanoserveError(f"cannot read the chat template {str(path)!r}: "
                             f"{e.strerror or e}") from None
    specials = {i: t for t, i in (tokenizer.special_tokens if tokenizer else {}).items()}
    return ChatTemplate(source, specials.get(getattr(tokenizer, "bos_id", None)),
                        specials.get(getattr(tokenizer, "eos_id", None)))


def _token_text(value, tokenizer: Tokenizer | None, id_attr: str) -> str | None:
    """tokenizer_config's "bos_token"/"eos_token" (a string or {"content": ...}), else the
    tokenizer's own."""
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return value
    if tokenizer is None:
        return None
    by_id = {i: t for t, i in tokenizer.special_tokens.items()}
    return by_id.get(getattr(tokenizer, id_attr, None))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NanoserveError(f"{path} is not readable JSON: {e}") from e
    return data if isinstance(data, dict) else {}
