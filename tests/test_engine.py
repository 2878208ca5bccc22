"""LLM.generate / stream / logits on real forwards: stop conditions, seeds, streaming, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.outputs import IncrementalText
from nanoserve.tokenizers import byte_level_tokenizer


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    return LLM(str(hf_checkpoints["llama-gqa"][0]), dtype="float32", device="cpu")


def test_logits_equal_full_forward(llm, hf_checkpoints):
    hf = hf_checkpoints["llama-gqa"][1]
    ids = [5, 6, 7, 200, 3]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = llm.logits(ids)
    assert out.shape == (5, llm.config.vocab_size) and out.dtype == torch.float32
    assert (out - ref).abs().max() <= 1e-4


def test_seed_reproduces_and_differs(llm):
    p = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, seed=7, ignore_eos=True)
    a, b = llm.generate([[1, 2, 3]], p)[0], llm.generate([[1, 2, 3]], p)[0]
    c = llm.generate([[1, 2, 3]],
                     SamplingParams(temperature=1.0, top_k=50, max_tokens=24, seed=8,
                                    ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[1, 2, 3]],
                          SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_at = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([[1, 2, 3]],
                       SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[:first + 1]  # the stop id is reported, not decoded
    assert (
        out.text
        == llm.tokenizer.decode([1, 2, 3] + greedy.token_ids[:first])[
            len(llm.tokenizer.decode([1, 2, 3])) :
        ]
    )


def test_stop_string_truncates_text():
    """A stop string that spans tokens: text ends right before it, finish_reason "stop"."""
    tok = byte_level_tokenizer()
    tracker = IncrementalText(tok, ["lo w"])
    pieces = [tracker.add(t)[0] for t in tok.encode("hel")]
    delta, hit = tracker.add(tok.encode("l")[0])
    pieces.append(delta)
    for t in tok.encode("o w"):
        delta, hit = tracker.add(t)
        pieces.append(delta)
        if hit:
            break
    assert hit and tracker.text == "hel" and "".join(pieces) == "hel"


def test_stream_concatenates_to_generate_text(llm):
    p = SamplingParams(temperature=0.9, max_tokens=30, seed=3, ignore_eos=True)
    streamed = "".join(llm.stream([9, 8, 7], p))
    assert streamed == llm.generate([[9, 8, 7]], p)[0].text


def test_multibyte_characters_are_not_split_in_stream():
    tok = byte_level_tokenizer()
    tracker = IncrementalText(tok, [])
    deltas = [tracker.add(t)[0] for t in tok.encode("añ🦙b")]
    assert "".join(deltas) + tracker.flush() == "añ🦙b"
    assert all("\ufffd" not in d for d in deltas)


def test_context_limit_finishes_with_length(llm):
    n = llm.max_model_len - 3
    out = llm.generate([[1] * n], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_text_prompt_and_several_prompts(llm):
    outs = llm.generate(["Hi", "there"],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert outs[0].prompt == "Hi" and outs[0].prompt_token_ids == list(b"Hi")
    assert outs[0].ttft is not None and outs[0].e2e_latency >= outs[0].ttft


def test_cli_generate_streams_text_to_stdout_and_stats_to_stderr(hf_checkpoints):
    path = hf_checkpoints["gpt2"][0]
    r = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "--model", str(path),
                        "--prompt", "ab",
                        "--max-tokens", "5", "--temperature", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    llm = LLM(str(path), dtype="float32")
    expected = llm.generate("ab", SamplingParams(temperature=0, max_tokens=5))[0].text
    assert r.stdout == expected + "\n"
    assert "generated_tokens=" in r.stderr and "tokens/s=" in r.stderr
