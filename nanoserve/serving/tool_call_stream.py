"""Tool calls streamed: each choice's text, as it grows, turned into OpenAI's streamed deltas.

A streamed chat choice is a run of deltas: `{"content": "..."}` for text, and for a call first
`{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name", "arguments": ""}}]}`,
then `{"tool_calls": [{"index": i, "function": {"arguments": "<a piece>"}}]}` as its arguments
arrive; a client joins the pieces of call i. Each tool_choice needs its own reader of the text
(tool_calls.py says what the text holds in each case):

- `NamedCall`: the whole text is the arguments of the one named function: nothing to look for;
- `RequiredCalls`: the text is a JSON array of {"name": ..., "parameters": {...}} objects (the
  grammar allows nothing else). A small incremental scanner follows strings and brackets; a call
  is announced once its name string has closed, and its arguments stream as the text of its
  "parameters" value grows, up to the end of that value;
- `HermesCalls` (tool_choice auto with the hermes parser): free text with
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. Text outside blocks streams as
  content, except what could still be the start of a tag, which waits for the next piece. A
  block becomes a call when its closing tag arrives (its arguments in one piece); a block that is
  not a call's JSON, or is cut off by the end of the text, is sent as content.

Each reader sees only the new text of a step (`feed`) and keeps the state it needs, so a long
answer costs time linear in its length. The joined stream equals the non-streamed answer for the
same seed, with two differences, both where the model went wrong: a non-streamed hermes answer with
a malformed block is all content, while a stream has already sent the calls before it; and a
"required" array cut off by max_tokens is content without calls when not streamed, while a stream
has sent the calls begun so far (finish_reason "length" either way). Taught in notebooks/11_*.
"""

from __future__ import annotations

import json

from .tool_calls import call_id, function_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class PlainText:
    """No tools: every piece is content."""

    num_calls = 0

    def feed(self, text: str, final: bool) -> dict:
        return {"content": text} if text else {}


