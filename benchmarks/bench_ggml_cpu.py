"""Quantized weights read packed on the CPU (kernels/cpu_packed_gemv.c) against float32:
llama.cpp's blocks (GGUF) and nanoserve's own grids (QuantLinear).

    python benchmarks/bench_ggml_cpu.py [--reps 30] [--rounds 3] [--out benchmarks/ggml_cpu.json]

Two views, each against float32 in the same run:

- **layers**: one call of x [rows, K] · Wᵀ for the linears of a Llama-shaped model (hidden 768,
  MLP 2048; a 32,000-token head), with rows 1, 4, 16, 64: float32 `F.linear` (MKL), the packed
  kernel on Q8_0, Q4_0, Q4_K and Q6_K blocks and on nanoserve's int8 and int4 grids
  (`QuantLinear`, groups of 128), and the obvious way (dequantize, then `F.linear`).
  Every pass runs all shapes with every method in turn (the order rotating); medians of `reps`
  passes.
- **engine**: greedy decoding of 64 tokens, 1 and 16 sequences together, on that model (16
  blocks, the demo's 257-token vocabulary: ~113M parameters) written as a GGUF file in F32, Q8_0,
  Q4_0, Q4_K (random weights: the time does not depend on them), loaded with `LLM("model.gguf")`,
  and quantized by nanoserve's RTN to 8 and 4 bits (groups of 128), saved as GPTQ checkpoints
  (their linears `QuantLinear`s);
  `rounds` rounds, the files in rotating order; output tokens/s (decode only: each first token is
  left out) and the medians' ratios to F32.

Saves JSON and prints tables. Threads: torch's (set OMP_NUM_THREADS / torch.set_num_threads).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from gguf_writer import packed_weights, write_gguf  # noqa: E402
from nanoserve.kernels.cpu_packed_gemv import ggml_gemv, ggml_gemv_ref  # noqa: E402

from nanoserve.engine.llm import LLM  # noqa: E402
from nanoserve.engine.sampler import SamplingParams  # noqa: E402
from nanoserve.quant.qlinear import QuantLinear  # noqa: E402
from nanoserve.quant.rtn import quantize_rtn  # noqa: E402

HIDDEN, MLP, VOCAB, LAYERS, HEADS = 768, 2048, 32000, 16, 12
# (out, in) in the order a block reads them, then the head
SHAPES = [(HIDDEN, HIDDEN)] * 4 + [(MLP, HIDDEN)] * 2 + [(HIDDEN, MLP), (VOCAB, HIDDEN)]
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
# nanoserve's own grids (QuantLinear: RTN here, GPTQ and AWQ alike), groups of 128
GRIDS = {"int8 g128": 8, "int4 g128": 4}
METHODS = (*TYPES, *GRIDS)
ENGINE_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_K")


def bench_layers(rows_list, reps: int) -> list[dict]:
    out = []
    for rows in rows_list:
        calls = {}
        for shape in dict.fromkeys(SHAPES):
            x = torch.randn(rows, shape[1])
            w = torch.randn(shape) * 0.02
            calls[(shape, "float32")] = lambda x=x, w=w: F.linear(x, w)
            for t in TYPES:
                packed = torch.from_numpy(packed_weights(t, shape, std=0.02))
                calls[(shape, t)] = lambda x=x, p=packed, t=t, n=shape[0]: ggml_gemv(x, p, t, n)
                calls[(shape, f"{t} dequantized")] = (
                    lambda x=x, p=packed, t=t, n=shape[0]: ggml_gemv_ref(x, p, t, n))
            for name, bits in GRIDS.items():
                layer = QuantLinear.from_quantized(quantize_rtn(w, bits, 128), dtype=torch.float32)
                calls[(shape, name)] = lambda x=x, layer=layer: layer(x)
        times: dict = {k: [] for k in calls}
        keys = list(calls)
        for rep in range(reps + 1):
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                start = time.perf_counter()
                calls[key]()
                if rep:  # the first pass warms up
                    times[key].append(time.perf_counter() - start)
        for shape in dict.fromkeys(SHAPES):
            base = statistics.median(times[(shape, "float32")])
            row = {"rows": rows, "out": shape[0], "in": shape[1], "float32_us": base * 1e6}
            for method in (*METHODS, *(f"{t} dequantized" for t in TYPES)):
                t = statistics.median(times[(shape, method)])
                row[f"{method}_us"] = t * 1e6
                row[f"{method}_speedup"] = base / t
            out.append(row)
    return out


def _hf_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=HIDDEN, intermediate_size=MLP,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=HEADS, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _decode_tokens_per_s(llm, num_seqs: int, params) -> float:
    """Output tokens per second of the decode steps: all sequences' tokens after their first, over
    the time from the first first token to the last token."""
    outs = llm.generate([f"ROMEO {i}:" for i in range(num_seqs)], params)
    times = [o.outputs[0].token_times for o in outs]
    tokens = sum(len(t) - 1 for t in times)
    return tokens / (max(t[-1] for t in times) - min(t[0] for t in times))


def _rtn_checkpoint(model, folder: Path, bits: int) -> Path:
    """`model` quantized by nanoserve's RTN (groups of 128) and saved as a GPTQ checkpoint: it loads
    as QuantLinears."""
    from nanoserve.models.loader import load_model
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.save import save_quantized
    from nanoserve.tokenizers import byte_level_tokenizer, save_tiktoken

    hf = folder / "hf"
    if not hf.exists():
        model.save_pretrained(hf)
        save_tiktoken(byte_level_tokenizer(), hf)
    ours = load_model(str(hf), dtype="float32", device="cpu")[0]
    result = quantize_model(ours, None, QuantizeConfig(method="rtn", bits=bits, group_size=128),
                            progress=False)
    return save_quantized(ours, result, folder / f"rtn{bits}", tokenizer_from=hf)


def bench_engine(rounds: int, folder: Path, batch_sizes) -> dict:
    model = _hf_llama()
    files = {t: write_gguf(model, folder / f"llama-{t}.gguf", t) for t in ENGINE_TYPES}
    for name, bits in GRIDS.items():  # nanoserve's own checkpoints, the same weights
        files[f"RTN {name}"] = _rtn_checkpoint(model, folder, bits)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llms = {t: LLM(str(p), dtype="float32", device="cpu", num_blocks=512)
            for t, p in files.items()}
    result = {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    order = list(files)
    for num_seqs in batch_sizes:
        speeds: dict = {t: [] for t in files}
        for r in range(rounds + 1):
            for t in order[r % len(order):] + order[:r % len(order)]:
                speed = _decode_tokens_per_s(llms[t], num_seqs, params)
                if r:  # round 0 warms up
                    speeds[t].append(speed)
        medians = {t: statistics.median(v) for t, v in speeds.items()}
        result[f"{num_seqs} sequences"] = {
            "tokens_per_s": speeds, "median_tokens_per_s": medians,
            "ratio_to_f32": {t: v / medians["F32"] for t, v in medians.items()}}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16],
                    help="engine: sequences decoded together")
    ap.add_argument("--out", default=str(HERE / "ggml_cpu.json"))
    args = ap.parse_args()
    layers = bench_layers(args.rows, args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        engine = bench_engine(args.rounds, Path(tmp), args.batch)
    meta = {"date": date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "command": "python benchmarks/bench_ggml_cpu.py " + " ".join(sys.argv[1:])}
    Path(args.out).write_text(json.dumps({"meta": meta, "layers": layers, "engine": engine},
                                         indent=1) + "\n")
    print(f"{'rows':>4} {'out x in':>12} {'fp32 µs':>9} "
          + " ".join(f"{t:>9}" for t in METHODS) + " "
          + " ".join(f"{t + ' deq':>9}" for t in TYPES) + "   (speed-up over float32)")
    for r in layers:
        fast = " ".join(f"{r[t + '_speedup']:>8.2f}x" for t in METHODS)
        slow = " ".join(f"{r[t + ' dequantized_speedup']:>8.2f}x" for t in TYPES)
        print(f"{r['rows']:>4} {r['out']:>6}x{r['in']:<5} {r['float32_us']:>9.1f} {fast} {slow}")
    for num_seqs in args.batch:
        run = engine[f"{num_seqs} sequences"]
        print(f"\nengine, {engine['params_M']}M-parameter Llama, {num_seqs} sequences, greedy 64 "
              "tokens each:")
        for t, v in run["median_tokens_per_s"].items():
            print(f"  {t:14} {v:8.1f} tokens/s  {run['ratio_to_f32'][t]:.2f}x F32")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
