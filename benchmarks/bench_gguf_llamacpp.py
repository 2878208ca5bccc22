"""nanoserve against llama.cpp on the same GGUF files, on the CPU.

    bash benchmarks/peers_setup.sh llamacpp          # once: llama-cpp-python in benchmarks/.peers
    python benchmarks/bench_gguf_llamacpp.py [--rounds 3] [--requests 64] [--tokens 64]
                                             [--threads 2] [--out benchmarks/gguf_llamacpp_cpu.json]

The files: a random Llama (768 wide, 16 blocks, MLP 2048, the demo's 257-token vocabulary:
113.7M parameters; bench_ggml_cpu.py's) written as an F32 GGUF file by tests/gguf_writer.py (no
vocabulary: token ids in and out), then
quantized by llama.cpp's own quantizer (`llama_model_quantize`) to Q8_0 and Q4_K_M. Both engines
load those files as they are. Four measurements, each engine in the same run:

- **logits** of a 32-token prompt, every position: nanoserve's (`LLM.logits`) and llama.cpp's
  (`Llama(logits_all=True).eval`, float32 KV) against the float model in transformers (the F32
  file's weights), and against each other. llama.cpp multiplies the quantized files with its
  activations quantized to 8 bits (Q8_0 / Q8_K blocks); nanoserve keeps them in float32.
- **throughput**, 1 request and `requests` requests, `tokens` greedy tokens each (EOS ignored),
  16-token prompts of random ids: output tokens per second of the whole run, rounds interleaved
  (the engines and files in rotating order), medians. llama.cpp's single request runs through
  `Llama.generate`, its batch through its batch API as its server's parallel slots
  (benchmarks/peer_llamacpp.py); nanoserve's through `LLM.generate`.
- **cold start**: a fresh Python process per engine and file, the file first dropped from the
  page cache (posix_fadvise DONTNEED): the time from starting the process to the first token of one
  request (imports, load, prompt, one token), and the process's peak resident memory (VmHWM;
  pages of a memory-mapped file count once touched).

Saves JSON and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_ggml_cpu import _hf_llama  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from peer_protocol import Peer  # noqa: E402

from nanoserve.engine.llm import LLM  # noqa: E402
from nanoserve.engine.sampler import SamplingParams  # noqa: E402

PEER_PYTHON = HERE / ".peers" / "llamacpp" / "bin" / "python"
TOOLS = HERE / "peer_llamacpp_tools.py"
QUANTIZED = ("Q8_0", "Q4_K_M")
PROMPT_LEN = 16

# a fresh process's whole start with nanoserve: import, load, one request's first token
NANOSERVE_FIRST_TOKEN = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
from nanoserve.engine.llm import LLM
from nanoserve.engine.sampler import SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", num_blocks=16)
ids = json.loads(open(sys.argv[2]).read())
out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
print("@@FIRST", out[0].outputs[0].token_ids[0], flush=True)
peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print("@@PEAK_KB", peak.split()[1], flush=True)
"""


def llamacpp_tool(*args) -> None:
    run = subprocess.run([str(PEER_PYTHON), str(TOOLS), *map(str, args)], capture_output=True,
                         text=True)
    if run.returncode:
        raise RuntimeError(f"peer_llamacpp_tools.py {args[0]} failed:\n{run.stderr[-2000:]}")


