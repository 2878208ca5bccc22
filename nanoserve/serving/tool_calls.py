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
calls). Streamed, a named function's arguments arrive in pieces (`named_delta`); "required" and a
parsed "auto" need the whole text first, so the server refuses stream=true for them. Taught in
notebooks/11_*.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import NanoserveError

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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
            parameters = rebase_refs(schema, f"#/items/anyOf/{i}/properties/parameters")
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
    return "named", fns[name]


LITERAL_KEYWORDS = ("const", "enum", "default", "examples")  # JSON values, not schemas: left alone


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


def named_delta(first: bool, text: str, name: str, call_id: str) -> dict:
    """A stream's delta for a named tool_choice: the call's id and name first, then its arguments in
    pieces (OpenAI's streamed tool_calls shape)."""
    if first:
        call = {"index": 0, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": text}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def extract(text: str, mode: str | None, tool_choice, hermes: bool, parallel: bool | None = None
            ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of one choice's text; with parallel=False, parsed calls past the first
    are dropped."""
    if mode == "named":
        return None, [_call(tool_choice["function"]["name"], text)]
    if mode == "required":
        try:
            return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # cut short by max_tokens: not a complete array
    if not hermes:
        return text, []
    calls = []
    for block in HERMES.findall(text):
        try:
            obj = json.loads(block)
            calls.append(_call(obj["name"], obj.get("arguments", {})))
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # not well formed: the text as it is
    if not calls:
        return text, []
    rest = HERMES.sub("", text).strip()
    return rest or None, calls[:1] if parallel is False else calls
