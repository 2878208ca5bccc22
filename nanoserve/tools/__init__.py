"""Tools around the engine: what measures, evaluates and builds it.

    bench.py        throughput / latency / speculative benchmarks (`nanoserve bench`)
    bench_serve.py  Poisson load on a running server (`nanoserve bench serve`)
    metrics.py      TTFT / TPOT / ITL / E2E from outputs (vLLM's definitions), percentiles, goodput
    batching.py     static, dynamic and continuous batchers behind one interface (notebook 03)
    evaluate.py     sliding-window perplexity, draft acceptance α
    train.py        the trainer and distillation that built the demo models
    launch_count.py the kernels one decode step launches, counted on a CPU as a GPU launches them
    controlled_draft.py  speculative decoding at a chosen acceptance rate, for benchmarks
"""
