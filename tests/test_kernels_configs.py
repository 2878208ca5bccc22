"""Launch configs per GPU and the launchers' host syncs, on CPU (docs/TESTING.md §D).

A GPU is simulated: `configs.gpu_arch` says sm_<arch> and `checks.on_host` says the tensors are not
in CPU memory, while the tensors stay on the CPU and every kernel is replaced by a recorder. So
the launchers run their GPU path (configs, checks, grid) without running a kernel. A
TorchFunctionMode records every call that reads a tensor's value on the host (`.item()`,
`.tolist()`, `.cpu()`, `bool()`, `int()`, `nonzero`, a boolean-mask index, ...): on a GPU each is a
sync that makes the CPU wait for the GPU. The launchers must make none when given their host-side
arguments (max_seqlen_q, max_context), and run their value checks only with debug checks on.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels import checks, configs, triton_attention_supported
from nanoserve.kernels import dequant_matmul as dm
from nanoserve.kernels import flash_attention as fa
from nanoserve.kernels import paged_attention as pa
from nanoserve.kernels import split_kv as spk
from nanoserve.kernels import store_kv as sk
from torch.overrides import TorchFunctionMode

SYNCS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
         "__index__",
         "__format__", "__repr__", "equal", "allclose", "unique"}


class RecordSyncs(TorchFunctionMode):
    """Names of the torch calls that read tensor values on the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_host = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        mask_index = (
            name == "__getitem__" and isinstance(args[1], torch.Tensor)
            and args[1].dtype == torch.bool
        )
        if name in SYNCS or to_host or mask_index:
            self.calls.append(name)
        return func(*args, **kwargs)


class FakeKernel:
    """Stands in for a @triton.jit kernel: kernel[grid](...) records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


@pytest.fixture
def gpu(monkeypatch):
    """The launchers believe they run on an sm_90 GPU; returns the fake kernels by name."""
    monkeypatch.setattr(configs, "gpu_arch", lambda device: 90)
    monkeypatch.setattr(checks, "on_host", lambda *tensors: False)
    monkeypatch.setattr(checks, "DEBUG_CHECKS", False)
    fakes = {}
    for module, name in ((fa, "_flash_attention_kernel"), (pa, "_paged_decode_kernel"),
                         (spk, "_merge_splits_kernel"),
                         (sk, "_store_kv_kernel"), (dm, "_dequant_gemm_kernel"),
                         (dm, "_dequant_gemv_kernel"),
                         (dm, "_dequantize_kernel")):
        fakes[name] = FakeKernel()
        monkeypatch.setattr(module, name, fakes[name])
    return fakes


def _attention_inputs(bad=False):
    """Small paged-attention inputs; bad=True puts a block id past the pool and a length past the
    table."""
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)  # tokens, heads, D
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    pool = torch.randn(6, 8, 2, 64)  # num_blocks, block_size, Hkv, D
    table = torch.tensor([[0, 1], [2, 7 if bad else 3]], dtype=torch.int32)
    lens = torch.tensor([3, 99 if bad else 12], dtype=torch.int32)
    return q, k, cu, pool, table, lens


def _gptq(bad=False):
    K = N = 256
    g_idx = torch.arange(K, dtype=torch.int32) // 128 + (5 if bad else 0)
    return dict(qweight=torch.zeros(K // 8, N, dtype=torch.int32),
                qzeros=torch.zeros(2, N // 8, dtype=torch.int32),
                scales=torch.ones(2, N), g_idx=g_idx)


def _launch_all(bad=False):
    """Every launcher once, as the engine calls them (host-side bounds given)."""
    q, k, cu, pool, table, lens = _attention_inputs(bad)
    fa.flash_attention(q, k, k, cu, cu, True, None, table, pool, pool, lens, max_seqlen_q=3)
    pa.paged_attention(q[:2], pool, pool, table, lens, num_splits=None, max_context=16)
    pa.paged_attention(q[:2], pool, pool, table, lens, num_splits=3)
    sk.store_kv(k[:2], k[:2], pool, pool, torch.tensor([5, 1000 if bad else 6]))
    gptq = _gptq(bad)
    dm.dequant_matmul(torch.randn(1, 256), **gptq)  # GEMV
    dm.dequant_matmul(torch.randn(32, 256), **gptq)  # GEMM
    dm.dequantize_int4(**gptq, dtype=torch.float16)


# ----------------------------------------------------------------------------- host syncs
def test_launchers_make_no_host_sync_on_a_gpu(gpu):
    with RecordSyncs() as rec:
        _launch_all()
    assert rec.calls == []
    assert all(fake.launches for fake in gpu.values())  # every kernel was reached
    grid, kwargs = gpu["_flash_attention_kernel"].launches[0]
    want = configs.FLASH[(90, 4, 64)]  # sm_90, fp32, head_dim 64
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]) == (
        *want.tiles,
        want.num_warps,
    )
    # max_seqlen_q = 3 queries: one tile per (sequence, head)
    assert not kwargs["UPCAST"] and grid == (1, 2 * 4)


def test_value_checks_are_skipped_on_a_gpu_and_run_with_debug_checks(gpu, monkeypatch):
    with RecordSyncs() as rec:
        # out-of-range values pass unseen: checking them would cost a sync per call
        _launch_all(bad=True)
    assert rec.calls == []
    monkeypatch.setattr(checks, "DEBUG_CHECKS", True)
    with RecordSyncs() as rec:
        _launch_all()
    assert rec.calls  # the checks ran, and read values
    q, k, cu, pool, table, lens = _attention_inputs(bad=True)
    cases = {
        "context_lens must be "
        "in": lambda: fa.flash_attention(q, k, k, cu, cu, True, None, table, pool, pool, lens,
                                                              max_seqlen_q=3),
        "max_seqlen_q=2 is shorter": lambda: fa.flash_attention(q, k, k, cu, cu, max_seqlen_q=2),
        "context_lens must "
        "lie": lambda: pa.paged_attention(q[:2], pool, pool, table, lens, num_splits=1),
        "block ids outside": lambda: pa.paged_attention(q[:2], pool, pool, table,
                                                        lens.clamp(max=16), num_splits=1),
        "max_context": lambda: pa.paged_attention(q[:2], pool, pool, table, lens.clamp(max=16),
                                                  max_context=15),
        "slot_mapping holds": lambda: sk.store_kv(k[:1], k[:1], pool, pool, torch.tensor([1000])),
        "g_idx must hold": lambda: dm.dequant_matmul(torch.randn(1, 256), **_gptq(bad=True)),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()


def test_without_host_bounds_the_launchers_read_them(gpu):
    """max_seqlen_q / max_context not given: the one documented sync each, to size the grid or the
    splits."""
    q, k, cu, pool, table, lens = _attention_inputs()
    for call in (lambda: fa.flash_attention(q, k, k, cu, cu),
                 lambda: pa.paged_attention(q[:2], pool, pool, table, lens, num_splits=None)):
        with RecordSyncs() as rec:
            call()
        assert rec.calls == ["__int__"]


def test_no_value_checks_during_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(checks, "DEBUG_CHECKS", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not checks.can_read_values(torch.zeros(1))


# ----------------------------------------------------------------------------- configs
def test_tiles_below_16_are_refused_on_a_gpu_only(gpu):
    q, k, cu, *_ = _attention_inputs()
    with pytest.raises(ValueError, match="≥ 16 on a GPU"):
        fa.flash_attention(q, k, k, cu, cu, block_m=8, max_seqlen_q=3)
    with pytest.raises(ValueError, match="power of two"):
        fa.flash_attention(q, k, k, cu, cu, block_n=48, max_seqlen_q=3)


def test_the_interpreter_keeps_small_tiles():
    q, k, cu, *_ = _attention_inputs()
    out = fa.flash_attention(q, k, k, cu, cu, block_m=8, block_n=4)  # total_q, H, D
    assert torch.allclose(out, fa.flash_attention_ref(q, k, k, cu, cu), atol=1e-4)


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
def test_every_engine_config_is_supported_from_sm80(arch, monkeypatch):
    monkeypatch.setattr(configs, "gpu_arch", lambda device: arch)
    for dtype in configs.DTYPES:
        for head_dim in (32, 64, 80, 96, 128, 256):
            assert triton_attention_supported(head_dim, dtype, "cuda") is None
            for kernel in ("flash", "decode"):
                launch = configs.pick(kernel, "cuda", dtype, head_dim)
                assert (
                    launch.gpu and min(launch.tiles) >= 16
                    and launch.smem_kb <= configs.smem_limit_kb(arch)
                )


def test_sm75_falls_back_to_torch_attention_and_upcasts_the_w4a16_kernels(monkeypatch):
    monkeypatch.setattr(configs, "gpu_arch", lambda device: 75)
    reason = triton_attention_supported(128, torch.float16, "cuda")
    assert reason.startswith("sm_75: Triton attention needs sm_80") and "\n" not in reason
    with pytest.raises(ValueError, match="sm_75"):
        configs.pick("flash", "cuda", torch.float16, 128)
    for kernel in ("gemm", "gemv", "dequantize"):
        assert configs.pick(kernel, "cuda", torch.bfloat16).upcast  # no bf16 arithmetic on sm_75


def test_unsupported_inputs_are_named():
    # the interpreter runs everything
    assert triton_attention_supported(128, torch.bfloat16, "cpu") is None
    assert "head_dim 1 .. 256, got 512" in triton_attention_supported(512, torch.float16, "cpu")
    assert "not torch.float64" in triton_attention_supported(64, torch.float64, "cpu")


def test_a_row_over_the_gpus_shared_memory_is_refused(monkeypatch):
    """The guard behind the tables: a GPU with less shared memory than a row needs gets a reason,
    not a launch failure."""
    monkeypatch.setattr(configs, "gpu_arch", lambda device: 86)
    monkeypatch.setitem(configs.SMEM_LIMIT_KB, 86, 40)
    assert triton_attention_supported(128, torch.float16, "cuda") == (
        "head_dim 128 in float16 needs 48 KB of shared memory per block (flash) on sm_86 (limit "
        "40 KB)")
    with pytest.raises(ValueError, match="needs 58 KB of shared memory"):
        configs.pick("gemv_gather", "cuda", torch.float16)


def test_families_and_padded_head_dims():
    assert [configs.family(a) for a in (75, 80, 86, 89, 90, 100, 120)] == [75, 80, 80, 80, 90, 80, 80]
    assert [configs.padded_head_dim(d) for d in (1, 64, 65, 80, 128, 129, 256)] == [64, 64, 128, 128, 128, 256, 256]
    assert configs.smem_limit_kb(121) == configs.DEFAULT_SMEM_LIMIT_KB
    # choose_split_k counts the tiles of the GEMV launch it is given; without one, the sm_80+ 16-bit
    # row's
    assert dm._GEMV_TILES[True] == configs.DEQUANT[("gemv", 80, 2)].tiles
