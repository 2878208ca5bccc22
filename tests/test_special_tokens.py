"""Special-token text in a prompt ("<|endoftext|>" written out), held to HF's tokenizers: by
default it becomes the special token's id, as `AutoTokenizer` encodes it (and vLLM, which uses
it); with the engine's `split_special_tokens` it stays ordinary text, as `AutoTokenizer(...,
split_special_tokens=True)` encodes it. The same holds through the server's /tokenize and the
prompt a completion runs on."""

from __future__ import annotations

import pytest
from live_server import LiveServer, _post
from testdata import shared_path

from nanoserve.engine import LLMEngine
from nanoserve.models.loader import resolve_model_path
from nanoserve.serving.async_engine import AsyncLLMEngine
from nanoserve.serving.server import create_app
from nanoserve.tokenizers import gpt2_tokenizer, save_hf_tokenizer
from nanoserve.tokenizers.specials import encode_with_special_tokens

transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
TEXTS = [f"ROMEO:{EOT}JULIET:", f"{EOT}{EOT}", f"a<|endof{EOT}text|>b", f" {EOT} x", "no special",
         f"<|endoftext|{EOT}>"]


def _engine(split: bool) -> LLMEngine:
    return LLMEngine.from_kwargs("demo", num_blocks=32, split_special_tokens=split)


@pytest.mark.parametrize("split", [False, True])
def test_the_engine_encodes_prompts_as_hf_does(split):
    hf = transformers.AutoTokenizer.from_pretrained(resolve_model_path("demo"),
                                                    split_special_tokens=split)
    engine = _engine(split)
    for text in TEXTS:
        assert engine.inputs.encode_prompt(text) == hf(text)["input_ids"], (split, text)


def test_negative_control_the_two_settings_differ_on_these_texts():
    """Either setting held to the other's reference fails: the test above can tell them apart."""
    hf = transformers.AutoTokenizer.from_pretrained(resolve_model_path("demo"))
    engine = _engine(True)
    assert sum(engine.inputs.encode_prompt(t) != hf(t)["input_ids"] for t in TEXTS) == 5


@pytest.mark.shared
def test_gpt2s_vocabulary_agrees_with_hf(tmp_path):
    """GPT-2's 50k merges written as tokenizer.json: `<|endoftext|>` mid-word, doubled, broken."""
    ours = gpt2_tokenizer(shared_path("models", "gpt2-tokenizer"))
    save_hf_tokenizer(ours, tmp_path, 1024)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text()[:4000]
    texts = TEXTS + [text.replace("\n\n", EOT), text[:999] + EOT]
    for t in texts:
        ids = encode_with_special_tokens(t, ours)
        assert ids == hf(t)["input_ids"], t[:60]
        assert ids.count(50256) == t.count(EOT)


@pytest.mark.parametrize("split", [False, True])
def test_tokenize_and_completions_follow_the_setting(split):
    """/tokenize's ids are those the completion ran on (its usage counts them), and HF's."""
    hf = transformers.AutoTokenizer.from_pretrained(resolve_model_path("demo"),
                                                    split_special_tokens=split)
    server = LiveServer(create_app(AsyncLLMEngine(_engine(split)), "demo"))
    try:
        prompt = f"ROMEO:{EOT}JULIET:"
        status, _, body = _post(server.port, "/tokenize", {"prompt": prompt})
        assert status == 200, body
        assert body["tokens"] == hf(prompt)["input_ids"]
        assert (256 in body["tokens"]) is not split
        out = server.client().completions.create(model="demo", prompt=prompt, max_tokens=1)
        assert out.usage.prompt_tokens == body["count"]
    finally:
        server.stop()
