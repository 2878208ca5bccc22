"""How much grammar work one request may ask for, checked before anything is compiled.

A structured-output constraint is a program the client writes and the server runs: compiled once,
then advanced and asked for a mask at every token. Left unbounded, one small request can crash the
process (a chain of 3,000 Lark rules overflows the native compiler's stack), hold a core for
seconds (`(a{1000}){999}` is a regex of 999,000 characters once its counts are expanded) or ask
for a language with no finite string at all (a schema whose object requires itself). So every
constraint passes three gates, each with a 400 that names the limit:

1. **Before compiling** (`check_constraint`, here): the constraint's size in bytes, its nesting
   (brackets inside brackets), the number of Lark rules or choices, a regex's expanded size, and,
   for a JSON schema, that some finite value satisfies it (`has_finite_value`).
2. **While compiling** (GrammarCompiler, structured_output.py): llguidance's own parser limits
   (`parser_limits`, its LLParserLimits, every field set here on purpose), a compile deadline,
   a thread with a stack far deeper than any grammar the limits let through, and the first mask
   computed there, off the engine's step: a constraint that allows no first token is refused.
3. **At every step** (LLMEngine._grammar_masks): a row whose mask takes more than `mask_budget_ms`
   of its thread's CPU time fails alone; the others' step goes on. (A bound per row: a step of R
   such rows can still take up to R budgets.)

    GrammarLimits()                          the defaults below
    LLM(model, grammar_limits=GrammarLimits(max_bytes=1 << 20))
                                             (nanoserve/config/structured_outputs.py)

Taught in notebooks/11_*.
"""

from __future__ import annotations

import json
from collections import deque

from ..config import GrammarLimits  # (the limits live with the other configs)
from ..errors import GrammarError, NanoserveError  # noqa: F401  (GrammarError: its old home)


def over(name: str, value: int, limits: GrammarLimits, what: str) -> GrammarError:
    """The 400 for a limit exceeded: what the request holds, the limit's name and value."""
    return GrammarError(
        f"structured outputs: {what} is {value}, over GrammarLimits.{name}={getattr(limits, name)}"
    )


