"""The server's LoRA adapters (vLLM's `--lora-modules name=path`): a request's `model` field picks
the adapter, /v1/models lists them beside the base model, an unknown name is a 404 naming what is
served. What a request under an adapter returns equals the offline engine's output under the same
adapter (itself proven against PEFT in test_lora_serving.py); the control: the base model's answer
differs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from live_server import LiveServer  # noqa: E402
from lora_helpers import make_peft_adapter  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.engine import LLMEngine  # noqa: E402
from nanoserve.errors import NanoserveError  # noqa: E402
from nanoserve.lora.serving import parse_lora_modules  # noqa: E402
from nanoserve.models.loader import resolve_model_path  # noqa: E402
from nanoserve.serving.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.serving.server import create_app  # noqa: E402

PROMPT = "ROMEO:\nWhat"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(resolve_model_path("demo")).eval()
    root = tmp_path_factory.mktemp("lora")
    return {f"a{k}": str(make_peft_adapter(hf, root / f"a{k}", ["c_attn", "c_fc"], seed=k,
                                           lora_alpha=16)[1])
            for k in (1, 2)}


def test_a_requests_model_field_picks_its_adapter(adapters):
    loras = parse_lora_modules([f"{name}={path}" for name, path in adapters.items()])
    core = LLMEngine.from_kwargs("demo", enable_lora=True, max_loras=2, max_lora_rank=8)
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo", loras=loras))
    try:
        client = srv.client(api_key="none")
        listed = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        assert listed == {"demo": None, "a1": "demo", "a2": "demo"}
        texts = {}
        for name in ("demo", "a1", "a2"):
            r = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
            assert r.model == name
            texts[name] = r.choices[0].text
        with pytest.raises(openai.NotFoundError, match="'demo', 'a1', 'a2'"):
            client.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    finally:
        srv.stop()
    offline = LLM("demo", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12)
    for name in ("a1", "a2"):
        want = offline.generate([PROMPT], params, use_tqdm=False,
                                lora_request=loras[name])[0].outputs[0].text
        assert texts[name] == want
        assert texts[name] != texts["demo"]  # the control: the adapter changes the answer


@pytest.mark.parametrize("spec,msg",
                         [(["a1"], "give each adapter as name=path"), (["=p"], "name=path"),
                                      (["a=p", "a=q"], "'a' is given twice")])
def test_lora_modules_are_parsed_or_refused(spec, msg):
    with pytest.raises(NanoserveError, match=msg):
        parse_lora_modules(spec)
    assert [
        (r.lora_name, r.lora_int_id) for r in parse_lora_modules(["x=/a", "y=/b"]).values()
    ] == [("x", 1), ("y", 2)]
