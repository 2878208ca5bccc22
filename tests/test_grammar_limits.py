"""What a structured-output constraint may ask for (engine/grammar_limits.py), checked against
references outside the code: Python's own regex parser for a regex's expanded size, `jsonschema`
validating a hand-written witness for every schema said to have a finite value, and llguidance
itself, which fails the schemas said to have none once the check is off (the control). The deep
stack of the compile pool against a subprocess that compiles the same grammar on a default stack
(the crash the pool prevents)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.grammar_limits import (
    GrammarError,
    GrammarLimits,
    check_constraint,
    has_finite_value,
    lark_rule_count,
    regex_size,
)
from nanoserve.errors import NanoserveError

try:  # Python's regex parser: the reference for what a pattern's counts expand to
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse


# -------------------------------------------------------------------------------- a regex's size
def expanded_size(pattern: str) -> int:
    """The reference: the size of Python's parse tree with each bounded repeat written out."""
    return _tree_size(sre_parse.parse(pattern))


def _tree_size(items) -> int:
    total = 0
    for op, av in items:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            low, high, sub = av
            times = high if high != sre_constants.MAXREPEAT else low
            total += _tree_size(sub) * max(times, 1)
        elif op == sre_constants.SUBPATTERN:
            total += _tree_size(av[-1])
        elif op == sre_constants.BRANCH:
            total += sum(_tree_size(branch) for branch in av[1])
        else:  # a literal, a class, a category, an anchor
            total += 1
    return total


ATOMS = st.sampled_from(["a", "b", "[a-z]", "[^x]", "\\d", "\\.", "."])
QUANTIFIERS = st.sampled_from(["", "", "*", "+", "?", "{3}", "{2,5}", "{4,}", "{12}"])


def _alternation(opening: str, branches: list[str], quantifier: str) -> str:
    """A group of branches, each led by its own letter: Python's parser then keeps every branch as
    written (it factors a prefix branches share, merges one-character branches into a class)."""
    return opening + "|".join(lead + b for lead, b in zip("pqrs", branches)) + ")" + quantifier


def _patterns():
    atom = st.tuples(ATOMS, QUANTIFIERS).map("".join)
    return st.recursive(
        st.lists(atom, min_size=1, max_size=4).map("".join),
        lambda inner: st.one_of(
            st.builds(
                _alternation,
                st.sampled_from(["(", "(?:"]),
                st.lists(inner, min_size=1, max_size=3),
                QUANTIFIERS,
            ),
            st.lists(inner, min_size=2, max_size=3).map("".join),
        ),
        max_leaves=8,
    )


@settings(max_examples=300, deadline=None)
@given(_patterns())
def test_regex_size_equals_pythons_parse_tree_expanded(pattern):
    assert regex_size(pattern) == expanded_size(pattern), pattern


@pytest.mark.parametrize(
    "pattern,size",
    [
        ("(a{1000}){999}", 999_000),
        ("(ab){2,5}", 10),
        ("a{,3}", 3),
        ("x{abc}", 6),
        ("(?P<n>ab)c:", 4),
        ("[a-z]{1,50}@x\\.com", 56),
    ],
)
def test_regex_size_examples(pattern, size):
    assert regex_size(pattern) == size
    # control: the reference disagrees with a count that ignores repeats (its size without them)
    if "{" in pattern and re.search(r"\{\d", pattern):
        assert expanded_size(pattern) != len(re.sub(r"\{[^}]*\}", "", pattern))


# ------------------------------------------------------------------------- schemas with no value
NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
NO_VALUE = {
    "self-requiring object": {"$defs": {"n": NODE}, "$ref": "#/$defs/n"},
    "two arrays requiring each other": {
        "$defs": {
            "a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 1},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1},
        },
        "$ref": "#/$defs/a",
    },
    "a -> b -> a": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },
    "required but forbidden": {"type": "object", "required": ["x"], "additionalProperties": False},
    "anyOf of dead branches": {"$defs": {"n": NODE}, "anyOf": [{"$ref": "#/$defs/n"}, False]},
    "a long chain of refs in a cycle": {
        "$defs": {f"a{k}": {"$ref": f"#/$defs/a{(k - 1) % 1500}"} for k in range(1500)},
        "$ref": "#/$defs/a1499"},
}
# each with a finite value that satisfies it (checked by jsonschema, an outside validator)
HAS_VALUE = {
    "optional recursion": (
        {
            "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n",
        },
        {},
    ),
    "recursion with a way out": (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/n",
        },
        {"next": None},
    ),
    "tree of arrays": (
        {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"},
        [],
    ),
    "nullable self": (
        {
            "$defs": {
                "n": {
                    "type": ["object", "null"],
                    "properties": {"n": {"$ref": "#/$defs/n"}},
                    "required": ["n"],
                }
            },
            "$ref": "#/$defs/n",
        },
        None,
    ),
    "plain object": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"a": 1},
    ),
    "prefix items": ({"type": "array", "prefixItems": [{"type": "string"}], "minItems": 1}, ["x"]),
    "OpenAPI-style components": (
        {"components": {"schemas": {"X": {"type": "string"}}}, "type": "object",
         "properties": {"x": {"$ref": "#/components/schemas/X"}}, "required": ["x"]}, {"x": "s"}),
    "draft-4 tuple items": (
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
         "properties": {"t": {"type": "array", "items": [{"type": "integer"}]},
                                          "u": {"$ref": "#/properties/t/items/0"}},
         "required": ["u"]},
        {"u": 1}),
    "required by a pattern": (
        {"type": "object", "patternProperties": {"^a$": {"type": "string"}},
         "additionalProperties": False, "required": ["a"]}, {"a": "x"}),
    "a long chain of refs": (
        {"$defs": {f"a{k}": {"$ref": f"#/$defs/a{k - 1}"} if k else {"type": "string"}
                   for k in range(300)}, "$ref": "#/$defs/a299"}, "s"),
    "json pointer ref": (
        {
            "properties": {"a": {"type": "string"}},
            "items": {"$ref": "#/properties/a"},
            "type": "array",
            "minItems": 1,
        },
        ["s"],
    ),
}


