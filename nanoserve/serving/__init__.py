"""Serving: the engine behind an OpenAI-compatible HTTP server (`nanoserve serve`).

    async_engine.py     AsyncLLMEngine: many coroutines, one engine stepping in a worker thread
    server.py           the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    http_middleware.py  the API key, the body-size limit, status counts
    openai_api.py       request bodies and their mapping onto SamplingParams; response JSON
    openai_schema.py    response schemas, and a truthful /openapi.json
    chat.py             chat templates
    metrics.py          Prometheus metrics

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client). Taught in notebooks/09_*.
"""