class NamedCall:
    """tool_choice names one function: the text is its arguments, streamed as they come."""

    def __init__(self, name: str):
        self.name = name
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> dict:
        if self.num_calls == 0:
            self.num_calls = 1
            call = {"index": 0, "id": call_id(), "type": "function",
                    "function": {"name": self.name, "arguments": text}}
            return {"content": None, "tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}


class _Call:
    """One call of a "required" array as the scanner has seen it so far."""

    def __init__(self):
        self.name: str | None = None
        self.args_start: int | None = None  # where the "parameters" value begins in the text
        self.args_end: int | None = None  # where it ends, once it has
        self.announced = False  # its id and name were sent
        self.sent = 0  # characters of its arguments sent


class RequiredCalls:
    """tool_choice "required": the JSON array [{"name": ..., "parameters": ...}, ...], scanned
    character by character. Depth 1 is the array, depth 2 a call object; only depth 2's keys and
    values matter, everything deeper is inside a value."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_string = self.escape = False
        self.string_start = 0
        self.expect_key = False  # at depth 2: the next string is a key
        self.key: str | None = None  # the depth-2 key whose value is being read
        self.calls: list[_Call] = []

    @property
    def num_calls(self) -> int:
        return sum(c.announced for c in self.calls)

    def feed(self, text: str, final: bool) -> dict:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._scan(i, self.text[i])
        deltas = [d for d in (self._delta(i, c) for i, c in enumerate(self.calls)) if d]
        return {"tool_calls": deltas} if deltas else {}

    def _reading_parameters(self) -> bool:
        call = self.calls[-1] if self.calls else None
        return (self.depth == 2 and not self.expect_key and self.key == "parameters"
                and call is not None and call.args_start is None)

    def _scan(self, i: int, ch: str) -> None:
        if self.in_string:
            self._scan_string(i, ch)
        elif ch == '"':
            if self._reading_parameters():
                self.calls[-1].args_start = i
            self.in_string, self.string_start = True, i
        elif ch in "[{":
            if self._reading_parameters():
                self.calls[-1].args_start = i
            self.depth += 1
            if self.depth == 2:  # a call object opens
                self.calls.append(_Call())
                self.expect_key, self.key = True, None
        elif ch in "]}":
            self.depth -= 1
            if self.depth == 2 and self.key == "parameters":  # its object or array value closed
                self._end_parameters(i + 1)
            elif self.depth == 1 and self.key == "parameters":  # a number or literal value ends
                self._end_parameters(i)
        elif self.depth == 2 and ch == ":":
            self.expect_key = False
        elif self.depth == 2 and ch == ",":
            if self.key == "parameters":
                self._end_parameters(i)
            self.expect_key, self.key = True, None
        elif not ch.isspace() and self._reading_parameters():  # a number or a literal begins
            self.calls[-1].args_start = i

    def _scan_string(self, i: int, ch: str) -> None:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            if self.depth != 2:
                return
            value = json.loads(self.text[self.string_start:i + 1])
            if self.expect_key:
                self.key = value
            elif self.key == "name":
                self.calls[-1].name = value
            elif self.key == "parameters":  # a string value
                self._end_parameters(i + 1)

    def _end_parameters(self, end: int) -> None:
        call = self.calls[-1]
        if call.args_start is not None and call.args_end is None:
            call.args_end = len(self.text[:end].rstrip())

    def _delta(self, index: int, call: _Call) -> dict | None:
        """The new part of call `index`: its id and name the first time, then arguments."""
        if call.name is None:
            return None  # announced once its name is known, arguments held until then
        end = len(self.text) if call.args_end is None else call.args_end
        piece = "" if call.args_start is None else self.text[call.args_start + call.sent:end]
        call.sent += len(piece)
        if not call.announced:
            call.announced = True
            return {"index": index, "id": call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": piece}}
        return {"index": index, "function": {"arguments": piece}} if piece else None


class HermesCalls:
    """tool_choice auto, hermes parser: content, and <tool_call> blocks turned into calls.
    `parallel=False` keeps only the first call (the others are dropped, as without streaming)."""

    def __init__(self, parallel: bool | None = None):
        self.parallel = parallel
        self.buffer = ""  # text not yet sent: a possible tag's start, or an open block
        self.in_block = False
        self.num_calls = 0
        self.held_space = ""  # whitespace sent only if more content follows it
        self.sent_content = False

    def feed(self, text: str, final: bool) -> dict:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.in_block:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_tag(self.buffer, OPEN)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer, self.in_block = self.buffer[at + len(OPEN):], True
                continue
            at = self.buffer.find(CLOSE)
            if at < 0:
                if final:  # cut off inside a block: what there is, as text
                    content.append(OPEN + self.buffer)
                    self.buffer = ""
                break
            block = self.buffer[:at]
            self.buffer, self.in_block = self.buffer[at + len(CLOSE):], False
            call = _parse_block(block)
            if call is None:
                content.append(OPEN + block + CLOSE)
            elif self.parallel is not False or self.num_calls == 0:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
        delta = {}
        text_out = self._trim("".join(content), final)
        if text_out:
            delta["content"] = text_out
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _trim(self, text: str, final: bool) -> str:
        """Content as the non-streamed answer has it: without leading or trailing whitespace."""
        text = self.held_space + text
        if not self.sent_content:
            text = text.lstrip()
        body = text.rstrip()
        self.held_space = "" if final else text[len(body):]
        self.sent_content = self.sent_content or bool(body)
        return body


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_block(block: str) -> dict | None:
    """A <tool_call> block's {"name", "arguments"} as a call, or None when it is not one."""
    try:
        obj = json.loads(block)
        return function_call(obj["name"], obj.get("arguments", {}))
    except (json.JSONDecodeError, TypeError, KeyError):
        return None


def reader(mode: str | None, tool_choice, hermes: bool, parallel: bool | None):
    """The reader for a choice of a request with this tool mode (tool_calls.forced)."""
    if mode == "named":
        return NamedCall(tool_choice["function"]["name"])
    if mode == "required":
        return RequiredCalls()
    if hermes:
        return HermesCalls(parallel)
    return PlainText()
