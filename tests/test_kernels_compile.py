"""The compile matrix: every kernel compiled for sm_75/80/86/89/90 by Triton's GPU compiler, without
a GPU.

docs/TESTING.md §D. benchmarks/bench_kernels_compile.py calls each launcher as if its tensors were
on sm_<arch> and compiles the kernel call it would make (its tiles, warps, stages, constexprs),
for fp16/bf16/fp32 × head_dim 64/128/256 (GQA 1/4/8 for decode), the attention kernels over 8-bit KV
pools, and the W4A16 kernels. It runs in
a subprocess: compiling needs Triton without the interpreter, which conftest.py switches on for
this process. A row fails on a compile error or on shared memory above its GPU's limit (or above
what its kernels/configs.py row claims); the control, the old fp32 head_dim-128 flash tiles on
sm_86, must be reported over. About 80 s on 2 quiet cores (~370 compiles, 2 processes). Each row
also counts the tiles its kernel relays through shared memory (`relayouts`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_kernels_compile.py"
COMMITTED = ROOT / "benchmarks" / "kernels_compile.json"
GPUS = (80, 86, 89, 90)  # the engine's Triton attention runs from sm_80 on
DTYPES = ("fp16", "bf16", "fp32")


def _cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _cuda_backend(), reason="this Triton has no CUDA compiler")]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "kernels_compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout)  # the table (pytest -s shows it)
    assert out.exists(), proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


def _rows(result, **match):
    return [r for r in result["rows"] if all(r.get(k) == v for k, v in match.items())]


def test_every_launch_compiles_and_fits_its_gpu(compiled):
    proc, result = compiled
    control = lambda r: r["variant"].startswith("control")  # noqa: E731
    errors = [r for r in result["rows"] if r["status"] == "error"]
    over = [r for r in result["rows"] if r["status"] == "over" and not control(r)]
    assert not errors, errors
    assert not over, over  # over the GPU's shared memory, or over the configs row's smem_kb
    for r in result["rows"]:
        if r["status"] == "ok":
            assert r["smem_bytes"] <= 1024 * r["smem_limit_kb"]
            assert r["table_smem_kb"] is None or r["smem_bytes"] <= 1024 * r["table_smem_kb"]
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_the_engine_configs_are_all_in_the_matrix(compiled):
    _, result = compiled
    for arch in GPUS:
        for dt in DTYPES:
            for D in (64, 128, 256):
                for kernel in ("flash_attention", "paged_decode"):
                    assert _rows(result, arch=arch, dtype=dt, head_dim=D, kernel=kernel,
                                 status="ok"), (arch, dt, D)
            assert {r["gqa"] for r in _rows(result, arch=arch, dtype=dt,
                                            kernel="paged_decode")} == {1, 4, 8}
            for kernel in ("store_kv", "dequant_gemm", "dequant_gemv", "dequantize", "w8a8",
                           "rms_norm"):
                assert _rows(result, arch=arch, dtype=dt, kernel=kernel, status="ok"), (
                    arch, dt, kernel,
                )
        assert _rows(result, arch=arch, kernel="merge_splits", status="ok")
    # sm_75: attention refused (the engine falls back to torch), the W4A16 kernels compiled in every
    # dtype
    refused = _rows(result, arch=75, case="attention")
    assert len(refused) == 9 and all(
        r["status"] == "unsupported" and "sm_80" in r["reason"] for r in refused
    )
    assert not _rows(result, arch=75, kernel="flash_attention")
    assert {r["dtype"] for r in _rows(result, arch=75, kernel="dequant_gemv",
                                      status="ok")} == set(DTYPES)


def test_8bit_kv_pools_compile_for_every_gpu_without_spills(compiled):
    """Quantized by store_kv and dequantized in registers by flash and decode (kernels/kv_quant.py):
    no FP8 instruction is needed, so every sm_80+ GPU compiles all three formats; in fp16/bf16 (the
    KV8 rows of kernels/configs.py where the plain rows spilled) nothing spills but 4 bytes in two
    sm_80 decode rows (at 96 and 168 registers: a ptxas quirk, not register pressure)."""
    _, result = compiled
    for arch in GPUS:
        for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
            for kernel in ("flash_attention", "paged_decode", "store_kv"):
                assert _rows(result, arch=arch, dtype="fp16", head_dim=128, kernel=kernel,
                             variant=f"{kv} KV",
                             status="ok"), (arch, kv, kernel)
    half = [r for r in result["rows"] if r["variant"].endswith(" KV") and r["dtype"] != "fp32"]
    assert len(half) >= 4 * 20 and all(r["spill_bytes"] <= 4 for r in half), [
        r for r in half if r["spill_bytes"] > 4
    ]


def test_dots_run_in_the_input_dtype_and_fp32_without_tf32(compiled):
    """fp16/bf16: tensor cores in that dtype on sm_80+ (decode no longer upcasts); fp32: IEEE (FMA),
    never TF32; the W8A8 GEMM: int8 (s8) tensor cores; the W4A16 GEMV of one row: multiply-adds
    (kernels/dequant_matmul.py's FMA path), of 16 rows: tensor cores; the look-up GEMV
    (kernels/lut_gemv.py) likewise."""
    _, result = compiled
    dots = [r for r in result["rows"] if r.get("dot", "-") != "-"]
    assert {r["kernel"] for r in dots} == {"flash_attention", "paged_decode", "dequant_gemm",
                                           "dequant_gemv", "w8a8", "lut_gemv", "mla_decode"}
    ptx_type = {"fp16": "f16", "bf16": "bf16"}
    for r in dots:
        if r["kernel"] == "w8a8":  # int8 × int8 on int8 tensor cores, whatever the output dtype
            assert {op.split()[1] for op in r["dot"].split(", ")} == {"s8"}, r
        elif r["dtype"] == "fp32" or r["arch"] < 80:  # sm_75: the W4A16 kernels upcast, FMA
            assert r["dot"] == "fma", r
        elif r["kernel"] in ("dequant_gemv", "lut_gemv") and r["variant"].startswith("M 1 "):
            assert r["dot"] == "fma", r  # one row: multiply-adds, no tile of 16 for tl.dot
        else:  # e.g. "mma bf16" (sm_80+), "wgmma f16" (sm_90)
            assert {op.split()[1] for op in r["dot"].split(", ")} == {ptx_type[r["dtype"]]}, r


def test_the_control_is_reported_over_the_limit(compiled):
    """The old fp32 head_dim-128 flash tiles (64×64, 4 warps, 2 stages) need ~112 KB; sm_86 has
    99."""
    _, result = compiled
    [control] = [r for r in result["rows"] if r["variant"].startswith("control")]
    assert control["arch"] == 86 and control["config"] == "64×64 w4 s2"
    assert control["status"] == "over" and control["smem_bytes"] > 99 * 1024


def test_the_mma_layout_sends_no_tile_through_shared_memory(compiled):
    """The W4A16 GEMV of 16 rows by tl.dot in fp16 / bf16 on sm_80+: with its codes in the MMA
    layout (kernels/int4_tiles.py) the compiler unpacks them in the tensor cores' operand layout
    (0 relayouts); in GPTQ's order it writes each dequantized tile to shared memory and reads it
    back (the negative control: ≥ 1). No MMA-layout GEMV spills."""
    _, result = compiled
    for arch in GPUS:
        for dt in ("fp16", "bf16"):
            [mma] = _rows(result, arch=arch, dtype=dt, kernel="dequant_gemv",
                          variant="M 16 split_k 1 g128 mma")
            [gptq] = _rows(result, arch=arch, dtype=dt, kernel="dequant_gemv",
                           variant="M 16 split_k 1 g128")
            assert mma["relayouts"] == 0 and gptq["relayouts"] >= 1, (mma, gptq)
    mma_rows = [r for r in result["rows"] if r["variant"].endswith(" mma")]
    assert mma_rows and all(r["spill_bytes"] == 0 for r in mma_rows if r["status"] == "ok")


def test_the_committed_table_is_current(compiled):
    """benchmarks/kernels_compile.json is what this Triton compiles today: rerun the script after
    changing a kernel."""
    _, result = compiled
    committed = json.loads(COMMITTED.read_text())
    if committed["triton"] != result["triton"]:
        pytest.skip(f"the committed table is for Triton {committed['triton']}, this is "
                    f"{result['triton']}")
    fields = ("arch", "dtype", "head_dim", "gqa", "case", "variant", "kernel", "config",
              "smem_bytes", "regs", "spill_bytes", "relayouts", "status")
    key = lambda r: tuple(r.get(f) for f in fields)  # noqa: E731
    assert [key(r) for r in committed["rows"]] == [key(r) for r in result["rows"]], (
        "benchmarks/kernels_compile.json is stale: run .venv/bin/python "
        "benchmarks/bench_kernels_compile.py")
