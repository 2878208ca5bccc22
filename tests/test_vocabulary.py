"""A checkpoint's tokenizer and its vocabulary (issue 16): checked against the model's at load,
no tokenizer at all (token-id prompts work, text is a clear error, as vLLM's skip_tokenizer_init),
and an embedding padded past the tokenizer (ids the tokenizer cannot decode are never sampled)."""

from __future__ import annotations

import shutil

import pytest
import transformers
from testdata import tiny_hf_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.errors import ConfigError, NanoserveError, RequestFailedError
from nanoserve.models.loader import resolve_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IDS = [82, 79, 77, 69, 79, 58]  # "ROMEO:" in the demo's byte-level vocabulary


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """The demo model with only config.json and its weights."""
    path = tmp_path_factory.mktemp("notok") / "demo-weights-only"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(resolve_model_path("demo") / name, path / name)
    return path


def test_a_checkpoint_without_tokenizer_loads_and_takes_token_ids(no_tokenizer):
    llm, demo = LLM(str(no_tokenizer)), LLM("demo")
    assert llm.tokenizer is None
    out = llm.generate(IDS, GREEDY)[0]
    assert out.token_ids == demo.generate(IDS, GREEDY)[0].token_ids and out.text == ""
    assert (llm.logits(IDS) == demo.logits(IDS)).all()
    with pytest.raises(NanoserveError,
                       match="loaded without a tokenizer .* must be lists of token ids"):
        llm.generate("ROMEO:", GREEDY)
    with pytest.raises(NanoserveError, match="stop strings need a tokenizer"):
        llm.generate(IDS, SamplingParams(stop=["\n"]))
    assert llm.generate(IDS,
                        SamplingParams(temperature=0, max_tokens=50,
                                       stop_token_ids=[10]))[0].finish_reason \
        == demo.generate(IDS,
                         SamplingParams(temperature=0, max_tokens=50,
                                        stop_token_ids=[10]))[0].finish_reason


def test_the_server_answers_token_ids_and_refuses_text_without_a_tokenizer(no_tokenizer):
    pytest.importorskip("fastapi")
    from live_server import LiveServer, _post

    from nanoserve.engine import LLMEngine
    from nanoserve.serving.async_engine import AsyncLLMEngine
    from nanoserve.serving.server import create_app

    srv = LiveServer(create_app(AsyncLLMEngine(LLMEngine.from_kwargs(str(no_tokenizer))), "w"))
    try:
        status, _, body = _post(srv.port, "/v1/completions", {"model": "w", "prompt": "ROMEO:"})
        assert status == 400 and "without a tokenizer" in body["error"]["message"]
        status, _, body = _post(srv.port, "/v1/completions",
                                {"model": "w", "prompt": IDS, "max_tokens": 3})
        assert (
            status == 200 and body["usage"]["completion_tokens"] == 3
            and body["choices"][0]["text"] == ""
        )
    finally:
        srv.stop()


def _gpt2(vocab: int) -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=vocab,
                                   bos_token_id=None, eos_token_id=None)


def test_a_tokenizer_larger_than_the_model_is_refused_at_load(tmp_path):
    tiny_hf_checkpoint(_gpt2(200), tmp_path)  # the byte-level tokenizer has 257 ids
    with pytest.raises(ConfigError, match="has 257 token ids but the model's vocab_size is 200"):
        LLM(str(tmp_path))


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A random GPT-2 with 1000 embedding rows beside the 257-id byte-level tokenizer."""
    path = tmp_path_factory.mktemp("padded")
    tiny_hf_checkpoint(_gpt2(1000), path)
    return path


def test_a_padded_embedding_never_samples_ids_the_tokenizer_cannot_decode(padded):
    llm = LLM(str(padded))
    assert llm.engine.inputs.usable_vocab_size == 257
    outs = llm.generate(["ab", "cd", "ef"], SamplingParams(max_tokens=48, seed=0, ignore_eos=True))
    # 3/4 of the mass was above
    assert all(max(o.token_ids) < 257 and len(o.token_ids) == 48 for o in outs)
    with pytest.raises(NanoserveError,
                       match=r"token id 500 is outside the vocabulary; allowed ids are 0..256"):
        llm.generate([1, 500], GREEDY)


def test_padded_negative_control_without_the_mask_sampling_hits_an_undecodable_id(padded):
    llm = LLM(str(padded))
    llm.engine.inputs.usable_vocab_size = llm.config.vocab_size  # as before issue 16
    with pytest.raises(RequestFailedError, match="out of range"):
        llm.generate(["ab", "cd", "ef"], SamplingParams(max_tokens=48, seed=0, ignore_eos=True))
