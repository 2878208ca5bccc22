"""Single-stream decode speed: nanoserve `LLM.generate` vs HF `transformers` `generate`, same
weights.

    python benchmarks/bench_decode.py [--layers 6 --width 384 --heads 6 --new-tokens 128 --reps 5]

A random GPT-2 config (vocab 50257), fp32, greedy, batch 1, a 16-token prompt, 128 new
tokens. Both run in this one process, alternating, and we report medians and their ratio
(machines are noisy; only the ratio within one run means much). nanoserve's figure includes
its detokenization and stop checks; HF's `generate` returns ids only. Saves JSON beside this file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHARED_TOKENIZER = HERE.parent.parent / "shared" / "models" / "gpt2-tokenizer"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "decode_cpu.json"))
    args = ap.parse_args()

    import transformers

    from nanoserve import LLM, SamplingParams

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                  vocab_size=50257)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        if not SHARED_TOKENIZER.is_dir():
            raise SystemExit(f"needs the GPT-2 tokenizer files in {SHARED_TOKENIZER}")
        for name in ("encoder.json", "vocab.bpe"):  # into the temporary checkpoint dir only
            (Path(tmp) / name).write_bytes((SHARED_TOKENIZER / name).read_bytes())
        llm = LLM(tmp, dtype="float32", device="cpu")

    prompt = list(range(1000, 1016))
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def run_nanoserve() -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out.token_ids

    @torch.inference_mode()
    def run_hf() -> tuple[float, list[int]]:
        t = time.perf_counter()
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens,
                          do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, ids[0, len(prompt):].tolist()

    run_nanoserve(), run_hf()  # warm-up
    ns, hs = [], []
    for _ in range(args.reps):
        (t_ns, tok_ns), (t_hf, tok_hf) = run_nanoserve(), run_hf()
        ns.append(args.new_tokens / t_ns)
        hs.append(args.new_tokens / t_hf)
    assert tok_ns == tok_hf, "greedy outputs differ: the comparison would be meaningless"
    result = {
        "benchmark": "single-stream decode, batch 1, greedy",
        "date": date.today().isoformat(),
        "device": f"CPU ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": f"random GPT-2 {args.layers} layers, {args.width} wide, {args.heads} heads, vocab "
                 "50257, fp32",
        "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "reps": args.reps,
        "nanoserve_tok_s": ns, "hf_tok_s": hs,
        "nanoserve_median_tok_s": statistics.median(ns), "hf_median_tok_s": statistics.median(hs),
        "ratio": statistics.median(ns) / statistics.median(hs),
        "same_tokens": tok_ns == tok_hf,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'engine':<12}{'median tok/s':>14}{'runs':>40}")
    print(
        f"{'nanoserve':<12}{result['nanoserve_median_tok_s']:>14.1f}{str([round(x, 1) for x in ns]):>40}"
    )
    print(
        f"{'HF generate':<12}{result['hf_median_tok_s']:>14.1f}{str([round(x, 1) for x in hs]):>40}"
    )
    print(f"ratio nanoserve / HF = {result['ratio']:.2f}x   (saved {args.out})")


if __name__ == "__main__":
    main()
