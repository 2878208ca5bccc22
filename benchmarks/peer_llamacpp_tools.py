"""llama.cpp's own tools for benchmarks/bench_gguf_llamacpp.py, run in benchmarks/.peers/llamacpp
(imports nothing from nanoserve):

    python peer_llamacpp_tools.py quantize SRC.gguf DST.gguf Q8_0|Q4_K_M   llama.cpp's quantizer
    python peer_llamacpp_tools.py logits FILE.gguf IDS.json OUT.npy        logits of every position
    python peer_llamacpp_tools.py first-token FILE.gguf IDS.json THREADS   a cold start, timed

`logits` runs the prompt as one batch with float32 KV (Llama(logits_all=True).eval). `first-token`
is a fresh process's whole start: import, load (llama.cpp memory-maps the file), prompt, one greedy
token; it prints `@@FIRST` when the token is out (the parent times the line), then `@@PEAK_KB`,
its peak resident memory (VmHWM), and exits.
"""

from __future__ import annotations

import json
import sys

FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def quantize(src: str, dst: str, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def _llama(path: str, threads: int, logits_all: bool):
    import llama_cpp

    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=256, n_threads=threads,
                           n_threads_batch=threads, type_k=f32, type_v=f32,
                           logits_all=logits_all, verbose=False, seed=0)


def logits(path: str, ids_path: str, out: str) -> None:
    import numpy as np

    ids = json.loads(open(ids_path).read())
    engine = _llama(path, 2, logits_all=True)
    engine.eval(ids)
    np.save(out, np.asarray(engine.scores[:len(ids)], dtype=np.float32))


def first_token(path: str, ids_path: str, threads: int) -> None:
    ids = json.loads(open(ids_path).read())
    engine = _llama(path, threads, logits_all=False)
    for token in engine.generate(ids, temp=0.0, top_k=1, reset=True):
        print(f"@@FIRST {int(token)}", flush=True)
        break
    peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
    print(f"@@PEAK_KB {peak.split()[1]}", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "quantize":
        quantize(*args)
    elif command == "logits":
        logits(*args)
    elif command == "first-token":
        first_token(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r} (quantize | logits | first-token)")
