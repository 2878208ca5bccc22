"""Structured outputs (engine/structured_output.py): a grammar as a token mask.

Oracles outside the code: `jsonschema` validates what the JSON-schema requests produce, Python's
`re` / `regex` (partial matching) decides which tokens may follow a prefix, and plain generation
without the mask is the negative control. Through speculative decoding and the HTTP server too."""

from __future__ import annotations

import json
import re

import pytest
import regex
import torch

from nanoserve import LLM
from nanoserve.engine.sampler import SamplingParams
from nanoserve.engine.structured_output import StructuredOutputsParams, apply_bitmask, token_bitmask
from nanoserve.errors import NanoserveError

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["king", "queen", "fool"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
N = 200


@pytest.fixture(scope="module")
def llm():
    return LLM("demo")


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def test_json_schema_samples_all_validate_and_without_the_mask_none_do(llm):
    """200 seeded samples at temperature 1 under the schema: every one parses and validates. The
    same 200 without the constraint (the negative control): not one does."""
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                                  structured_outputs={"json": SCHEMA})
                   for i in range(N)]
    outs = llm.generate(["ROMEO:"] * N, constrained, use_tqdm=False)
    assert sum(_valid(o.text) for o in outs) == N
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > N // 4  # sampled, not one string
    free = llm.generate(["ROMEO:"] * N,
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=80) for i in range(N)],
                        use_tqdm=False)
    assert sum(_valid(o.text) for o in free) == 0


def test_regex_and_choice(llm):
    date = r"\d{4}-\d{2}-\d{2}"
    outs = llm.generate(["Date: "] * 20,
                        [SamplingParams(temperature=1.0, seed=i, structured_outputs={"regex": date})
                                          for i in range(20)], use_tqdm=False)
    assert all(re.fullmatch(date, o.text) for o in outs)
    choices = ["yes", "no", "a.b (c)*"]  # regex metacharacters are literal in a choice
    pick = [SamplingParams(temperature=1.5, seed=i,
                           structured_outputs={"choice": choices}) for i in range(30)]
    outs = llm.generate(["Well? "] * 30, pick, use_tqdm=False)
    assert {o.text for o in outs} <= set(choices) and len({o.text for o in outs}) >= 2


def test_the_mask_allows_exactly_the_tokens_a_regex_can_continue_with(llm):
    """Independent oracle: `regex`'s partial fullmatch says whether prefix + byte can still
    match."""
    tok = llm.engine.tokenizer
    pattern = r"(ab|cd)+[0-9]{2}"
    matcher = llm.engine.inputs.grammars.matcher(StructuredOutputsParams(regex=pattern))
    prefix = ""
    for token in tok.encode("abcdab1"):
        mask = token_bitmask([matcher], 257)
        allowed = apply_bitmask(torch.zeros(1, 257), mask)[0] == 0
        want = [
            t < 256 and chr(t).isascii()
            and regex.fullmatch(pattern, prefix + chr(t), partial=True) is not None
            for t in range(257)
        ]
        # EOS: only when the text is complete
        want[256] = regex.fullmatch(pattern, prefix) is not None
        assert allowed.tolist() == want, prefix
        assert matcher.consume_token(token)
        prefix += tok.decode([token])


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(["ROMEO:"], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=80,
                                                  structured_outputs={"json": SCHEMA}),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(_valid(c.text) for c in out.outputs)


def test_structured_outputs_with_speculative_decoding():
    """The draft model drafts under the grammar's mask and verification masks each draft position:
    greedy equals plain greedy token for token, most drafts are accepted, and sampled outputs all
    validate."""
    plain = LLM("demo")  # the draft's cost pinned: measured, a slow machine could switch it off
    spec = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=4,
               speculative_cost=0.1)
    greedy = SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": SCHEMA})
    a, b = plain.generate(["ROMEO:"], greedy)[0], spec.generate(["ROMEO:"], greedy)[0]
    assert a.token_ids == b.token_ids and _valid(b.text)
    stats = b.outputs[0].spec_stats
    # the draft model drafts under the grammar too: most drafts pass (unmasked, 1 of 24 did)
    assert stats.num_steps > 0 and stats.num_accepted_tokens >= stats.num_draft_tokens // 2, stats
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                              structured_outputs={"json": SCHEMA})
               for i in range(30)]
    outs = spec.generate(["ROMEO:"] * 30, sampled, use_tqdm=False)
    assert all(_valid(o.text) for o in outs)
    assert sum(o.outputs[0].spec_stats.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("kw, says", [
    (dict(regex="((("), "does not compile"), (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(), "exactly one of"), (dict(choice=[]), "choice="), (dict(choice=["a", 3]), "choice="),
    (dict(json="{not json"), "not a JSON schema"),
    (dict(grammar="start: undefined_rule"), "does not compile"),
])
def test_bad_constraints_are_refused_by_name(llm, kw, says):
    with pytest.raises(NanoserveError, match=re.escape(says)):
        llm.generate(["x"], SamplingParams(structured_outputs=kw))


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(NanoserveError,
                       match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a"})


@pytest.mark.shared
def test_a_sentencepiece_model_is_refused_by_name():
    from testdata import shared_path

    llm = LLM(str(shared_path("models", "stories260K", "stories260K.bin")))
    with pytest.raises(NanoserveError, match="SentencePiece vocabularies are not supported"):
        llm.generate(["Once"], SamplingParams(structured_outputs={"regex": "a+"}))


def test_a_matcher_in_error_fails_its_request_alone(llm):
    """A grammar that breaks mid-way (here: a matcher forced into its error state) fails that
    request; the others in the same steps finish, and the pool is whole again."""
    engine = llm.engine
    bad = engine.add_request("ROMEO:", SamplingParams(temperature=1.0, seed=0, max_tokens=20,
                                                      structured_outputs={"regex": "[a-z]{5,9}"}))
    good = engine.add_request("JULIET:", SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                                        structured_outputs={"regex": "[a-z]{5,9}"}))
    plain = engine.add_request("NURSE:", SamplingParams(temperature=1.0, seed=2, max_tokens=5))
    # not in the grammar: error state
    engine.requests[bad].samples[0].matcher.consume_token(ord("Z"))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[bad].error is not None and "grammar" in outs[bad].error
    assert outs[good].error is None and re.fullmatch("[a-z]{5,9}", outs[good].text)
    assert outs[plain].error is None and len(outs[plain].token_ids) == 5
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks
