"""llama.cpp (llama-cpp-python) as a peer for benchmarks/bench_peers.py; runs in
benchmarks/.peers/llamacpp.

    .peers/llamacpp/bin/python benchmarks/peer_llamacpp.py SPEC.json      (protocol: peer_protocol.py)

A spec without "model_dir" names a GGUF file that is run as it is (benchmarks/bench_gguf_llamacpp.py).
Otherwise the HF GPT-2 checkpoint (config.json + model.safetensors) is written to GGUF with the `gguf` package
in llama.cpp's GPT-2 layout, as convert_hf_to_gguf.py's GPT2Model does: HF's Conv1D weights ([in,
out]) transposed to [out, in], tensor names from gguf's own name map (token_embd, position_embd,
blk.N.attn_norm / attn_qkv / attn_output / ffn_norm / ffn_up / ffn_down, output_norm), fp32
throughout, no `output` tensor (tied: llama.cpp reuses token_embd). The vocabulary is written as
"none" with the model's vocab size: requests are token ids in and out, nothing is tokenized or
detokenized.

Greedy, fp32 weights and KV cache, exactly max_tokens tokens per request (EOS ignored: we, not
llama.cpp, decide when to stop), no KV reuse between requests or rounds. A single request (or spec
"slots": 1) runs through the high-level `Llama.generate` (temp=0: llama.cpp's greedy sampler), one
request at a time; several run batched through llama.cpp's low-level batch API, as its server runs
parallel slots: up to "slots" (default 256, at most llama_max_parallel_sequences()) sequences, each
with its own KV stream of the longest request's length, every step one batch of <= 512 tokens
holding each running request's next token plus whole prompts of waiting requests (first come, first
served), greedy = argmax of the returned logits.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
from peer_protocol import serve


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A minimal safetensors reader (numpy only: this venv needs no torch)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if t["dtype"] == "BF16":
            arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, {"F32": np.float32, "F16": np.float16}[t["dtype"]])
        out[name] = arr.reshape(t["shape"]).astype(np.float32)
    return out


def convert_gpt2(model_dir: Path, out: Path) -> None:
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"only GPT-2 checkpoints are converted here, got {cfg.get('model_type')}")
    n_layer, n_embd = cfg["n_layer"], cfg["n_embd"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, n_layer)
    w = gguf.GGUFWriter(str(out) + ".tmp", gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
    w.add_name(model_dir.name)
    w.add_block_count(n_layer)
    w.add_context_length(cfg["n_positions"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg.get("n_inner") or 4 * n_embd)
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("none")  # ids in, ids out
    w.add_vocab_size(cfg["vocab_size"])
    for name, t in sorted(read_safetensors(model_dir / "model.safetensors").items()):
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # the causal-mask buffer; the LM head is tied to wte
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = np.ascontiguousarray(t.T)  # Conv1D [in, out] -> [out, in]
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for tensor {name}")
        w.add_tensor(new, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".tmp", out)


def load(spec):
    import llama_cpp

    gguf_path = Path(spec["gguf_path"])
    t0 = time.perf_counter()
    model_dir = Path(spec["model_dir"]) if spec.get("model_dir") else None  # else: the file as is
    if model_dir is not None and (
        not gguf_path.exists()
        or gguf_path.stat().st_mtime < (model_dir / "model.safetensors").stat().st_mtime
    ):
        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        convert_gpt2(model_dir, gguf_path)
    n, threads = len(spec["prompts"]), spec["threads"]
    slots = min(n, spec.get("slots") or 256, llama_cpp.llama_max_parallel_sequences())
    f32 = llama_cpp.GGML_TYPE_F32
    if slots == 1:  # the high-level API, as a llama-cpp-python user would run it
        settings = {"n_ctx": spec["ctx"], "n_threads": threads, "n_threads_batch": threads,
                    "n_batch": 512,
                    "type_k": f32, "type_v": f32, "logits_all": False}
        engine = llama_cpp.Llama(model_path=str(gguf_path), verbose=False, seed=0, **settings)
        settings["batching"] = (
            "none: one request at a time (Llama.generate, temp=0: greedy sampler)"
        )
    else:  # the low-level batch API, as llama.cpp's server runs parallel slots
        per_seq = max(len(p) + m for p, m in zip(spec["prompts"], spec["max_tokens"]))
        settings = {"n_ctx": slots * per_seq, "n_seq_max": slots, "kv_unified": False,
                    "n_batch": 512,
                    "n_ubatch": 512, "n_threads": threads, "n_threads_batch": threads,
                    "type_k": f32, "type_v": f32}
        engine = Batched(llama_cpp, gguf_path, settings)
        settings["batching"] = (f"continuous over {slots} sequences (llama_batch, one KV stream "
                                "each), prompts and decode tokens in one batch of <= 512, argmax "
                                "of the logits")
    info = {"engine": "llama.cpp", "version": llama_cpp.__version__,
            "load_s": time.perf_counter() - t0,
            "settings": {**settings, "weights": spec.get("weights", "GGUF f32"),
                         "kv_cache": "f32"}}
    return engine, info


class Batched:
    """Continuous batching with llama.cpp's own batch API: each request gets a sequence id while it
    runs."""

    def __init__(self, L, path: Path, settings: dict):
        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(),
                                                  L.llama_model_default_params())
        cp = L.llama_context_default_params()
        for k, v in settings.items():
            setattr(cp, k, v)
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.model or not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {path} with {settings}")
        self.mem = L.llama_get_memory(self.ctx)
        self.slots = settings["n_seq_max"]
        self.n_batch = settings["n_batch"]
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def generate(self, prompts, max_tokens):
        L, b = self.L, self.batch
        L.llama_memory_clear(self.mem, True)
        pending, free = list(range(len(prompts)))[::-1], list(range(self.slots))[::-1]
        active, outs = {}, [[] for _ in prompts]  # seq id -> [request, next position, last token]

        def add(i, tok, pos, seq, logits):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq

        while pending or active:
            rows = []  # (batch row, seq id) whose logits we sample
            for seq, a in active.items():  # every running request decodes one token
                add(len(rows), a[2], a[1], seq, 1)
                rows.append((len(rows), seq))
                a[1] += 1
            n = len(rows)
            # whole prompts join
            while pending and free and n + len(prompts[pending[-1]]) <= self.n_batch:
                req, seq = pending.pop(), free.pop()
                for j, tok in enumerate(prompts[req]):
                    add(n, tok, j, seq, int(j == len(prompts[req]) - 1))
                    n += 1
                active[seq] = [req, len(prompts[req]), None]
                rows.append((n - 1, seq))
            b.n_tokens = n
            if (rc := L.llama_decode(self.ctx, b)) != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, seq in rows:
                a = active[seq]
                a[2] = int(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i),
                                                 shape=(self.n_vocab,)).argmax())
                outs[a[0]].append(a[2])
                if len(outs[a[0]]) == max_tokens[a[0]]:
                    L.llama_memory_seq_rm(self.mem, seq, -1, -1)
                    del active[seq]
                    free.append(seq)
        return outs


def run(engine, prompts, max_tokens):
    t0 = time.perf_counter()
    if isinstance(engine, Batched):
        outs = engine.generate(prompts, max_tokens)
        return time.perf_counter() - t0, outs
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        engine.reset()  # no KV reuse from the previous request
        toks = []
        for tok in engine.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                   repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            if len(toks) == n:
                break
        outs.append(toks)
    return time.perf_counter() - t0, outs


if __name__ == "__main__":
    serve(load, run)
