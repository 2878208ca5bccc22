"""Real client libraries against `nanoserve serve` on loopback: lm-evaluation-harness, LangChain and
LiteLLM. They are not dependencies of nanoserve or of its test extra: `make test-clients` installs
them into .venv-clients (which sees .venv's packages) when the package index answers and runs this
file there; in .venv each test skips on its import.

Tools as those libraries send them: LangChain's `bind_tools` and `with_structured_output(method=
"function_calling")`, and LiteLLM's `hosted_vllm/` provider, all with schemas that lack
`additionalProperties` (pydantic's, or stripped by LiteLLM): the server compiles them strict, so the
arguments parse. (The openai client streaming `tool_choice="required"` is tests/test_tool_calls.py.)

lm-eval is the strongest check: a local multiple-choice task (the end of a line of Shakespeare among
four, built from ../shared) scored through the server's echo + logprobs (`local-completions`,
tokenizing through /tokenize) gives the same per-choice log-likelihoods and the same accuracy as
lm-eval's own `hf` backend running transformers on the same checkpoint.
"""

from __future__ import annotations

import json
import random

import pytest
from live_server import LiveServer, demo_chat_model
from testdata import shared_path

from nanoserve.engine import LLMEngine
from nanoserve.serving.async_engine import AsyncLLMEngine
from nanoserve.serving.chat import load_chat_template
from nanoserve.serving.server import create_app

MODEL = "demo"
N_DOCS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return demo_chat_model(tmp_path_factory.mktemp("clients") / MODEL)  # the demo + a chat template


@pytest.fixture(scope="module")
def server(checkpoint):
    core = LLMEngine.from_kwargs(str(checkpoint), num_blocks=256)
    srv = LiveServer(create_app(AsyncLLMEngine(core), MODEL,
                                chat_template=load_chat_template(checkpoint, core.tokenizer)))
    yield srv
    srv.stop()


