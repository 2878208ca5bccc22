"""Every GPU figure of nanoserve in one command, for a single H100 / H200 (offline), in <= 20
minutes.

    make gpu-check                                  # = python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --only b,d       # some figures
    python benchmarks/gpu_check.py --preset roofline   # issue 43's (c, d, e, g, h, j), <= 8 min
    python benchmarks/gpu_check.py --dry-run        # CPU, tiny shapes, Triton interpreter: checks the script

Writes benchmarks/gpu_check.json (one section per figure, with device, driver / CUDA, torch / triton
/ transformers versions, date and command) and prints a table per figure. Nothing comes from the
network: weights are random, model shapes are configs built in code (gpu_check_models.py), and the
demo models ship in the package. Figures, GPU sizes, and our time estimate on an H100 (budget in
brackets):

  a  `pytest -m gpu` (subprocess, TRITON_INTERPRET=0), pass / fail counts           ~1.5 min [150 s]
  b  flash_attention prefill TFLOP/s vs SDPA-flash: N 1k-8k, d 64/128, fp16/bf16
     (bench_attention.prefill: 16 shapes, 16k tokens a launch)                      ~1 min   [90 s]
  c  paged vs contiguous decode (batch 32, 1k-8k) and split-KV batch 1, 1k-32k
     (bench_attention.paged_vs_contiguous, split_kv)                                ~0.5 min [60 s]
  d  W4A16 GEMV / GEMM vs fp16 cuBLAS: K = N = 4096, 8192, group 128, M 1-16 and 64-1024 ~1 min [75 s]
  e  batch-1 decode tok/s and achieved HBM bandwidth, 1B Llama bf16, 128 + 256 tokens,
     eager, CUDA graphs, CUDA graphs with the layers unfused (before issue 43's fused
     layers), CUDA graphs with async scheduling; builds the 2 GB checkpoint         ~2 min   [180 s]
  f  continuous batching vs HF generate: 256 requests x U[100, 1024] in and out, same 1B
     model; HF in static batches of 256 and 128                                     ~4 min   [300 s]
  g  int4 (RTN g128, W4A16 kernel) vs bf16 decode, 1B model: blocks, blocks + LM head ~1.5 min [120 s]
  h  speculative decoding T = 0: the 1B target at controlled acceptance (its own continuation,
     alpha 0.9 / 0.8 / 0.6 / 0), + random 28M draft (gamma 4, fixed and adaptive),
     and the trained demo / demo-draft pair                                         ~2.5 min [200 s]
  i  RMSNorm as one kernel vs the torch module: bf16, widths 2048 / 4096, 1-256 rows ~0.2 min [30 s]
  j  async scheduling vs the synchronous step: 64 requests of 128 + 128 tokens at once,
     CUDA graphs, output tok/s and the same tokens                                  ~0.7 min [60 s]
  k  2:4 weights on sparse tensor cores vs dense: bf16, 4096 x 4096 and an 8B MLP's
     14336 x 4096, M 1-512 (nanoserve/sparsity/semi_structured.py)                  ~0.3 min [30 s]
  l  MLA decode (kernels/mla_decode.py) over the latent pool vs paged_attention over H KV heads
     and GQA-8, d 128: H 16 / 128, r 512, rope 64, bf16, batch 1 / 32, 1k-16k; us, cache
     bytes, GB/s; + paged_attention with and without attention sinks              ~0.6 min [60 s]

The estimates add up to ~15 min, the budgets to ~22.5 min (estimates are ours, unmeasured: no GPU
was lent when this was written). On a GPU each figure runs in its own process (a CUDA fault or a
hang loses that figure alone) and records its own error; a figure past its budget stops between
measurements and keeps what it measured (b cannot stop early: its process is killed at budget +
45 s; pytest is stopped at the budget), and the run starts no figure once --time-limit (1140 s) is
near. Exit status 1 when a figure failed or a GPU test did not pass. Without CUDA it refuses to run,
except with --dry-run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from importlib import import_module, metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRACE_S = 45  # past its budget, a figure's process is killed after this much more

# letter: (name, module, function, budget on a GPU in seconds)
FIGURES = {
    "a": ("pytest_gpu", "gpu_check_kernels", "fig_pytest_gpu", 150),
    "b": ("flash_prefill", "gpu_check_kernels", "fig_flash_prefill", 90),
    "c": ("paged_decode_attention", "gpu_check_kernels", "fig_paged_decode", 60),
    "d": ("w4a16_gemv_gemm", "gpu_check_kernels", "fig_w4a16", 75),
    "e": ("decode_bandwidth", "gpu_check_engine", "fig_decode", 180),
    "f": ("throughput_vs_hf", "gpu_check_engine", "fig_throughput", 300),
    "g": ("int4_decode", "gpu_check_engine", "fig_int4", 120),
    "h": ("speculative", "gpu_check_engine", "fig_speculative", 200),
    "i": ("rms_norm_kernel", "gpu_check_kernels", "fig_rms_norm", 30),
    "j": ("async_scheduling", "gpu_check_engine", "fig_async", 60),
    "k": ("sparse_2_4", "gpu_check_kernels", "fig_sparse_2_4", 30),
    "l": ("mla_decode_attention", "gpu_check_kernels", "fig_mla_decode", 60),
}
DRY_BUDGET_S = 120
# --preset: a subset of figures with budgets that fit a short lease. "roofline": what issue 43's
# decode work changes (8-bit KV decode, the W4A16 GEMV with its codes in either layout, batch-1
# bf16 with fused and unfused layers and async scheduling, int4, speculation at controlled
# acceptance, batch 64 sync vs async) in 480 s of budgets (figures that finish early leave theirs)
PRESETS = {"roofline": {"only": "c,d,e,g,h,j", "budgets": "c=45,d=30,e=135,g=90,h=125,j=55",
                        "time_limit": 480.0}}


class Ctx:
    """What a figure gets: its sizes (dry or not), device, a shared work dir, its time budget, and
    `save` for what it has measured so far (kept if it fails or is killed later)."""

    def __init__(self, dry: bool, device: str, workdir: Path, budget: float,
                 save_path: Path | None = None):
        self.dry = dry
        self.device = device
        self.workdir = workdir
        self.budget = budget
        self.save_path = save_path
        self.start, self.partial = time.perf_counter(), {}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def over(self) -> bool:
        return self.left() <= 0

    def save(self, res: dict) -> None:
        self.partial = res
        if self.save_path is not None:
            write_json(self.save_path, {"status": "running", **res})


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_figure(letter: str, ctx: Ctx) -> dict:
    """The figure's dict, or its error with whatever it saved before failing."""
    name, module, fn, _ = FIGURES[letter]
    try:
        res = getattr(import_module(module), fn)(ctx)
        rec = {"status": "ok", **res}
    except Exception as e:
        rec = {"status": "error", **ctx.partial, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    return {"name": name, "status": rec.pop("status"), "seconds": time.perf_counter() - ctx.start,
            "budget_s": ctx.budget, **rec}


def run_isolated(letter: str, args, workdir: Path, budget: float, hard: float) -> dict:
    """The figure in a child process (its own CUDA context), killed at `hard` seconds."""
    out = workdir / f"figure_{letter}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", letter, "--child-out", str(out),
           "--workdir", str(workdir), "--budget",
           str(budget)] + (["--dry-run"] if args.dry_run else [])
    start = time.perf_counter()
    # its own process group: killed with its subprocesses
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc, killed = proc.wait(timeout=hard), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, killed = proc.wait(), True
    except BaseException:
        # Ctrl-C: the figure's process group is not in the terminal's, so stop it here
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    rec = json.loads(out.read_text()) if out.is_file() else {}
    if killed or rec.get("status", "running") == "running":
        why = (
            f"killed after {hard:.0f} s (budget {budget:.0f} s)" if killed
            else f"process exited with {rc}"
        )
        rec = {"name": FIGURES[letter][0], **rec, "status": "timeout" if killed else "crashed",
               "seconds": time.perf_counter() - start, "budget_s": budget,
               "error": why + ("; the fields above are what it measured before" if rec else "")}
    return rec


