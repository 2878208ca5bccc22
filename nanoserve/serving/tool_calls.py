"""Tool (function) calling in chat completions, the way OpenAI's API and vLLM do it.

The request lists `tools` (each a function: name, description, JSON-schema `parameters`); earlier
turns may hold the assistant's `tool_calls` and `role: "tool"` results. All of it reaches the model
only through its chat template, which receives `tools` as a variable and the messages as they are
(an argument string parsed to an object, as templates expect) — the way transformers'
apply_chat_template renders them. What the model writes back becomes `tool_calls` by `tool_choice`:

- `"none"`: plain text, nothing parsed;
- `"auto"`: the text is parsed for calls in the format the model was trained on. Implemented: the
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of Hermes-style templates
  (Qwen2.5, Qwen3, SmolLM3, Hermes), recognised by the template's source; other templates give text
  only;
- a named function: the output is *constrained* to that function's parameters schema (structured
  outputs), so it always parses: it becomes the call's `arguments`;
- `"required"`: constrained to a JSON array of one or more {"name", "parameters"} objects, one of
  the listed functions each (one only with parallel_tool_calls=false).

A choice with calls has finish_reason "tool_calls" and `content` null (or the text around the
calls). Streamed, every mode sends the calls as they are found, their arguments in pieces
(tool_call_stream.py).

As in vLLM, "auto" must be switched on when the server starts (`--enable-auto-tool-choice
--tool-call-parser hermes`, `ToolCallConfig`): a server that cannot parse calls out of the text
answers a request with tools and tool_choice auto (or none given, which means auto) with a 400
rather than with text that silently holds unparsed calls.

A tool's `parameters` schema is compiled *strict*, as vLLM compiles it: an object that does not say
which other keys it allows (`additionalProperties`, `patternProperties`, `unevaluatedProperties`)
allows none (`strict_schema`). Without that, a model may write a key of its own and run to
max_tokens inside a string; clients that drop `additionalProperties` from their schemas (LiteLLM,
LangChain) would get arguments that do not parse. Taught in notebooks/11_*.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..errors import NanoserveError

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
TOOL_CALL_PARSERS = ("hermes",)  # the formats "auto" can read calls in (vLLM's names)
AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                     "to be set")  # vLLM's message, word for word: clients look for it


@dataclass(frozen=True)
class ToolCallConfig:
    """How the server reads tool calls that tool_choice "auto" leaves to the model (vLLM's
    flags)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS

    def __post_init__(self):
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise NanoserveError(f"tool_call_parser={self.tool_call_parser!r}; allowed: "
                                 f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise NanoserveError("enable_auto_tool_choice needs tool_call_parser (allowed: "
                                 f"{', '.join(TOOL_CALL_PARSERS)})")

    def auto_parser(self, tools, tool_choice) -> str | None:
        """The parser for a request's output: None unless it has tools and tool_choice auto
        (given, or implied by tools without a tool_choice); a 400 if auto is off."""
        if not tools or tool_choice not in (None, "auto"):
            return None
        if not self.enable_auto_tool_choice:
            raise NanoserveError(AUTO_NEEDS_PARSER)
        return self.tool_call_parser


def functions(tools: list[dict] | None) -> dict[str, dict]:
    """{name: parameters schema} of the request's tools, each checked: {"type": "function",
    "function": {...}}."""
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise NanoserveError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}, got {tool!r:.120}'
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise NanoserveError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params
    return out


def forced(tools: list[dict] | None, tool_choice,
           parallel: bool | None) -> tuple[str | None, dict | None]:
    """(mode, JSON schema the output must match): ("named", its parameters), ("required", an array
    of calls), or (None, None) for "none" / "auto" / no tools."""
    fns = functions(tools)
    if tool_choice in (None, "none", "auto"):
        return None, None
    if not fns:
        raise NanoserveError(f"tool_choice={tool_choice!r} needs tools")
    if tool_choice == "required":
        # a tool's local $refs meant its parameters' root: rebased to where they sit in the array
        call = []
        for i, (name, schema) in enumerate(fns.items()):
            parameters = rebase_refs(strict_schema(schema),
                                     f"#/items/anyOf/{i}/properties/parameters")
            properties = {"name": {"const": name}, "parameters": parameters}
            call.append({"type": "object", "properties": properties,
                         "required": ["name", "parameters"], "additionalProperties": False})
        array = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        return "required", {**array, "maxItems": 1} if parallel is False else array
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or name is None:
        raise NanoserveError(
            f"tool_choice={tool_choice!r:.120}: allowed are 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in fns:
        raise NanoserveError(f"tool_choice names the function {name!r}, which is not among the "
                             f"tools ({', '.join(fns)})")
    return "named", strict_schema(fns[name])


LITERAL_KEYWORDS = ("const", "enum", "default", "examples")  # JSON values, not schemas: left alone
# where a JSON schema holds other schemas: one, a list of them, or a map of names to them
SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
             "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` in which every object schema that does not say which other keys it
    allows allows none (additionalProperties: false). Parts of an allOf are left open: closing
    each would refuse the keys the others list."""
    root = json.loads(json.dumps(schema))
    stack: list = [(root, True)]
    while stack:
        node, may_close = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
            kind is None and "properties" in node)
        if may_close and is_object and not any(k in node for k in OPEN_KEYS):
            node["additionalProperties"] = False
        for key in SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], True))
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((child, key != "allOf") for child in node[key])
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((child, True) for child in node[key].values())
    return root



def rebase_refs(schema: dict, base: str) -> dict:
    """A copy of `schema` whose JSON-pointer `$ref`s ("#", "#/...") point at the same places once
    the schema sits at pointer `base` of a larger document (walked with a stack: no recursion)."""
    root = json.loads(json.dumps(schema))
    stack: list = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = base + ref[1:]
            stack.extend(v for k, v in node.items() if k not in LITERAL_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return root


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: a tool call's `arguments` string parsed to an
    object."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # left as the string it is
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def function_call(name: str, arguments) -> dict:
    """A call as OpenAI's tool_calls list holds it (arguments as JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def extract(text: str, mode: str | None, tool_choice, hermes: bool, parallel: bool | None = None
            ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of one choice's text; with parallel=False, parsed calls past the first
    are dropped."""
    if mode == "named":
        return None, [function_call(tool_choice["function"]["name"], text)]
    if mode == "required":
        try:
            return None, [function_call(c["name"], c["parameters"]) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # cut short by max_tokens: not a complete array
    if not hermes:
        return text, []
    calls = []
    for block in HERMES.findall(text):
        try:
            obj = json.loads(block)
            calls.append(function_call(obj["name"], obj.get("arguments", {})))
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # not well formed: the text as it is
    if not calls:
        return text, []
    rest = HERMES.sub("", text).strip()
    return rest or None, calls[:1] if parallel is False else calls
