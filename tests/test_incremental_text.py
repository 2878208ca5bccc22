"""IncrementalText (engine/outputs.py) decodes each new token in O(its own length) and must still
give, after every token, exactly what decoding all the ids at once gives — the tokenizer's own
`decode` is the oracle — on byte-level BPE (where tokens split UTF-8 characters) and SentencePiece
(where a continuation's leading space depends on what precedes it). Stop strings cut the text at
their first occurrence, also when they span many tokens."""

from __future__ import annotations

import random

import pytest
from testdata import shared_path

from nanoserve.engine.outputs import IncrementalText
from nanoserve.tokenizers import byte_level_tokenizer, load_tokenizer


def _tokenizers():
    yield "bytes", byte_level_tokenizer()
    yield "gpt2", load_tokenizer(shared_path("models", "gpt2-tokenizer"))
    yield "llama2", load_tokenizer(shared_path("models", "llama2-tokenizer"))


def _stream(tok, rng: random.Random, n: int) -> list[int]:
    text = "".join(rng.choice(["héllo", " wörld", "🦙", " 日本語", "\n\n", "a", " the", "ß",
                               "  x"]) for _ in range(n))
    ids = tok.encode(text)
    # also ids no encoder would produce (e.g. bytes that never complete a character)
    if rng.random() < 0.5:
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.2 else t for t in ids]
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_text_after_every_token_equals_decoding_everything(seed):
    for name, tok in _tokenizers():
        rng = random.Random(seed)
        prompt, out = _stream(tok, rng, 5), _stream(tok, rng, 40)
        inc, deltas = IncrementalText(tok, [], prompt), []
        ctx = prompt[-IncrementalText.WINDOW:]
        for i, t in enumerate(out):
            delta, hit = inc.add(t)
            deltas.append(delta)
            assert not hit
            expected = tok.decode(ctx + out[: i + 1])[len(tok.decode(ctx)):]
            assert inc.text == expected, (name, seed, i)
        deltas.append(inc.flush())
        assert "".join(deltas) == tok.decode(ctx + out)[len(tok.decode(ctx)):], name


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_cut_at_their_first_occurrence(seed):
    tok = byte_level_tokenizer()
    rng = random.Random(seed)
    out = _stream(tok, rng, 30)
    full = tok.decode(out)
    # a stop string somewhere in the middle, spanning tokens
    stop = full[len(full) // 2: len(full) // 2 + 5]
    inc, deltas, hit = IncrementalText(tok, [stop, "never there"], []), [], False
    for t in out:
        delta, hit = inc.add(t)
        deltas.append(delta)
        if hit:
            break
    assert hit and "".join(deltas) == inc.text == full[: full.find(stop)]


def test_the_window_matters_negative_control():
    """Without ids in front of the new ones, SentencePiece drops each continuation's leading
    space."""

    class NoWindow(IncrementalText):
        WINDOW = 0

    tok = load_tokenizer(shared_path("models", "llama2-tokenizer"))
    ids = tok.encode("Once upon a time there was")
    right, wrong = IncrementalText(tok, [], []), NoWindow(tok, [], [])
    for t in ids:
        right.add(t)
        wrong.add(t)
    assert right.text == tok.decode(ids) != wrong.text
