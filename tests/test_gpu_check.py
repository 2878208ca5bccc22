"""benchmarks/gpu_check.py (`make gpu-check`) is for a GPU machine; its --dry-run runs every figure
end to end on CPU with tiny shapes (Triton interpreter), so the script cannot rot between GPU
sessions.

It is run as a script in a subprocess, as the GPU machine runs it (benchmarks/ is not a package)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
FIGURES = "abcdefghijkl"


def _run(*args, timeout=240):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout,
                          env=env)


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_dry_run_measures_every_figure(tmp_path):
    out = tmp_path / "gpu_check.json"
    start = time.perf_counter()
    proc = _run("--dry-run", "--out", str(out))
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 120, (
        f"the dry run took {elapsed:.0f} s; it must stay well under a minute on a quiet machine"
    )
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and "--dry-run" in res["command"] and res["date"]
    env = res["environment"]
    assert env["torch"] == torch.__version__ and env["triton"] and "dry run" in env["device"]
    figs = res["figures"]
    assert sorted(figs) == list(FIGURES)
    for letter, fig in figs.items():
        assert fig["status"] == "ok" and fig.get("ok", True), (
            letter, fig.get("error"), fig.get("traceback"),
        )
        assert "error" not in fig and "truncated" not in fig, letter
        assert fig["seconds"] >= 0 and fig["budget_s"] > 0
    a = figs["a"]["summary"][0]
    assert figs["a"]["ok"] and a["failed"] == a["errors"] == 0 and a["passed"] + a["skipped"] >= 1
    assert figs["b"]["rows"] and all(_positive(r["ours_tflops"], r["sdpa_tflops"], r["ratio"])
                                     for r in figs["b"]["rows"])
    c = figs["c"]
    assert _positive(*(r["ratio"] for r in c["paged_decode"]),
                     *(r["split_ms"] for r in c["split_kv"]))
    assert c["split_kv"][0]["growth_vs_first"] == 1.0
    for r in figs["d"]["rows"]:
        assert _positive(r["cublas_fp16_us"], r["w4a16_us"], r["gemm_kernel_us"], r["mma_us"])
        assert r["rel_error"] < 1e-2 and r["mma_rel_error"] < 1e-2  # codes in the MMA layout
    # the dry run's M = 1: the GEMV by multiply-adds, timed against the same GEMV through tl.dot
    assert {r["kernel"] for r in figs["d"]["rows"]} == {"gemv fma", "gemm"}
    assert all(_positive(r["dot_gemv_us"]) for r in figs["d"]["rows"] if r["kernel"] == "gemv fma")
    e = figs["e"]
    assert [r["mode"] for r in e["rows"]] == ["eager", "cuda_graphs", "cuda_graphs_unfused",
                                              "cuda_graphs_async"]
    for row in e["rows"]:
        assert "error" not in row and _positive(row["tok_s"], row["weight_gb"])
    assert e["cuda_graphs"] == "available" and _positive(e["fused_speedup"], e["async_speedup"])
    assert e["async_same_tokens"]
    assert e["peak_tbps"] is None and e["peak_source"].startswith("unknown")
    f = figs["f"]
    ours, hf = f["rows"][0], f["rows"][1]
    assert (
        ours["complete"] and hf["complete"] and ours["requests"] == hf["requests"] == f["requests"]
    )
    assert ours["output_tokens"] == hf["output_tokens"] > 0 and _positive(f["ratio_vs_hf"])
    g = figs["g"]
    full, int4, head = g["rows"]
    assert int4["weights"].startswith("int4") and int4["weight_gb"] < 0.5 * full["weight_gb"]
    # the dry run's head (320 x 64) is most of its weights: quantized, a step reads half as much
    assert head["weights"] == "int4 RTN + LM head" and head["weight_gb"] < 0.6 * int4["weight_gb"]
    assert _positive(full["tok_s"], int4["tok_s"], g["int4_speedup"], g["int4_lm_head_speedup"])
    h = figs["h"]["rows"]
    assert [r["pair"].split()[0] for r in h] == ["1B,"] * 5 + ["random", "random", "demo"]
    assert [r["alpha_set"] for r in h[:5]] == [0.9, 0.8, 0.6, 0.0, 0.0]
    useless = [r for r in h[:5] if r["alpha_set"] == 0.0 and r["num_steps"]]
    assert useless and all(r["alpha"] == 0.0 and r["tokens_per_step"] == 1 for r in useless)
    # the adaptive row may never speculate: its measured costs can switch the draft off at once
    for r in h:
        assert _positive(r["speedup"]) and (r["adaptive"] or r["num_steps"] > 0)
        if r["num_steps"]:
            assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_step"] <= r["gamma"] + 1
    assert all(col in proc.stdout for col in ("ours_tflops", "w4a16_us", "achieved_tbps",
                                              "tokens_per_step"))
    for r in figs["i"]["rows"]:
        assert _positive(r["torch_us"], r["kernel_us"]) and r["max_abs_diff"] < 1e-5
    j = figs["j"]
    assert [r["mode"] for r in j["rows"]] == ["sync", "async"] and j["same_tokens"]
    assert all(_positive(r["output_tok_s"], r["tpot_ms"], r["steps"]) for r in j["rows"])
    # k on a CPU: the dense product timed, the sparse one refused with its reason
    assert all(_positive(r["dense_us"]) and r["sparse_us"] is None and "CUDA" in r["problem"]
               for r in figs["k"]["rows"])
    # l: each of the three caches timed and checked against its torch reference, and the sinks row
    ell = figs["l"]
    assert [(r["batch"], r["context"]) for r in ell["rows"]] == [(1, 40), (2, 40)]
    for r in ell["rows"]:
        for cache in ("mla", "mha", "gqa8"):
            assert _positive(r[f"{cache}_us"], r[f"{cache}_mb"], r[f"{cache}_gbps"]), cache
            assert r[f"{cache}_rel_error"] < 1e-5, (cache, r)
        # bytes a token: the latent (r + d_rope) < the GQA cache (2 · H / 2 · d) < H full heads
        assert r["mla_mb"] < r["gqa8_mb"] < r["mha_mb"]
    (sinks,) = ell["sinks"]
    assert _positive(sinks["plain_us"], sinks["sinks_us"]) and sinks["sinks_rel_error"] < 1e-5
    assert ell["ok"] and ell["max_rel_error"] < 1e-5 and "mla_gbps" in proc.stdout
    assert f"{len(FIGURES)} of {len(FIGURES)} figures ok" in proc.stdout


def test_isolated_figures_and_the_time_limit(tmp_path):
    """On a GPU each figure runs in its own process; the run stops starting figures at
    --time-limit."""
    out = tmp_path / "iso.json"
    proc = _run("--dry-run", "--isolate", "--only", "d", "--out", str(out))
    res = json.loads(out.read_text())
    assert proc.returncode == 0 and res["isolated"] is True, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )
    d = res["figures"]["d"]
    assert d["status"] == "ok" and d["rows"] and d["seconds"] > 0, d.get("error")
    proc = _run("--dry-run", "--only", "a", "--time-limit", "1", "--out", str(out), timeout=60)
    a = json.loads(out.read_text())["figures"]["a"]
    assert a["status"] == "skipped" and "time limit" in a["error"]
    assert proc.returncode == 1  # a figure that did not run is not ok


def test_unknown_figure_is_refused():
    proc = _run("--dry-run", "--only", "a,z", timeout=60)
    assert proc.returncode == 2 and "unknown figure 'z'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_it_needs_one(tmp_path):
    proc = _run("--out", str(tmp_path / "x.json"), timeout=60)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def _import(module: str):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return __import__(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_a_figure_past_its_hard_limit_is_killed_and_recorded(tmp_path):
    gpu_check = _import("gpu_check")
    args = gpu_check.parse_args(["--dry-run"])
    start = time.perf_counter()
    rec = gpu_check.run_isolated("h", args, tmp_path, budget=100, hard=1.0)
    assert time.perf_counter() - start < 30
    assert (
        rec["status"] == "timeout" and rec["name"] == "speculative"
        and "killed after 1 s" in rec["error"]
    )


def test_peak_bandwidth_table():
    peak_bandwidth = _import("gpu_check_models").peak_bandwidth
    assert peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35
    assert peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0
    assert peak_bandwidth("NVIDIA H200")[0] == 4.8
    assert peak_bandwidth("NVIDIA A100-SXM4-80GB")[0] == 2.0
    assert peak_bandwidth("NVIDIA A100-SXM4-40GB")[0] == 1.56
    assert peak_bandwidth("NVIDIA L4")[0] == 0.3 and peak_bandwidth("NVIDIA A10")[0] == 0.6
    assert peak_bandwidth("Tesla T4")[0] == 0.32
    for unknown in ("NVIDIA L40S", "NVIDIA A100X", "NVIDIA GH200 480GB", "NVIDIA H100 NVL",
                    "NVIDIA RTX 4090"):
        peak, note = peak_bandwidth(unknown)
        assert peak is None and note.startswith("unknown"), unknown


def test_the_roofline_preset_fits_eight_minutes():
    """--preset roofline: issue 43's figures within 480 s of budgets; flags given too win."""
    gpu_check = _import("gpu_check")

    args = gpu_check.parse_args(["--preset", "roofline"])
    assert args.only == ["c", "d", "e", "g", "h", "j"] and args.time_limit == 480
    assert sum(args.budgets.values()) <= 480 and set(args.budgets) == set(args.only)
    args = gpu_check.parse_args(["--preset", "roofline", "--only", "e", "--time-limit", "100"])
    assert args.only == ["e"] and args.time_limit == 100


