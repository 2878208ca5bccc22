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