# -----------------------------------------------------------------------------
# lm-evaluation-harness
def _line_end_task(folder) -> str:
    """A multiple-choice task file with local data: the first half of a line from the validation
    part of tinyshakespeare, and four candidate second halves (its own and three other lines'), 40
    docs, seed 0."""
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    lines = [ln for ln in text[int(len(text) * 0.9):].split("\n") if 24 <= len(ln) <= 60]
    rng = random.Random(0)
    docs = []
    for i in rng.sample(range(len(lines)), N_DOCS):
        cut = len(lines[i]) // 2
        others = [ln[len(ln) // 2:] for ln in rng.sample(lines, 3)]
        choices = [lines[i][cut:]] + others
        rng.shuffle(choices)
        docs.append({"context": lines[i][:cut], "choices": choices,
                     "label": choices.index(lines[i][cut:])})
    data = folder / "line_end.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (folder / "line_end.yaml").write_text(
        "task: nanoserve_line_end\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return "nanoserve_line_end"


@pytest.mark.shared
def test_lm_eval_through_the_server_equals_lm_eval_on_transformers(
    server, checkpoint, tmp_path, monkeypatch
):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    task = _line_end_task(tmp_path)
    manager = TaskManager(include_path=str(tmp_path))
    runs = {}
    for backend, args in [
        ("hf", {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu"}),
        ("local-completions",
         {"model": MODEL, "base_url": f"{server.url}/completions", "num_concurrent": 1,
                               "max_retries": 1, "tokenizer_backend": "auto"}),
    ]:
        out = lm_eval.simple_evaluate(model=backend, model_args=args, tasks=[task],
                                      task_manager=manager,
                                      log_samples=True, batch_size=1)
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        res = out["results"][task]
        runs[backend] = (res["acc,none"], res["acc_norm,none"],
                         [[r[0] for r in s["filtered_resps"]] for s in samples])
    (acc_hf, norm_hf, ll_hf), (acc_ns, norm_ns, ll_ns) = runs["hf"], runs["local-completions"]
    print(f"lm-eval line-end task, {N_DOCS} docs: hf acc {acc_hf} acc_norm {norm_hf}; "
          f"nanoserve acc {acc_ns} acc_norm {norm_ns}")
    assert (acc_ns, norm_ns) == (acc_hf, norm_hf)  # the same accuracies ...
    assert norm_hf > 0.25 + 0.15  # ... of a model that reads the text (chance: 0.25)
    assert (
        len(ll_ns) == N_DOCS
        and max(abs(a - b) for d, e in zip(ll_hf, ll_ns) for a, b in zip(d, e)) < 1e-3
    )


# ----------------------------------------------------------------------------- LangChain, LiteLLM
def test_langchain_chat_and_completion_with_logprobs(server):
    lc = pytest.importorskip("langchain_openai")
    chat = lc.ChatOpenAI(model=MODEL, base_url=server.url, api_key="none", temperature=0,
                         max_tokens=5,
                         logprobs=True, top_logprobs=2)
    msg = chat.invoke("Who is there?")
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == msg.usage_metadata["output_tokens"] and all(
        len(t["top_logprobs"]) == 2 for t in content
    )
    llm = lc.OpenAI(
        model=MODEL, base_url=server.url, api_key="none", temperature=0, max_tokens=5, logprobs=1
    )
    result = llm.generate(["ROMEO:"])
    assert result.generations[0][0].generation_info["logprobs"]["token_logprobs"]


def test_litellm_completion_with_extras(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network
    litellm = pytest.importorskip("litellm")
    resp = litellm.completion(model=f"openai/{MODEL}", api_base=server.url, api_key="none",
                              messages=[{"role": "user", "content": "Who is there?"}], max_tokens=6,
                              temperature=0,
                              logprobs=True, top_logprobs=2, presence_penalty=0.5, seed=1)
    assert resp.choices[0].logprobs is not None and resp.usage.completion_tokens >= 1


def _rolling_task(folder) -> str:
    """Whole passages scored token by token (lm-eval's loglikelihood_rolling, whose first window
    starts with the end-of-text token when the tokenizer has no BOS), 8 passages of tinyshakespeare
    that fit one window of the demo's 128-token context (longer ones are cut into windows that
    lm-eval's hf and API backends do not cut alike: several nats apart on the demo, with identical
    ids from either tokenizer)."""
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text[int(len(text) * 0.9):].split("\n\n") if 40 <= len(p) <= 110]
    data = folder / "rolling.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:8]),
                    encoding="utf-8")
    (folder / "rolling.yaml").write_text(
        "task: nanoserve_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n")
    return "nanoserve_rolling"


def _rolling_logliks(lm_eval, backend, args, task, manager) -> list[float]:
    out = lm_eval.simple_evaluate(model=backend, model_args=args, tasks=[task],
                                  task_manager=manager, log_samples=True, batch_size=1)
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] for s in samples]


@pytest.mark.shared
def test_lm_eval_remote_tokenizer_rolling_equals_hf(server, checkpoint, tmp_path, monkeypatch):
    """lm-eval's `remote` tokenizer reads the end-of-text id by sending its text to /tokenize: it
    must come back as the one special id, as HF's tokenizer gives it, or every window starts with
    the wrong token. Negative control: a server started with split_special_tokens (the text stays
    13 byte ids) is off by far more than the tolerance."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    task = _rolling_task(tmp_path)
    manager = TaskManager(include_path=str(tmp_path))
    hf = _rolling_logliks(lm_eval, "hf", {"pretrained": str(checkpoint), "dtype": "float32",
                                          "device": "cpu", "max_length": 127}, task, manager)

    def remote(url):
        args = {"model": MODEL, "base_url": f"{url}/completions", "num_concurrent": 1,
                "max_retries": 1, "tokenizer_backend": "remote", "max_length": 127}
        return _rolling_logliks(lm_eval, "local-completions", args, task, manager)

    ours = remote(server.url)
    print(f"lm-eval rolling, {len(hf)} docs: hf {sum(hf):.4f} nats, nanoserve {sum(ours):.4f}")
    assert len(ours) == len(hf) == 8 and max(abs(a - b) for a, b in zip(hf, ours)) < 1e-4
    core = LLMEngine.from_kwargs(str(checkpoint), num_blocks=256, split_special_tokens=True)
    split = LiveServer(create_app(AsyncLLMEngine(core), MODEL))
    try:
        wrong = remote(split.url)
    finally:
        split.stop()
    assert max(abs(a - b) for a, b in zip(hf, wrong)) > 1e-2


# ----------------------------------------------------------------------------- tools, as sent
def _weather_model():
    """A pydantic model as LangChain turns it into a function: no additionalProperties."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather forecast for some days."""

        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=7)

    return Weather


def test_langchain_tools_with_schemas_lacking_additional_properties(server):
    lc = pytest.importorskip("langchain_openai")
    weather = _weather_model()
    schema = lc.chat_models.base.convert_to_openai_tool(weather)["function"]["parameters"]
    assert "additionalProperties" not in schema  # what reaches the server
    # "required" writes [{"name": "Weather", "parameters": {...}}]: some 80 of the context's 128
    chat = lc.ChatOpenAI(model=MODEL, base_url=server.url, api_key="none", temperature=1.0,
                         max_tokens=90)
    for choice in ("Weather", "any"):  # a named function; "any" is LangChain's "required"
        for seed in range(3):
            tools = chat.bind_tools([weather], tool_choice=choice, parallel_tool_calls=False)
            msg = tools.invoke("Who is there?", seed=seed)
            assert not msg.invalid_tool_calls and msg.tool_calls, msg
            weather.model_validate(msg.tool_calls[0]["args"])
    structured = chat.with_structured_output(weather, method="function_calling")
    for seed in range(3):
        assert isinstance(structured.invoke("Who is there?", seed=seed), weather)


def test_litellm_hosted_vllm_with_a_named_tool(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    weather = _weather_model()
    tool = {"type": "function", "function": {"name": "Weather", "description": "a forecast",
                                             "parameters": weather.model_json_schema()}}
    for seed in range(3):
        resp = litellm.completion(model=f"hosted_vllm/{MODEL}", api_base=server.url,
                                  api_key="none", max_tokens=60, temperature=1.0, seed=seed,
                                  messages=[{"role": "user", "content": "Who is there?"}],
                                  tools=[tool],
                                  tool_choice={"type": "function", "function": {"name": "Weather"}})
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name == "Weather" and resp.choices[0].finish_reason == "tool_calls"
        weather.model_validate_json(call.function.arguments)
