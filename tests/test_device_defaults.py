"""Device-aware defaults (issue 18): the dtype a GPU can compute in, and the attention backend whose
kernels serve the model's shape there, with a clear error or a one-line reason otherwise. No GPU
here, so the device's answers are substituted (the functions that ask it are the seams)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.errors import NanoserveError
from nanoserve.models import loader
from nanoserve.models.loader import resolve_dtype

CUDA = torch.device("cuda")


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_default_dtype_on_a_gpu_is_bf16_only_where_it_has_it(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(loader, "_cuda_has_bf16", lambda device: has_bf16)
    assert resolve_dtype(None, CUDA) == expected
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32


def test_bf16_on_a_gpu_without_it_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(loader, "_cuda_has_bf16", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    for dtype in ("bf16", "bfloat16", torch.bfloat16):
        with pytest.raises(NanoserveError, match="bfloat16 is not supported natively by Tesla T4"):
            resolve_dtype(dtype, CUDA)
    assert resolve_dtype("float16", CUDA) == torch.float16


def test_the_triton_backend_falls_back_to_torch_where_its_kernels_cannot_serve(monkeypatch, caplog):
    import nanoserve.kernels as kernels

    from nanoserve.kv.cache import resolve_attention_backend

    reason = "sm_75: Triton attention needs sm_80 or newer"
    monkeypatch.setattr(kernels, "triton_attention_supported", lambda head_dim, dtype,
                        device: reason)
    with caplog.at_level("WARNING", logger="nanoserve"):
        assert resolve_attention_backend(None, CUDA, 64, torch.float16) == "torch"
    assert reason in caplog.text
    with pytest.raises(NanoserveError, match="cannot serve this model here: sm_75"):
        resolve_attention_backend("triton", CUDA, 64, torch.float16)
    assert resolve_attention_backend("torch", CUDA, 64, torch.float16) == "torch"
    monkeypatch.setattr(kernels, "triton_attention_supported", lambda head_dim, dtype, device: None)
    assert resolve_attention_backend(None, CUDA, 64, torch.float16) == "triton"
    # (the CPU's own: test_cpu_attention)
    assert resolve_attention_backend(None, "cpu", 64, torch.bfloat16) == "torch"


def test_the_kernels_name_what_they_cannot_serve():
    """The real table, asked about GPUs this machine does not have (no tensor is read)."""
    from nanoserve.kernels import configs, triton_attention_supported

    assert triton_attention_supported(64, torch.float32, "cpu") is None
    assert "sm_75" in configs.attention_problem(75, torch.float16, 64)
    assert configs.attention_problem(90, torch.bfloat16, 128) is None
    assert configs.attention_problem(80, torch.float16, 512) is not None  # head_dim beyond 256