# ------------------------------------------------------------------------------ gate 1: the text
def check_constraint(kind: str, value, limits: GrammarLimits) -> None:
    """Raise GrammarError when a constraint (StructuredOutputsParams' kind, value) is over a limit,
    is malformed, or, for a JSON schema, has no finite value."""
    try:
        _check_constraint(kind, value, limits)
    except GrammarError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
        raise GrammarError(
            f"structured outputs: the {kind} constraint is malformed ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from None


def _check_constraint(kind: str, value, limits: GrammarLimits) -> None:
    if kind == "json":
        schema = value
        if isinstance(value, str):
            check_size(len(value.encode()), limits, "the schema's size in bytes")
            try:
                schema = json.loads(value)
            except RecursionError:
                deeper = limits.max_nesting + 1
                raise over("max_nesting", deeper, limits, "the schema's nesting") from None
            except json.JSONDecodeError as e:
                raise GrammarError(f"structured outputs: json is not a JSON schema: {e}") from None
        text = json.dumps(schema, ensure_ascii=False)
        check_size(len(text.encode()), limits, "the schema's size in bytes")
        depth = json_depth(schema)
        if depth > limits.max_nesting:
            raise over("max_nesting", depth, limits, "the schema's nesting")
        if not has_finite_value(schema):
            raise GrammarError(
                "structured outputs: the JSON schema admits no finite value (a cycle of "
                "$ref, or an object or array that requires itself through its properties or "
                "items)"
            )
    elif kind == "regex":
        check_size(len(value.encode()), limits, "the regex's size in bytes")
        check_nesting(value, "(", ")", limits, "the regex's nesting of groups")
        size = regex_size(value)
        if size > limits.max_regex_size:
            raise over("max_regex_size", size, limits, "the regex's expanded size")
    elif kind == "choice":
        if len(value) > limits.max_choices:
            raise over("max_choices", len(value), limits, "the number of choices")
        check_size(sum(len(c.encode()) for c in value), limits, "the choices' size in bytes")
    elif kind == "grammar":
        check_size(len(value.encode()), limits, "the grammar's size in bytes")
        check_nesting(value, "([{", ")]}", limits, "the grammar's nesting of brackets")
        rules = lark_rule_count(value)
        if rules > limits.max_rules:
            raise over("max_rules", rules, limits, "the number of Lark rules and terminals")


def check_size(size: int, limits: GrammarLimits, what: str) -> None:
    """GrammarError when `size` bytes are over max_bytes."""
    if size > limits.max_bytes:
        raise over("max_bytes", size, limits, what)


def check_nesting(text: str, opening: str, closing: str, limits: GrammarLimits, what: str) -> None:
    """The deepest bracket nesting in `text`, counted without recursion (escaped and quoted brackets
    count too: an over-count only ever refuses, it cannot let a deeper text through)."""
    depth = deepest = 0
    for ch in text:
        if ch in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closing:
            depth = max(depth - 1, 0)
    if deepest > limits.max_nesting:
        raise over("max_nesting", deepest, limits, what)


def json_depth(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (an explicit stack: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def lark_rule_count(grammar: str) -> int:
    """Definitions in a Lark grammar: lines of the form `name: ...` (rules, lowercase; terminals,
    uppercase; with Lark's `?`, `!` and `.priority` decorations)."""
    count = 0
    for line in grammar.splitlines():
        head, colon, _ = line.partition(":")
        name = head.strip().lstrip("?!").split(".")[0].lstrip("_")  # `_name`: an inlined rule
        if colon and name.replace("_", "a").isalnum() and name[:1].isalpha():
            count += 1
    return count


# ----------------------------------------------------------------------- a regex's expanded size
def regex_size(pattern: str) -> int:
    """The regex's length once every counted repetition is written out: `a{3}` counts 3, `(ab){2,5}`
    counts 10, `(a{1000}){999}` 999,000. `*`, `+` and `?` count once (a loop costs no more states
    than its body). Escapes and classes count one each. An estimate of the automaton's size, the
    quantity llguidance's derivative lexer pays for, computed with an explicit stack."""
    stack: list[list[int]] = [
        [0, 0]
    ]  # per open group: [size of the group so far, size of the last atom]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i = _escape_end(pattern, i)
            _add_atom(stack, 1)
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            _add_atom(stack, 1)
            continue
        if ch == "(":
            stack.append([0, 0])
            i = _group_body(pattern, i)
            continue
        elif ch == ")" and len(stack) > 1:
            inner, _ = stack.pop()
            _add_atom(stack, inner)
        elif ch == "{":
            count, i = _repeat_count(pattern, i)
            if count is not None:
                top = stack[-1]
                top[0] += top[1] * (count - 1)  # the last atom, written out `count` times
                top[1] *= count
                continue
            _add_atom(stack, 1)
        elif ch == "|":
            stack[-1][1] = 0
        elif ch not in "*+?":
            _add_atom(stack, 1)
        i += 1
    return sum(size for size, _ in stack)


def _add_atom(stack: list[list[int]], size: int) -> None:
    stack[-1][0] += size
    stack[-1][1] = size


def _group_body(pattern: str, i: int) -> int:
    """Where the body of the group opening at pattern[i] ('(') starts: after `(?:`, `(?P<name>`
    or `(?<name>`, else right after '('."""
    if pattern.startswith("(?:", i):
        return i + 3
    if pattern.startswith(("(?P<", "(?<"), i) and pattern.find(">", i) > 0:
        return pattern.find(">", i) + 1
    return i + 2 if pattern.startswith("(?", i) else i + 1


def _escape_end(pattern: str, i: int) -> int:
    """The index after the escape at pattern[i] (a backslash): two characters, or `\\x{...}`,
    `\\u{...}`, `\\p{...}`, `\\P{...}` through their closing brace."""
    if pattern[i + 1 : i + 2] in ("x", "u", "p", "P") and pattern[i + 2 : i + 3] == "{":
        end = pattern.find("}", i + 3)
        return end + 1 if end > 0 else len(pattern)
    return i + 2


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at pattern[i] ('[')."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


MAX_COUNT_DIGITS = 9  # a longer count is read as 10⁹: over any limit, without parsing it


def _repeat_count(pattern: str, i: int) -> tuple[int | None, int]:
    """At pattern[i] == '{': (the largest count of `{n}`, `{n,}` or `{n,m}`, the index after '}'),
    (None, i) when the brace is a literal."""
    j = i + 1
    while j < len(pattern) and pattern[j] in "0123456789,":
        j += 1
    if j == len(pattern) or pattern[j] != "}":
        return None, i  # `{`, `{x}`: a literal brace
    parts = pattern[i + 1 : j].split(",")
    if len(parts) > 2 or not any(parts) or ("" in parts and len(parts) == 1):
        return None, i  # `{}`, `{,}`, `{1,2,3}`
    largest = parts[-1] or parts[0]
    if len(largest) > MAX_COUNT_DIGITS:
        return 10**MAX_COUNT_DIGITS, j + 1
    return max(int(largest), 1), j + 1


# ------------------------------------------------------------------------ a schema with no value
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # ("items": a list in draft 4)
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
              "contains")


def has_finite_value(root) -> bool:
    """Whether some finite JSON value satisfies the schema, judged on its structure: an object needs
    each required property's schema, a non-empty array its items', `allOf` every branch, `anyOf` /
    `oneOf` one, `$ref` its target. A least fixed point (every subschema starts without a value and
    gains one when its parts have theirs), so a cycle of requirements never gets one: the schema
    `{"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required":
    ["next"]}}, "$ref": "#/$defs/n"}` has no finite value. Computed with a worklist: a subschema is
    looked at again only when one of its parts gains a value (linear in the schema's size). What is
    not judged here counts as having a value (patterns, bounds, `not`: llguidance refuses what they
    make empty when it compiles): this check may let an empty schema through, never refuse one."""
    if not isinstance(root, dict):
        return root is not False
    nodes, parents = _schema_graph(root)
    finite: dict[int, bool] = {id(node): False for node in nodes}
    work = deque(nodes)  # children before parents
    while work:
        node = work.popleft()
        if finite[id(node)] or not _finite_now(node, root, finite):
            continue
        finite[id(node)] = True
        work.extend(parents.get(id(node), ()))
    return finite[id(root)]


def _schema_graph(root: dict) -> tuple[list[dict], dict[int, list[dict]]]:
    """Every dict subschema reachable from root, through its keywords and its local `$ref`s,
    children before parents; and for each, the subschemas that depend on it (an explicit stack)."""
    out, seen, parents = [], set(), {}
    stack: list = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for child in _children(node, root):
            parents.setdefault(id(child), []).append(node)
            stack.append((child, False))
    return out, parents


def _children(node: dict, root: dict) -> list[dict]:
    children = [node.get(key) for key in SCHEMA_ONE]
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            children += node[key]
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            children += node[key].values()
    children.append(_resolve(root, node.get("$ref")))
    return [child for child in children if isinstance(child, dict)]


def _finite_now(node: dict, root, finite: dict[int, bool]) -> bool:
    """Whether `node` has a finite value, given what `finite` says of its parts so far."""

    def ok(child) -> bool:
        if isinstance(child, bool):
            return child
        return not isinstance(child, dict) or finite.get(id(child), True)

    if "$ref" in node and not ok(_resolve(root, node["$ref"])):
        return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(ok(s) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if types and all(t in ("object", "array") for t in types):
        return any(_container_ok(node, t, ok) for t in types)
    return True


def _container_ok(node: dict, kind: str, ok) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if node.get("patternProperties"):  # a required name may match a pattern: not judged here
            named = [name for name in required if isinstance(name, str) and name in props]
            return all(ok(props[name]) for name in named)
        return all(ok(props[name]) if name in props else ok(extra)
                   for name in required if isinstance(name, str))
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) else 0
    items = node.get("items", True)
    if isinstance(items, list):  # draft 4: a tuple of schemas, then additionalItems
        prefix, rest = items, node.get("additionalItems", True)
    else:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        rest = items
    if not all(ok(s) for s in prefix[:least]):
        return False
    return least <= len(prefix) or ok(rest)


def _resolve(root, ref):
    """The subschema a local `$ref` ("#", "#/$defs/name", a JSON pointer into root) names; None for
    an anchor, another document's or a pointer to nothing (llguidance judges those itself)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdecimal() and len(part) < 9 \
                and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
