"""Serving: the engine behind an OpenAI-compatible HTTP server (`nanoserve serve`).

    async_engine.py     AsyncLLMEngine: many coroutines, one engine stepping in a worker thread
    server.py           the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health,
                        /metrics (and registers the routes below)
    tokenize_api.py     /tokenize, /detokenize, /tokenizer_info (vLLM's)
    responses_api.py    /v1/responses: OpenAI's Responses API, text and streaming
    vllm_routes.py      /version, /ping, /load, /invocations (vLLM's and SageMaker's)
    http_middleware.py  the API key, the body-size limit, status counts
    openai_api.py       request bodies and their mapping onto SamplingParams (and structured
                        outputs)
    openai_responses.py response and stream-chunk JSON, usage, errors
    openai_logprobs.py  logprobs in OpenAI's two shapes
    openai_schema.py    response schemas, and a truthful /openapi.json
    chat.py             chat templates
    tool_calls.py       tools, tool_choice, strict tool schemas, calls read from the text
    tool_call_stream.py the same calls streamed as OpenAI's deltas
    metrics.py          Prometheus metrics

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client). Taught in notebooks/09_*.
"""