def test_figure_l_times_only_launches_the_compile_matrix_covers():
    """Figure l's launches (mla_decode at 16 and 128 heads; paged decode at head_dim 128 with 1 and
    8 heads a KV head, one split; the sinks row) are rows that compiled on sm_80 and sm_90 in
    benchmarks/kernels_compile.json; a shape outside it (GQA 16) is not."""
    interpreter = os.environ.get("TRITON_INTERPRET")
    kernels = _import("gpu_check_kernels")
    rows = json.loads((SCRIPT.parent / "kernels_compile.json").read_text())["rows"]

    def compiled(arch, case, head_dim, gqa, variant):
        return any(r["arch"] == arch and r["dtype"] == "bf16" and r["case"] == case
                   and r["head_dim"] == head_dim and r["gqa"] == gqa
                   and r["variant"] == variant and r["status"] == "ok" for r in rows)

    dims, sinks = kernels.MLA_DIMS, kernels.SINKS_SHAPE
    rank, rope = dims["kv_lora_rank"], dims["qk_rope_head_dim"]
    for arch in (80, 90):
        for H in kernels.MLA_HEADS:
            assert compiled(arch, "mla_decode", None, None, f"r {rank} rope {rope} H {H}"), H
        for group in (1, dims["gqa_group"]):
            assert compiled(arch, "decode", dims["paged_head_dim"], group, "1 split"), group
        group = sinks["heads"] // sinks["kv_heads"]
        assert compiled(arch, "decode", sinks["head_dim"], group, "sinks + window")
        assert not compiled(arch, "decode", dims["paged_head_dim"], 16, "1 split")
    # the compile matrix's page size, read from its source: importing bench_kernels_compile would
    # set TRITON_INTERPRET=0 for this process, and the workers later tests spawn inherit it
    source = (SCRIPT.parent / "bench_kernels_compile.py").read_text()
    assert kernels.PAGE == int(re.search(r"^HKV, BS = \d+, (\d+)", source, re.M).group(1))
    assert os.environ.get("TRITON_INTERPRET") == interpreter  # (spawned workers inherit it)
