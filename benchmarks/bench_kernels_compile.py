"""Compile every Triton kernel for real GPUs on a machine without one: shared memory, registers,
spills.

    python benchmarks/bench_kernels_compile.py [--out benchmarks/kernels_compile.json] [--jobs 2]
    PYTHONPATH=/tmp/triton36 python benchmarks/bench_kernels_compile.py \
        --out benchmarks/kernels_compile_triton36.json   # under the GPU image's Triton 3.6.0

(Triton 3.6.0 installed apart: `pip install --no-deps --target /tmp/triton36 triton==3.6.0`;
benchmarks/RESULTS.md, "The compile matrix under Triton 3.6.0".)

Triton compiles for a GPU it does not have (`triton.compile(..., target=GPUTarget("cuda", arch,
32))`) and its ptxas reports registers and spills. Each row calls a *launcher* (flash_attention,
paged_attention, store_kv, dequant_gemm/gemv, dequantize_int4) with small CPU tensors while
`kernels.configs.gpu_arch` says sm_<arch>: the launcher picks its launch config as on that GPU, and
the kernel call, instead of running, is compiled with the arguments, constexprs, num_warps and
num_stages the launcher passed, specialised as Triton's own launch does (ints equal to 1 become
constants, 16-divisible ints and pointers get divisibility hints). So the table is what the
launchers launch. Matrix: sm_75/80/86/89/90 × fp16/bf16/fp32 × head_dim 64/128/256 for flash and
decode (GQA 4; decode also GQA 1 and 8 at head_dim 128, and split-KV + merge in fp16), store_kv at
head_dim 128, the three over 8-bit KV pools (`kv8_modes`: "int8 KV", "fp8_e4m3 KV", ...), the W4A16
kernels at K = N = 4096 (the GEMV at M = 1, by multiply-adds, and at M = 16, by tl.dot; also
with their codes in the MMA layout, kernels/int4_tiles.py, variants "... mma"), the W8A8 int8
GEMM (sm_80+, K = N = 4096, each output dtype), RMSNorm as one kernel (rows of 2048, Llama's
convention, and 3072, Gemma's), alone and with the residual add folded in (add_rms_norm), SwiGLU's
silu_and_mul (I = 5632 and 8192), RoPE from a table (kernels/rotary.py: fused with the K/V store
at head_dim 64 and 128, alone at 128, and Phi-3's partial RoPE at 96), and the GGML block-type
matmul (kernels/ggml_matmul.py: Q8_0, Q4_K, Q6_K at K = N = 4096; the GEMV at M = 1 with split-K
and at M = 16, the GEMM at M = 32; sm_75/80/90 only), and MLA's decode over a latent pool
(kernels/mla_decode.py: r = 512, d_rope = 64, 16 and 128 heads, bf16 and fp32 at 16; sm_80/90).
`--cases ggml_gemv,ggml_gemm` compiles only those rows (for a look; the committed table and the
test are the full run). Attention on sm_75 is refused by the launchers (kernels/configs.py):
"unsupported" rows say why.

Each row also says what its tl.dot became in the PTX ("mma f16", "wgmma bf16", "mma tf32", or "fma"
without tensor cores), and `relayouts`: how many tiles computed in registers the compiled kernel
writes to shared memory to read them back in another layout (`ttg.local_alloc` of a register
tensor in the TTGIR; loads staged through shared memory by the pipeliner are not counted). A row
fails if it does not compile, or needs more shared memory than its GPU has
(configs.SMEM_LIMIT_KB) or than its configs row claims (smem_kb). The control row, the old fp32
head_dim-128 flash tiles (64×64, 4 warps, 2 stages) on sm_86, must come out over the limit: it
shows the check can fail. Spills are reported, not failed. Saves the JSON, prints a table, exits
1 on a failed row. tests/test_kernels_compile.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# compile for real GPUs; before Triton (and nanoserve) is imported
os.environ["TRITON_INTERPRET"] = "0"
# Triton prints ptxas -v (registers, spills) for each kernel
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from nanoserve.kernels import configs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

HERE = Path(__file__).resolve().parent
ARCHS = (75, 80, 86, 89, 90)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
HKV, BS = 8, 16  # kv heads, page size
# the kernels with a tl.dot
DOT_KERNELS = ("flash_attention", "paged_decode", "dequant_gemm", "dequant_gemv", "w8a8",
               "lut_gemv", "mla_decode")


# ----------------------------------------------------------------------------- capture and compile
@contextlib.contextmanager
def pretend_gpu(arch: int):
    """Launchers pick their configs for sm_<arch>; every kernel[grid](...) call is recorded, not
    run."""
    calls = []
    real_arch, real_run = configs.gpu_arch, JITFunction.run
    configs.gpu_arch = lambda device: arch
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: calls.append((self, args, kwargs))
    try:
        yield calls
    finally:
        configs.gpu_arch, JITFunction.run = real_arch, real_run


def compile_call(fn, args, kwargs, arch: int) -> dict:
    """Compile one recorded launch for sm_<arch> as JITFunction.run would: shared memory, registers,
    spills."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(
        fn.signature, fn.params, backend
    )(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    log = io.StringIO()
    # an empty cache for each kernel: a cache hit would skip ptxas, and with it the registers and
    # spills
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        os.environ["TRITON_CACHE_DIR"] = cache
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    regs = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    return {"smem_bytes": kernel.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "dot": dot_units(kernel.asm["ptx"]), "relayouts": relayouts(kernel.asm["ttgir"])}


def relayouts(ttgir: str) -> int:
    """Register tiles sent through shared memory to change layout: `ttg.local_alloc %v : (tensor
    ...)` (an allocation filled from registers; the pipeliner's buffers are allocated empty)."""
    return len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor<", ttgir))


def dot_units(ptx: str) -> str:
    """What the kernel's tl.dot became: tensor-core instructions and their input type ("mma f16",
    "wgmma bf16", "mma tf32"), or "fma" (no tensor-core instruction in the PTX)."""
    found = sorted(
        {
            f"{op} {a}"
            for op, a in re.findall(r"\b(wgmma|mma)\.[\w.]*?\.[fs]32\.(f16|bf16|tf32|s8)\.", ptx)
        }
    )
    return ", ".join(found) or "fma"


def describe(kwargs: dict) -> str:
    """The launch config of a recorded call: its tile constexprs, warps, stages."""
    tiles = "×".join(
        str(v) for k, v in kwargs.items()
        if k.startswith("BLOCK_") and k not in ("BLOCK_SIZE", "BLOCK_D")
    )
    # Triton's defaults: 4, 3
    return f"{tiles or '-'} w{kwargs.get('num_warps', 4)} s{kwargs.get('num_stages', 3)}"


# ----------------------------------------------------------------------------- the launches
def _pool(dtype, D, kv="auto"):
    """A pool of 4 blocks, and the keyword arguments the kernels take for it: 8-bit codes with their
    scales when kv names a quantized kv_cache_dtype (nanoserve/kv/quant.py)."""
    from nanoserve.kv.quant import kv_quant

    if kv == "auto":
        return torch.zeros(4, BS, HKV, D, dtype=dtype), {}
    fmt = kv_quant(kv)
    code_shape, scale_shape = fmt.pool_shapes((4, BS, HKV, D))  # int4: D/2 bytes, 2·D/64 scales
    scales = torch.zeros(scale_shape, dtype=torch.float16)
    return torch.zeros(code_shape, dtype=fmt.storage), dict(
        k_scale=scales, v_scale=scales, kv_cache_dtype=kv
    )


def _flash(dtype, D, gqa, extra=None, kv="auto", **tiles):
    from nanoserve.kernels.flash_attention import flash_attention

    H = HKV * gqa
    # tokens, heads, D
    q, k = torch.zeros(4, H, D, dtype=dtype), torch.zeros(4, HKV, D, dtype=dtype)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    kc, quant = _pool(dtype, D, kv)  # the engine always passes its paged prefix
    flash_attention(q, k, k, cu, cu, True, None, torch.zeros(2, 2, dtype=torch.int32), kc, kc,
                    torch.tensor([3, 20], dtype=torch.int32), max_seqlen_q=2, **(extra or {}),
                    **quant, **tiles)


def _decode(dtype, D, gqa, splits=1, extra=None, kv="auto"):
    from nanoserve.kernels.paged_attention import paged_attention

    q, (kc, quant) = torch.zeros(2, HKV * gqa, D, dtype=dtype), _pool(dtype, D, kv)
    paged_attention(q, kc, kc, torch.zeros(2, 2, dtype=torch.int32),
                    torch.tensor([5, 20], dtype=torch.int32),
                    num_splits=splits, max_context=20, **(extra or {}), **quant)


def _store_kv(dtype, D, kv="auto"):
    from nanoserve.kernels.store_kv import store_kv

    k, (kc, quant) = torch.zeros(3, HKV, D, dtype=dtype), _pool(dtype, D, kv)
    store_kv(k, k, kc, kc, torch.tensor([0, -1, 17]), **quant)


def _rms_norm(dtype, n, unit_offset):
    from nanoserve.kernels.rms_norm import rms_norm

    rms_norm(torch.zeros(2, n, dtype=dtype), torch.zeros(n, dtype=dtype), 1e-6, unit_offset)


def _add_rms_norm(dtype, n, unit_offset):
    from nanoserve.kernels.rms_norm import add_rms_norm

    x = torch.zeros(2, n, dtype=dtype)
    add_rms_norm(x, x, torch.zeros(n, dtype=dtype), 1e-6, unit_offset)


def _silu_and_mul(dtype, inter):
    from nanoserve.kernels.silu_mul import silu_and_mul

    silu_and_mul(torch.zeros(2, 2 * inter, dtype=dtype))


def _rotary(dtype, D, store, partial=False):
    from nanoserve.kernels.rotary import rotary_embedding, rotary_embedding_store_kv

    half = 3 * D // 8 if partial else D // 2  # Phi-3's partial RoPE: 3/4 of each head
    q, k = torch.zeros(3, 4 * HKV, D, dtype=dtype), torch.zeros(3, HKV, D, dtype=dtype)
    cos = torch.zeros(64, half, dtype=dtype)
    positions = torch.tensor([0, 5, 63])
    if store:
        kc, _ = _pool(dtype, D)
        rotary_embedding_store_kv(q, k, k, positions, cos, cos, kc, kc, torch.tensor([0, -1, 17]))
    else:
        rotary_embedding(q, k, positions, cos, cos)


def _dequant(dtype, which, split_k=1, grouped=True, M=1, mma=False):
    from nanoserve.kernels import dequant_matmul as dm

    K = N = 4096
    gptq = dict(qweight=torch.zeros(K // 8, N, dtype=torch.int32),
                qzeros=torch.zeros(K // 128, N // 8, dtype=torch.int32),
                scales=torch.zeros(K // 128, N, dtype=dtype),
                g_idx=torch.arange(K, dtype=torch.int32) // 128)
    # None: the act-order path (zeros and scales row by row)
    group = dict(group_size=128 if grouped else None)
    if which == "gemm":
        dm.dequant_gemm(torch.zeros(32, K, dtype=dtype), **gptq, **group, mma_layout=mma)
    elif which == "gemv":
        dm.dequant_gemv(torch.zeros(M, K, dtype=dtype), **gptq, split_k=split_k, **group,
                        mma_layout=mma)
    elif mma:
        dm.dequantize_int4_mma(**gptq, dtype=dtype)
    else:
        dm.dequantize_int4(**gptq, dtype=dtype)


def _ggml(dtype, type_name, M, split_k):
    from nanoserve.kernels.ggml_matmul import ggml_matmul

    from nanoserve.quant.ggml_blocks import BLOCK_TYPES

    K = N = 4096
    kind = BLOCK_TYPES[type_name]
    packed = torch.zeros(N, K // kind.block_weights * kind.block_bytes, dtype=torch.uint8)
    ggml_matmul(torch.zeros(M, K, dtype=dtype), packed, type_name, N, split_k=split_k)


# (M, split_k) of the GGML block-type rows (kernels/ggml_matmul.py), for each of its types: the
# decode GEMV by multiply-adds with split-K, the GEMV of 16 rows by tl.dot, the row-tiled GEMM
GGML_ROWS = ((1, 4), (16, 1), (32, 1))
GGML_ARCHS = (75, 80, 90)


def _ggml_rows(arch: int, dt: str, dtype) -> list:
    rows = []
    for type_name in ("Q8_0", "Q4_K", "Q6_K"):
        for M, split_k in GGML_ROWS:
            case = "ggml_gemv" if M <= 16 else "ggml_gemm"  # ggml_matmul.GEMV_MAX_M
            row = dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case=case,
                       variant=f"{type_name} M {M} split_k {split_k}")
            rows.append((row, (_ggml, dtype, type_name, M, split_k)))
    return rows


def kv8_modes(dt: str, D: int) -> tuple[str, ...]:
    """The 8-bit KV rows: int8 and e4m3 at every head dim in fp16, at 128 in bf16; e5m2 (e4m3's code
    path but for its constants) at fp16/128; fp32 with int8 where the KV8 table has rows of its
    own."""
    if dt == "fp16":
        return ("int8", "fp8_e4m3", "fp8_e5m2") if D == 128 else ("int8", "fp8_e4m3")
    if dt == "bf16":
        return ("int8", "fp8_e4m3") if D == 128 else ()
    return ("int8",) if D in (128, 256) else ()


def _w8a8(dtype):
    from nanoserve.kernels.int8_matmul import w8a8_matmul

    M, K, N = 32, 4096, 4096
    w8a8_matmul(torch.zeros(M, K, dtype=torch.int8), torch.ones(M),
                torch.zeros(N, K, dtype=torch.int8),
                torch.ones(N), torch.zeros(N, dtype=dtype), out_dtype=dtype)


def _lora(dtype):
    from nanoserve.kernels.lora_bgmv import lora_bgmv

    N, K, S, R = 4, 4096, 8, 16  # decode rows, a 4096-wide layer, 8 adapter slots of rank 16
    lora_bgmv(torch.zeros(N, K, dtype=dtype), torch.zeros(S, R, K, dtype=dtype),
              torch.zeros(S, K, R, dtype=dtype),
              torch.zeros(N, dtype=torch.int32), torch.zeros(N, K, dtype=dtype))


def _lut_gemv(dtype, M):
    from nanoserve.kernels.lut_gemv import lut_gemv

    N, K = 4096, 4096  # a 4096-wide layer clustered at 4 bits: 16 centroids per output row
    lut_gemv(torch.zeros(M, K, dtype=dtype), torch.zeros(N, K, dtype=torch.uint8),
             torch.zeros(N, 16, dtype=torch.float16))


def _mla_decode(dtype, H):
    from nanoserve.kernels.mla_decode import mla_decode

    r, d_rope = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim
    cache = torch.zeros(4, BS, 1, r + d_rope, dtype=dtype)  # the latent pool: c, then k_pe
    mla_decode(torch.zeros(2, H, r, dtype=dtype), torch.zeros(2, H, d_rope, dtype=dtype), cache,
               torch.zeros(2, 2, dtype=torch.int32), torch.tensor([5, 20], dtype=torch.int32),
               1 / 192**0.5)


# heads of the MLA decode rows (DeepSeek-V2-Lite: 16; V3: 128), by dtype; sm_80 and sm_90
MLA_HEADS = {"bf16": (16, 128), "fp32": (16,)}


# (kernel, split_k, grouped, M, MMA layout) of the W4A16 rows
DEQUANT_ROWS = (("gemm", 1, True, 32, False), ("gemm", 1, False, 32, False),
                ("gemv", 1, True, 1, False), ("gemv", 4, True, 1, False),
                ("gemv", 1, False, 1, False), ("gemv", 1, True, 16, False),
                ("gemv", 1, False, 16, False), ("dequantize", 1, True, 0, False),
                ("gemm", 1, True, 32, True), ("gemv", 1, True, 1, True), ("gemv", 4, True, 1, True),
                ("gemv", 1, True, 16, True))


def _dequant_variant(which: str, split_k: int, grouped: bool, M: int, mma: bool) -> str:
    words = [f"M {M} split_k {split_k}"] if which == "gemv" else []
    if which != "dequantize":
        words.append("g128" if grouped else "act-order")
    if mma:
        words.append("mma")
    return " ".join(words)


def matrix(archs=ARCHS) -> list[tuple[dict, tuple | None]]:
    """(row labels, launch: a function and its arguments) for every row; None = refused, nothing to
    compile."""
    rows = []
    for arch in archs:
        for dt, dtype in DTYPES.items():
            for D in HEAD_DIMS:
                row = dict(arch=arch, dtype=dt, head_dim=D, gqa=4)
                problem = configs.attention_problem(arch, dtype, D)
                if problem:  # sm_75: the engine uses the torch backend there
                    rows.append((dict(row, case="attention", variant="", status="unsupported",
                                      reason=problem), None))
                    continue
                rows.append((dict(row, case="flash", variant="paged prefix"),
                             (_flash, dtype, D, 4)))
                rows.append((dict(row, case="decode", variant="1 split"), (_decode, dtype, D, 4)))
                if D == 128:  # GQA changes only the decode kernel (its GROUP constexpr)
                    rows += [(dict(row, case="decode", gqa=g, variant="1 split"),
                              (_decode, dtype, D, g))
                             for g in (1, 8)]
                    rows.append((dict(row, case="store_kv", gqa=None, variant=""),
                                 (_store_kv, dtype, D)))
                if D == 128 and dt == "fp16":
                    rows.append((dict(row, case="decode", variant="4 splits"),
                                 (_decode, dtype, D, 4, 4)))
                # 8-bit KV pools: quantized by store_kv, dequantized in registers
                for kv in kv8_modes(dt, D):
                    rows += [(dict(row, case="flash", variant=f"{kv} KV"),
                              (_flash, dtype, D, 4, None, kv)),
                             (dict(row, case="decode", variant=f"{kv} KV"),
                              (_decode, dtype, D, 4, 1, None, kv))]
                    if D == 128 and dt != "fp32":
                        rows.append((dict(row, case="store_kv", gqa=None, variant=f"{kv} KV"),
                                     (_store_kv, dtype, D, kv)))
                # int4 KV pools: two codes a byte, a scale and a minimum per 64 values
                if dt != "fp32" and D in (64, 128):
                    rows += [(dict(row, case="flash", variant="int4 KV"),
                              (_flash, dtype, D, 4, None, "int4")),
                             (dict(row, case="decode", variant="int4 KV"),
                              (_decode, dtype, D, 4, 1, None, "int4"))]
                    if D == 128:
                        rows.append((dict(row, case="store_kv", gqa=None, variant="int4 KV"),
                                     (_store_kv, dtype, D, "int4")))
                # speculative verification of a token tree: bits per query
                if D == 128 and dt != "fp32":
                    tree = dict(tree_bits=torch.full((4,), -1, dtype=torch.int64))
                    rows.append((dict(row, case="flash", variant="token tree"),
                                 (_flash, dtype, D, 4, tree)))
                # Gemma 2 (head_dim 256): soft-capped scores, a window
                if dt == "bf16" and D in (128, 256):
                    gemma, variant = dict(softcap=50.0, window=4096), "softcap + window"
                    rows.append((dict(row, case="flash", variant=variant),
                                 (_flash, dtype, D, 4, gemma)))
                    rows.append((dict(row, case="decode", variant=variant),
                                 (_decode, dtype, D, 4, 1, gemma)))
                # gpt-oss (head_dim 64, GQA 8 in the release; 4 here): attention sinks, a window
                if dt == "bf16" and D == 64:
                    oss = dict(sinks=torch.zeros(4 * HKV), window=128)
                    rows += [(dict(row, case="flash", variant="sinks + window"),
                              (_flash, dtype, D, 4, oss)),
                             (dict(row, case="decode", variant="sinks + window"),
                              (_decode, dtype, D, 4, 1, oss)),
                             (dict(row, case="decode", variant="sinks 4 splits"),
                              (_decode, dtype, D, 4, 4, oss))]
            # MLA's absorbed decode over a latent pool (kernels/mla_decode.py)
            if arch in (80, 90):
                rows += [(dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case="mla_decode",
                               variant=f"r 512 rope 64 H {H}"), (_mla_decode, dtype, H))
                         for H in MLA_HEADS.get(dt, ())]
            # W8A8: an int8 GEMM with its scales in the epilogue, the output in each dtype
            if arch >= 80:
                rows.append((dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case="w8a8",
                                  variant="M 32"),
                             (_w8a8, dtype)))
                rows.append((dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case="lora_bgmv",
                                  variant="r 16"),
                             (_lora, dtype)))  # many LoRA adapters in a batch: shrink, then expand
                # a clustered weight's look-up GEMV: multiply-adds at M = 1, tl.dot at M = 16
                rows += [(dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case="lut_gemv",
                               variant=f"M {M} b4"), (_lut_gemv, dtype, M)) for M in (1, 16)]
            # RMSNorm as one kernel (the triton path's norms): Llama's and Gemma's conventions
            for n, unit_offset in ((2048, False), (3072, True)):
                variant = f"{n}" + (" gemma" if unit_offset else "")
                rows.append((dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case="rms_norm",
                                  variant=variant),
                             (_rms_norm, dtype, n, unit_offset)))
                # the same kernel with the residual add folded in (HAS_RESIDUAL)
                rows.append((dict(arch=arch, dtype=dt, head_dim=None, gqa=None,
                                  case="add_rms_norm", variant=variant),
                             (_add_rms_norm, dtype, n, unit_offset)))
            # RoPE from a table, alone and fused with the K/V store (GQA 4 over HKV kv heads)
            for D, store, partial in ((64, True, False), (128, True, False), (128, False, False),
                                      (96, False, True)):
                variant = ("store" if store else "rotate") + (" partial" if partial else "")
                rows.append((dict(arch=arch, dtype=dt, head_dim=D, gqa=4, case="rotary",
                                  variant=variant),
                             (_rotary, dtype, D, store, partial)))
            # SwiGLU's silu(gate) · up as one kernel: TinyLlama's and Llama 3.2 1B's MLP widths
            for inter in (5632, 8192):
                rows.append((dict(arch=arch, dtype=dt, head_dim=None, gqa=None,
                                  case="silu_and_mul", variant=f"I {inter}"),
                             (_silu_and_mul, dtype, inter)))
            # the GEMV at M = 1 (multiply-adds) and M = 16 (tl.dot); codes in GPTQ's order, and
            # (mma) in the MMA layout
            for which, split_k, grouped, M, mma in DEQUANT_ROWS:
                row = dict(arch=arch, dtype=dt, head_dim=None, gqa=None, case=which,
                           variant=_dequant_variant(which, split_k, grouped, M, mma))
                rows.append((row, (_dequant, dtype, which, split_k, grouped, M, mma)))
            # llama.cpp's Q8_0 / Q4_K / Q6_K blocks read in place, K = N = 4096
            if arch in GGML_ARCHS:
                rows += _ggml_rows(arch, dt, dtype)
    control = dict(arch=86, dtype="fp32", head_dim=128, gqa=4, case="flash",
                   variant="control: old tiles")
    rows.append((control, (_flash, torch.float32, 128, 4)))
    return rows