def make_files(model, folder: Path) -> dict[str, Path]:
    # no vocabulary: token ids in and out (llama.cpp refuses the demo's: "gpt2" without merges)
    files = {"F32": write_gguf(model, folder / "llama-F32.gguf", vocabulary=False)}
    for kind in QUANTIZED:
        files[kind] = folder / f"llama-{kind}.gguf"
        llamacpp_tool("quantize", files["F32"], files[kind], kind)
    return files


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b|"""
    return (a - b).abs().max().item() / b.abs().max().item()


def compare_logits(model, files: dict, folder: Path, threads: int) -> dict:
    import numpy as np

    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    ids_path = folder / "ids.json"
    ids_path.write_text(json.dumps(ids))
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].float()  # 32, V
    out = {}
    for kind, path in files.items():
        ours = LLM(str(path), dtype="float32", device="cpu", num_blocks=16).logits(ids)
        npy = folder / f"logits-{kind}.npy"
        llamacpp_tool("logits", path, ids_path, npy)
        theirs = torch.from_numpy(np.load(npy))
        out[kind] = {
            "nanoserve_vs_float": _relative(ours, reference),
            "llamacpp_vs_float": _relative(theirs, reference),
            "nanoserve_vs_llamacpp": _relative(ours, theirs),
            "same_argmax_positions": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
            "positions": len(ids),
        }
    return out


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _nanoserve_speed(llm, prompts, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def throughput(files: dict, sizes, tokens: int, rounds: int, threads: int, cache: Path) -> dict:
    result = {}
    llms = {kind: LLM(str(path), dtype="float32", device="cpu", num_blocks=1024)
            for kind, path in files.items()}
    for n in sizes:
        prompts = _prompts(n)
        peers = {}
        for kind, path in files.items():
            spec = {"gguf_path": str(path), "ctx": PROMPT_LEN + tokens, "threads": threads,
                    "prompts": prompts, "max_tokens": [tokens] * n, "slots": n,
                    "weights": f"GGUF {kind}"}
            peers[kind] = Peer("llamacpp", HERE, spec, cache)
        runs = [(engine, kind) for kind in files for engine in ("nanoserve", "llama.cpp")]
        speeds: dict = {f"{e} {k}": [] for e, k in runs}
        for r in range(rounds + 1):  # round 0 warms up
            for engine, kind in runs[r % len(runs):] + runs[:r % len(runs)]:
                if engine == "nanoserve":
                    speed = _nanoserve_speed(llms[kind], prompts, tokens)
                else:
                    got = peers[kind].run()
                    speed = got["output_tokens"] / got["seconds"]
                if r:
                    speeds[f"{engine} {kind}"].append(speed)
        for peer in peers.values():
            peer.close()
        medians = {name: statistics.median(v) for name, v in speeds.items()}
        result[f"{n} requests"] = {
            "tokens_per_s": speeds, "median_tokens_per_s": medians,
            "nanoserve_over_llamacpp": {k: medians[f"nanoserve {k}"] / medians[f"llama.cpp {k}"]
                                        for k in files},
            "llamacpp_settings": peers[next(iter(files))].info.get("settings")}
    return result


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _first_token(command: list[str], path: Path) -> dict:
    """Seconds from starting `command` to its @@FIRST line, and the peak RSS (MiB) it reports
    (VmHWM: the process's own, from its exec on; a fork's copy of this process is not counted)."""
    _drop_from_page_cache(path)
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seconds = peak_kb = None
    for line in proc.stdout:
        if line.startswith("@@FIRST"):
            seconds = time.perf_counter() - start
        if line.startswith("@@PEAK_KB"):
            peak_kb = int(line.split()[1])
    if proc.wait() or seconds is None or peak_kb is None:
        raise RuntimeError(f"{command[:3]} gave no first token (exit {proc.returncode})")
    return {"seconds": seconds, "peak_rss_mib": peak_kb / 1024}


def cold_start(files: dict, folder: Path, threads: int, rounds: int) -> dict:
    ids_path = folder / "cold_ids.json"
    ids_path.write_text(json.dumps(_prompts(1)[0]))
    out = {}
    for kind, path in files.items():
        commands = {
            "nanoserve": [sys.executable, "-c", NANOSERVE_FIRST_TOKEN, str(path), str(ids_path),
                          str(threads)],
            "llama.cpp": [str(PEER_PYTHON), str(TOOLS), "first-token", str(path), str(ids_path),
                          str(threads)]}
        runs = {engine: [_first_token(c, path) for _ in range(rounds)]
                for engine, c in commands.items()}
        out[kind] = {engine: {"seconds": statistics.median(r["seconds"] for r in rs),
                              "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                              "runs": rs}
                     for engine, rs in runs.items()}
        out[kind]["file_mib"] = path.stat().st_size / 2**20
    return out


def print_tables(result: dict) -> None:
    print("\nlogits, max |Δ| / max |reference| over 32 positions")
    print(f"{'file':8} {'nanoserve':>10} {'llama.cpp':>10} {'ns vs lc':>10} {'argmax':>7}")
    for kind, r in result["logits"].items():
        print(f"{kind:8} {r['nanoserve_vs_float']:10.2e} {r['llamacpp_vs_float']:10.2e} "
              f"{r['nanoserve_vs_llamacpp']:10.2e} {r['same_argmax_positions']:4}/"
              f"{r['positions']}")
    for name, r in result["throughput"].items():
        print(f"\n{name}: output tokens/s (median), nanoserve / llama.cpp")
        for kind, ratio in r["nanoserve_over_llamacpp"].items():
            m = r["median_tokens_per_s"]
            print(f"  {kind:8} nanoserve {m[f'nanoserve {kind}']:8.1f}   llama.cpp "
                  f"{m[f'llama.cpp {kind}']:8.1f}   {ratio:.2f}×")
    print("\ncold start: seconds to the first token, peak RSS MiB")
    for kind, r in result["cold_start"].items():
        print(f"  {kind:8} ({r['file_mib']:.0f} MiB file)  nanoserve "
              f"{r['nanoserve']['seconds']:.2f} s {r['nanoserve']['peak_rss_mib']:.0f} MiB   "
              f"llama.cpp {r['llama.cpp']['seconds']:.2f} s "
              f"{r['llama.cpp']['peak_rss_mib']:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=["logits", "throughput", "cold"])
    ap.add_argument("--out", default=str(HERE / "gguf_llamacpp_cpu.json"))
    args = ap.parse_args()
    if not PEER_PYTHON.exists():
        sys.exit(f"no llama.cpp at {PEER_PYTHON}: bash benchmarks/peers_setup.sh llamacpp")
    torch.set_num_threads(args.threads)
    version = subprocess.run([str(PEER_PYTHON), "-c", "import llama_cpp; "
                              "print(llama_cpp.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "llama_cpp_python": version, "threads": args.threads,
              "tokens": args.tokens, "prompt_tokens": PROMPT_LEN}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = _hf_llama()
        result["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
        files = make_files(model, folder)
        if "logits" not in args.skip:
            result["logits"] = compare_logits(model, files, folder, args.threads)
        del model
        if "throughput" not in args.skip:
            result["throughput"] = throughput(files, (1, args.requests), args.tokens,
                                              args.rounds, args.threads, folder)
        if "cold" not in args.skip:
            result["cold_start"] = cold_start(files, folder, args.threads, args.rounds)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_tables({"logits": {}, "throughput": {}, "cold_start": {}, **result})
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