def environment(device: str, dry: bool) -> dict:
    import torch
    import triton

    env = {"python": platform.python_version(), "executable": sys.executable,
           "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "triton": triton.__version__}
    for pkg in ("transformers", "numpy"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        env["nanoserve_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE,
                                                 capture_output=True,
                                                 text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["nanoserve_commit"] = None
    env["source_sha256"] = source_digest()
    if device != "cuda":
        env["device"] = f"CPU ({platform.machine()}), Triton interpreter" + (
            " (dry run)" if dry else ""
        )
        return env
    props = torch.cuda.get_device_properties(0)
    env.update(device=torch.cuda.get_device_name(0),
               compute_capability=f"{props.major}.{props.minor}",
               sm_count=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1))
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                        "--format=csv,noheader"],
                                       capture_output=True, text=True,
                                       timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    if not env["driver"]:
        try:
            v = torch._C._cuda_getDriverVersion()
            env["driver"] = (
                f"supports CUDA {v // 1000}.{v % 1000 // 10} (nvidia-smi gave no driver version)"
            )
        except (AttributeError, RuntimeError):
            env["driver"] = "unknown (nvidia-smi gave no driver version)"
    return env


def source_digest() -> str:
    """sha256 of the engine's and the benchmarks' Python sources as they ran: the commit recorded
    beside it is git's HEAD where it ran, and a copy of a working tree (a device machine's) can
    carry an older .git."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(p for d in ("nanoserve", "kernels",
                                   "benchmarks") for p in (HERE.parent / d).rglob("*.py")):
        h.update(str(path.relative_to(HERE.parent)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_figure(letter: str, rec: dict, tables: dict) -> None:
    print(f"\n== {letter}. {rec['name']}: {rec['status']} in {rec['seconds']:.0f} s (budget "
          f"{rec['budget_s']:.0f} s)")
    for title, key, cols in tables.get(letter, []):
        rows = rec.get(key) or []
        if not rows:
            continue
        print(f"-- {title}")
        widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))
    skip = {"name", "status", "seconds", "budget_s", "traceback", "output_tail", "note"}
    for k, v in rec.items():
        if k not in skip and not isinstance(v, (list, dict)):
            print(f"   {k}: {fmt(v)}")
    if rec.get("error") and rec.get("traceback"):
        print(rec["traceback"][-1500:])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="every figure on CPU with tiny shapes (checks the script)")
    ap.add_argument("--only", default="",
                    help="comma-separated figure letters, e.g. a,b,e (default: all)")
    ap.add_argument("--out",
                    help="JSON path (default: benchmarks/gpu_check.json; a dry run: the temp dir)")
    ap.add_argument("--time-limit", type=float, default=1140.0,
                    help="stop starting figures after this (s)")
    ap.add_argument("--budgets", default="",
                    help="per-figure budgets in seconds for a shorter lease, e.g. a=45,f=80")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="figures, budgets and time limit for a short lease (roofline: c,d,e,g,h,j "
                         "in <= 8 min); --only, --budgets and --time-limit given too win")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="one process per figure (default: yes on a GPU, no in a dry run)")
    ap.add_argument("--workdir",
                    help="where checkpoints are built (default: a temporary dir, removed after)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.preset:
        preset = PRESETS[args.preset]
        given = argv if argv is not None else sys.argv[1:]
        args.only = args.only or preset["only"]
        args.budgets = args.budgets or preset["budgets"]
        if not any(a.startswith("--time-limit") for a in given):
            args.time_limit = preset["time_limit"]
    args.only = [x.strip() for x in args.only.split(",") if x.strip()] or list(FIGURES)
    bad = [x for x in args.only if x not in FIGURES]
    if bad:
        ap.error(f"unknown figure {bad[0]!r}; figures: {', '.join(FIGURES)}")
    args.budgets = dict(_budget(item, ap) for item in args.budgets.split(",") if item.strip())
    return args


def _budget(item: str, ap) -> tuple[str, float]:
    """'f=80' -> ('f', 80.0), refusing an unknown letter or a budget that is not a positive
    number."""
    letter, _, seconds = item.strip().partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if letter not in FIGURES or value <= 0:
        ap.error(f"--budgets item {item.strip()!r}: expected LETTER=SECONDS with a letter of "
                 f"{', '.join(FIGURES)} and a positive number of seconds")
    return letter, value


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # CPU tensors on a GPU machine too: the kernels must run in the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import nanoserve  # noqa: F401  (sets the interpreter up on CPU before Triton loads)

    if args.dry_run:
        # tiny tensors: more threads only add wake-ups (and CI shares its cores)
        torch.set_num_threads(1)

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check measures GPU figures and needs a CUDA GPU; torch sees none here "
              f"(torch {torch.__version__}). Use --dry-run to check the script on CPU.",
              file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.child:  # one figure, in its own process
        ctx = Ctx(args.dry_run, device, Path(args.workdir), args.budget, Path(args.child_out))
        write_json(ctx.save_path, run_figure(args.child, ctx))
        return 0
    start = time.perf_counter()
    isolate = (not args.dry_run) if args.isolate is None else args.isolate
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "gpu_check_dryrun.json" if args.dry_run
                                           else HERE / "gpu_check.json")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    tables = {**import_module("gpu_check_kernels").TABLES,
              **import_module("gpu_check_engine").TABLES}
    res = {"command": " ".join(["python", "benchmarks/gpu_check.py",
                                *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "dry_run": args.dry_run,
           "isolated": isolate, "time_limit_s": args.time_limit,
           "environment": environment(device, args.dry_run),
           "figures": {}}
    print(f"gpu_check on {res['environment']['device']}: figures {','.join(args.only)} -> {out}")
    try:
        for letter in args.only:
            budget = args.budgets.get(letter, DRY_BUDGET_S if args.dry_run else FIGURES[letter][3])
            left = args.time_limit - (time.perf_counter() - start)
            if left < 30:
                rec = {"name": FIGURES[letter][0], "status": "skipped", "seconds": 0.0,
                       "budget_s": budget,
                       "error": f"the run's time limit of {args.time_limit:.0f} s was reached"}
            elif isolate:
                rec = run_isolated(letter, args, workdir, min(budget, left),
                                   min(budget + GRACE_S, left))
            else:
                rec = run_figure(letter, Ctx(args.dry_run, device, workdir, budget))
            res["figures"][letter] = rec
            res["total_s"] = time.perf_counter() - start
            write_json(out, res)
            print_figure(letter, rec, tables)
    finally:
        if not args.workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    failed = [k for k, r in res["figures"].items() if r["status"] != "ok" or r.get("ok") is False]
    print(
        f"\n{len(res['figures']) - len(failed)} of {len(res['figures'])} figures ok"
        + (f" (not ok: {', '.join(failed)})" if failed else "")
        + f" in {res['total_s']:.0f} s; saved {out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