# ----------------------------------------------------------------------------- the run
_JOBS: list = []  # (row, fn, args, kwargs), filled before the worker processes fork


def _compile_job(i: int) -> dict:
    row, fn, args, kwargs = _JOBS[i]
    try:
        result = dict(row, **compile_call(fn, args, kwargs, row["arch"]))
        return result if row["kernel"] in DOT_KERNELS else dict(result, dot="-")
    except Exception as e:  # noqa: BLE001  a compile error is a result row
        return dict(row, status="error",
                    reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")


def run(jobs: int = 2, archs=ARCHS, cases: tuple[str, ...] = (), variant: str = "") -> dict:
    """Compile the matrix's rows for `archs`; `cases`: only the rows of these cases (e.g.
    "ggml_gemv"), none of them: every row; `variant`: only rows whose variant contains it."""
    start = time.perf_counter()
    entries, _JOBS[:] = [], []  # entries: a finished row, or the index of its compile job
    for row, launch in matrix(archs):
        if cases and row["case"] not in cases:
            continue
        if variant and variant not in row.get("variant", ""):
            continue
        if launch is None:
            entries.append(row)
            continue
        with pretend_gpu(row["arch"]) as calls:
            launch[0](*launch[1:])
        for fn, args, kwargs in calls:
            # _paged_decode_kernel -> paged_decode
            kernel = fn.fn.__name__.strip("_").removesuffix("_kernel")
            # the tiles flash used before kernels/configs.py
            if row["variant"].startswith("control"):
                kwargs = dict(kwargs, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
            entries.append(len(_JOBS))
            _JOBS.append((dict(row, kernel=kernel, config=describe(kwargs)), fn, args, kwargs))
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        compiled = pool.map(_compile_job, range(len(_JOBS)), chunksize=1)
    results = [compiled[e] if isinstance(e, int) else e for e in entries]
    for r in results:
        judge(r)
    return {"triton": triton.__version__, "torch": torch.__version__, "jobs": jobs,
            "seconds": round(time.perf_counter() - start, 1),
            "smem_limit_kb": configs.SMEM_LIMIT_KB,
            "rows": results}


def judge(r: dict) -> None:
    """status: ok, over (shared memory above the GPU's limit or the configs row's smem_kb), error,
    unsupported."""
    if r.get("status") in ("error", "unsupported"):
        return
    kb = r["smem_bytes"] / 1024
    r["smem_limit_kb"] = configs.smem_limit_kb(r["arch"])
    row = None if r["variant"].startswith("control") else _table_row(r)
    r["table_smem_kb"] = row.smem_kb if row else None
    over = kb > r["smem_limit_kb"] or (r["table_smem_kb"] is not None and kb > r["table_smem_kb"])
    r["status"] = "over" if over else "ok"


def _table_row(r: dict) -> configs.Launch | None:
    """The configs row the launcher took; None for store_kv and the merge (no tl.dot, a few KB)."""
    kind = {"flash_attention": "flash", "paged_decode": "decode", "dequant_gemm": "gemm",
            "dequant_gemv": "gemv",
            "dequantize": "dequantize", "w8a8": "w8a8", "mla_decode": "mla_decode"}.get(r["kernel"])
    if r["kernel"] == "ggml_matmul":
        kind = r["case"]  # its GEMV or GEMM row
    if kind is None:
        return None
    # the gather path's own row; the MMA layout's (multiply-adds at M ≤ 2)
    if kind == "gemv" and ("act-order" in r["variant"] or r["arch"] < 80):
        kind = "gemv_gather"
    elif kind == "gemv" and r["variant"].endswith(" mma"):
        kind = "gemv_mma_fma" if int(r["variant"].split()[1]) <= 2 else "gemv_mma"
    elif kind == "gemm" and r["variant"].endswith(" mma"):
        kind = "gemm_mma"
    with pretend_gpu(r["arch"]):
        return configs.pick(kind, "cuda", DTYPES[r["dtype"]], r["head_dim"] or 0,
                            kv_bits=_kv_bits(r["variant"]))


def _kv_bits(variant: str) -> int:
    """The bits of a row's KV codes, from its variant ("int8 KV", "int4 KV"; 0: not a KV pool)."""
    from nanoserve.kernels.kv_quant import kv_bits

    return kv_bits(variant.removesuffix(" KV")) if variant.endswith(" KV") else 0


def failures(result: dict) -> list[dict]:
    """Rows that fail: errors, and rows over a limit, except the control, which must be over."""
    return [r for r in result["rows"] if r["status"] == "error"
            or (r["status"] == "over") != r["variant"].startswith("control")]


def table(result: dict) -> str:
    lines = [f"{'arch':5} {'dtype':5} {'D':>4} {'kernel':16} {'gqa':>3} {'variant':18} "
             f"{'config':18} {'smem KB':>8} {'limit':>5} {'regs':>4} {'spill B':>7} {'dot':10} "
             f"{'relay':>5} status"]
    for r in result["rows"]:
        if r["status"] == "unsupported":
            lines.append(f"sm_{r['arch']:<2} {r['dtype']:5} {r['head_dim']:>4} {'attention':16} "
                         f"{'':>3} {'':18} {'':18} unsupported: {r['reason']}")
            continue
        smem = f"{r['smem_bytes'] / 1024:.1f}" if "smem_bytes" in r else "-"
        reason = f": {r['reason']}" if r.get("reason") else ""
        lines.append(f"sm_{r['arch']:<2} {r['dtype']:5} {r['head_dim'] or '':>4} {r['kernel']:16} "
                     f"{r['gqa'] or '':>3} {r['variant']:18} {r.get('config', ''):18} {smem:>8} "
                     f"{r.get('smem_limit_kb', ''):>5} {r.get('regs', ''):>4} "
                     f"{r.get('spill_bytes', ''):>7} {r.get('dot', ''):10} "
                     f"{r.get('relayouts', ''):>5} {r['status']}{reason}")
    return "\n".join(lines)


def dumps(result: dict) -> str:
    """JSON with one row per line, so that a rerun's diff shows the rows that changed."""
    head = json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1,
                      ensure_ascii=False)
    rows = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in result["rows"])
    return f'{head[:-2]},\n "rows": [\n  {rows}\n ]\n}}\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "kernels_compile.json"))
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    parser.add_argument("--archs", default=",".join(map(str, ARCHS)),
                        help="e.g. 80,90 (default: all)")
    parser.add_argument("--cases", default="",
                        help="only these cases, e.g. ggml_gemv,ggml_gemm (default: all; the "
                             "committed table is the full run)")
    parser.add_argument("--variant", default="",
                        help="only rows whose variant contains this, e.g. 'int4 KV'")
    args = parser.parse_args(argv)
    cases = tuple(c for c in args.cases.split(",") if c)
    result = run(args.jobs, tuple(int(a) for a in args.archs.split(",")), cases, args.variant)
    Path(args.out).write_text(dumps(result))
    print(table(result))
    bad = failures(result)
    print(f"{len(result['rows'])} rows, {len(bad)} failed, {result['seconds']} s with {args.jobs} "
          f"processes (triton {result['triton']}); saved {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