@pytest.mark.parametrize("name", NO_VALUE)
def test_schemas_with_no_finite_value_are_refused(name):
    assert not has_finite_value(NO_VALUE[name])
    with pytest.raises(GrammarError, match="admits no finite value"):
        check_constraint("json", NO_VALUE[name], GrammarLimits())


@pytest.mark.parametrize("name", HAS_VALUE)
def test_schemas_with_a_finite_value_pass_and_the_witness_validates(name):
    jsonschema = pytest.importorskip("jsonschema")
    schema, witness = HAS_VALUE[name]
    jsonschema.validate(witness, schema)  # the schema really has this finite value
    assert has_finite_value(schema)
    check_constraint("json", schema, GrammarLimits())


def test_without_the_check_llguidance_fails_the_self_requiring_schema_late():
    """The control: the self-requiring object compiles and lets the first token through; only later
    does the parser give up (what was a 500 mid-request before the check)."""
    llguidance = pytest.importorskip("llguidance")
    from llguidance.tiktoken import lltokenizer_from_encoding

    from nanoserve.engine.structured_output import StructuredOutputsParams, llguidance_grammar
    from nanoserve.models.loader import load_model

    _, config, tok = load_model("demo")
    ll_tok = lltokenizer_from_encoding(
        tok.encoding, n_vocab=config.vocab_size, eos_token=tok.eos_id
    )
    grammar = llguidance_grammar(StructuredOutputsParams(json=NO_VALUE["self-requiring object"]))
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    assert not matcher.is_error() and matcher.compute_bitmask() is not None  # "{" is allowed ...
    accepted = matcher.consume_token(
        ord("{")
    )  # ... and then the forced '"next": {"next": ...' never ends
    assert not accepted or matcher.is_error()
    assert "Too many items" in matcher.get_error()


# ------------------------------------------------------------------------------ sizes and counts
CHAIN = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(3000)) + 'r3000: "b"\n'


def test_a_long_rule_chain_is_refused_by_name():
    assert lark_rule_count(CHAIN) == 3002
    assert lark_rule_count('?start: a\n!b.2: "x"\nNAME: /[a-z]+/\n%ignore " "\n// c: d\n') == 3
    with pytest.raises(
        GrammarError, match=r"Lark rules and terminals is 3002, over GrammarLimits.max_rules=1000"
    ):
        check_constraint("grammar", CHAIN, GrammarLimits())
    check_constraint(
        "grammar", CHAIN, GrammarLimits(max_rules=4000)
    )  # control: within a raised limit


@pytest.mark.parametrize(
    "kind,value,limit",
    [
        ("regex", "(a{1000}){999}", "max_regex_size"),
        ("regex", "(" * 100 + "a" + ")" * 100, "max_nesting"),
        ("json", {"type": "object", "description": "x" * 70_000}, "max_bytes"),
        ("json", '{"items": ' * 70 + "{}" + "}" * 70, "max_nesting"),
        ("choice", ["a" * 10**6], "max_bytes"),
        ("choice", [str(i) for i in range(1001)], "max_choices"),
        ("grammar", "start: " + "(" * 65 + '"a"' + ")" * 65, "max_nesting"),
    ],
)
def test_each_limit_names_itself(kind, value, limit):
    with pytest.raises(GrammarError, match=f"GrammarLimits.{limit}="):
        check_constraint(kind, value, GrammarLimits())
    check_constraint(
        kind, value, GrammarLimits(**{limit: 10**7})
    )  # control: the same under a raised limit


def test_limits_are_validated():
    for bad in (
        {"max_bytes": 0},
        {"max_rules": 1.5},
        {"compile_timeout_s": -1},
        {"max_nesting": True},
    ):
        with pytest.raises(NanoserveError, match=next(iter(bad))):
            GrammarLimits(**bad)
    assert GrammarLimits(compile_timeout_s=2).compile_timeout_s == 2


# ---------------------------------------------------------------------- the compile pool's stack
DEEP_CHAIN = (
    "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(20_000)) + 'r20000: "b"\n'
)
COMPILE_ON_A_THREAD = """
import sys, threading
from llguidance import LLMatcher
from llguidance.tiktoken import lltokenizer_from_encoding
from nanoserve.models.loader import load_model
_, config, tok = load_model("demo")
ll = lltokenizer_from_encoding(tok.encoding, n_vocab=config.vocab_size, eos_token=tok.eos_id)
grammar = LLMatcher.grammar_from_lark(sys.stdin.read())
threading.stack_size(int(sys.argv[1]))
t = threading.Thread(target=lambda: print(LLMatcher(ll, grammar, log_level=0).is_error()))
t.start(); t.join()
"""


def test_the_compile_pool_survives_a_chain_that_overflows_a_default_stack():
    """20,000 chained rules (over max_rules, raised here) compile in the pool's deep-stack threads;
    same compile on an 8 MiB thread stack (the usual default) kills its process (the control)."""
    pytest.importorskip("llguidance")
    from nanoserve import LLMEngine
    from nanoserve.engine.structured_output import StructuredOutputsParams

    raised = GrammarLimits(
        max_rules=10**6, max_bytes=10**7, step_max_items=10**7, compile_timeout_s=600
    )
    engine = LLMEngine.from_kwargs("demo", grammar_limits=raised)
    proto = engine.inputs.grammars.compile(StructuredOutputsParams(grammar=DEEP_CHAIN))
    assert not proto.is_error()
    assert threading.stack_size() == 0  # the pool put the process's default back
    crashed = subprocess.run(
        [sys.executable, "-c", COMPILE_ON_A_THREAD, str(8 << 20)],
        input=DEEP_CHAIN,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert crashed.returncode < 0, (
        crashed.stdout + crashed.stderr[-2000:]
    )  # killed by a signal (SIGSEGV)


def test_the_cache_keeps_what_its_bytes_hold_counted_at_the_lexers_largest():
    """cache_bytes for three grammars at their bound: the three most recently used stay."""
    pytest.importorskip("llguidance")
    from nanoserve import LLMEngine
    from nanoserve.engine.structured_output import StructuredOutputsParams

    limits = GrammarLimits(max_lexer_states=1000)
    limits = GrammarLimits(max_lexer_states=1000, cache_bytes=3 * limits.grammar_bytes_bound() + 1)
    assert limits.grammar_bytes_bound() == 1000 * 2048 and limits.cache_entries() == 3
    compiler = LLMEngine.from_kwargs("demo", grammar_limits=limits).inputs.grammars
    regexes = [f"[a-z]{{{n}}}" for n in range(1, 6)]
    for regex in regexes:
        compiler.compile(StructuredOutputsParams(regex=regex))
    compiler.compile(StructuredOutputsParams(regex=regexes[2]))  # used again: the most recent
    assert compiler.num_cached == 3 and compiler.cached_bytes_bound == 3 * 1000 * 2048
    kept = [key[1] for key in compiler._compiled]
    assert kept == [regexes[3], regexes[4], regexes[2]]


@pytest.mark.parametrize("kind,value", [
    ("json", {"anyOf": 5}), ("json", {"type": "object", "required": [{}]}),
    ("json", {"$ref": "#/anyOf/²", "anyOf": [{}]}), ("regex", "a{" + "9" * 5000 + "}"),
    ("regex", "\\x{2013}" * 6),
])
def test_malformed_constraints_are_grammar_errors_never_crashes(kind, value):
    """Whatever a client sends, the check ends in a GrammarError (a 400) or passes; never a
    TypeError or ValueError that a server would answer with a 500."""
    try:
        check_constraint(kind, value, GrammarLimits())
    except GrammarError:
        pass


def test_sizes_count_utf8_bytes_and_nesting_counts_structure_not_text():
    """A schema's size is its UTF-8 JSON (not \\u escapes); its nesting is its objects' and arrays',
    not brackets inside its strings."""
    words = {"type": "string", "description": "価値" * 5000}  # 30,000 bytes of UTF-8
    check_constraint("json", {"type": "object", "properties": {"a": words, "b": words}},
                     GrammarLimits())  # 60 kB: under 64 KiB (escaped, it would be 120 kB)
    texts = {f"p{i}": {"type": "number", "description": "a value in [0, 1)"} for i in range(80)}
    check_constraint("json", {"type": "object", "properties": texts}, GrammarLimits())
