"""RMSNorm in one Triton kernel (kernels/rms_norm.py) against layers.RMSNorm, its plain-torch
reference, in the interpreter: Llama's convention (round, then scale in the weight's dtype) and
Gemma's and OLMo 2's (scale in float32, Gemma's weight offset by 1), fp32 / fp16 / bf16, rows whose
width is not a power of two, a 4-d input (Qwen3's per-head q/k norms), a non-contiguous one.
Controls: the other convention, and a wrong eps, miss. Then add_rms_norm, the residual add folded
into the same launch: its new residual equals torch's `x + r` (fp32, fp16; bf16 within the
interpreter's one truncated ulp) and its norm is the module's norm of that rounded sum, in every
convention and dtype; controls: the norm without the add, and a wrong eps, miss; mismatched
residuals are refused. Then the engine: the triton backend swaps its norms in (one launch each) and
generates what the torch backend does."""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.rms_norm import add_rms_norm, rms_norm

from nanoserve.models.layers import RMSNorm

# float32: the sum's order differs (a few ulps). fp16: equal here. bf16: one unit in the last
# place for each conversion to bfloat16 (Llama's convention converts twice), because Triton's
# interpreter converts by truncation (a GPU rounds to nearest, as torch does):
# test_the_interpreter_truncates_to_bfloat16 shows it
TOL = {torch.float32: 2e-6, torch.float16: torch.finfo(torch.float16).eps,
       torch.bfloat16: torch.finfo(torch.bfloat16).eps}


def _norm(n, dtype, unit_offset=False, scale_fp32=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = RMSNorm(n, 1e-5, unit_offset, scale_fp32)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, generator=g) * 0.5 + (0.0 if unit_offset else 1.0))
    return ref.to(dtype)


def _err(a, b):
    """The largest difference relative to the reference's magnitude (1 for values below 1)."""
    return ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1)).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset,scale_fp32", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("n", [64, 96, 257])
def test_kernel_equals_the_torch_module(dtype, unit_offset, scale_fp32, n):
    ref = _norm(n, dtype, unit_offset, scale_fp32)
    x = (torch.randn(5, 3, n, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        want = ref(x)
    got = rms_norm(x, ref.weight, ref.eps, ref.unit_offset, ref.scale_fp32)
    assert got.dtype == want.dtype and got.shape == want.shape
    conversions = 1 if ref.scale_fp32 or dtype != torch.bfloat16 else 2
    assert _err(got, want) <= conversions * TOL[dtype]
    # controls: another eps; Gemma's weight without its + 1
    other = rms_norm(x, ref.weight, ref.eps + 10.0, ref.unit_offset, ref.scale_fp32)
    assert _err(other, want) > 10 * TOL[dtype]
    if unit_offset:
        plain = rms_norm(x, ref.weight, ref.eps)  # the weight without its + 1
        assert _err(plain, want) > 10 * TOL[dtype]


def test_the_interpreter_truncates_to_bfloat16():
    """Why bf16 is held to one ulp and not to equality: on the CPU the kernel's last conversion
    truncates. The kernel's bf16 outputs that differ from torch's all lie toward zero."""
    ref = _norm(257, torch.bfloat16, True, True)
    x = (torch.randn(5, 3, 257, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    with torch.no_grad():
        want = ref(x).float()
    got = rms_norm(x, ref.weight, ref.eps, ref.unit_offset, ref.scale_fp32).float()
    differ = got != want
    assert differ.any() and (got.abs()[differ] < want.abs()[differ]).all()


def test_per_head_and_non_contiguous_inputs():
    ref = _norm(16, torch.float32)
    x = torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(2))  # B, T, H, D
    strided = x.transpose(1, 2)  # not contiguous
    for inp in (x, strided):
        with torch.no_grad():
            want = ref(inp)
        assert _err(rms_norm(inp, ref.weight, ref.eps), want) <= TOL[torch.float32]


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)


def _rel_ulps(a, b):
    """The largest |a − b| in units of b's relative precision (eps of b's dtype; below the smallest
    normal number, its spacing)."""
    info = torch.finfo(b.dtype)
    scale = b.float().abs().clamp(min=info.tiny)
    return ((a.float() - b.float()).abs() / scale).max().item() / info.eps


def _pair(shape, dtype, seed=1):
    """x and a residual of the same shape, both about as large as a hidden state (σ = 3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    residual = torch.randn(shape, generator=g) * 3
    return x.to(dtype), residual.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset,scale_fp32", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("n", [64, 96, 257])
def test_add_rms_norm_equals_the_add_then_the_torch_module(dtype, unit_offset, scale_fp32, n):
    ref = _norm(n, dtype, unit_offset, scale_fp32)
    x, r = _pair((5, 3, n), dtype)
    x0, r0 = x.clone(), r.clone()
    s = x + r  # what the pre-norm block computes: its output added to the residual stream
    with torch.no_grad():
        want = ref(s)
    got, new_residual = add_rms_norm(x, r, ref.weight, ref.eps, ref.unit_offset, ref.scale_fp32)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # the inputs are left as they were
    for out in (got, new_residual):
        assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16:  # the interpreter truncates the sum: one ulp, toward zero
        assert _rel_ulps(new_residual, s) <= 1
        differ = new_residual != s
        assert (new_residual.float().abs()[differ] < s.float().abs()[differ]).all()
    else:
        assert torch.equal(new_residual, s)
    # the norm is the module's, of the sum the kernel wrote (its bf16 conversions: as rms_norm's)
    conversions = 1 if ref.scale_fp32 or dtype != torch.bfloat16 else 2
    with torch.no_grad():
        assert _err(got, ref(new_residual)) <= conversions * TOL[dtype]
    # and of torch's sum: in bf16 the sum's truncated ulp is one conversion more
    extra = 1 if dtype == torch.bfloat16 else 0
    assert _err(got, want) <= (conversions + extra) * TOL[dtype]
    # controls: the norm without the residual added; another eps
    unadded = rms_norm(x, ref.weight, ref.eps, ref.unit_offset, ref.scale_fp32)
    assert _err(unadded, want) > 10 * TOL[dtype]
    other, _ = add_rms_norm(x, r, ref.weight, ref.eps + 10.0, ref.unit_offset, ref.scale_fp32)
    assert _err(other, want) > 10 * TOL[dtype]


def test_add_rms_norm_takes_strided_inputs():
    """x with its rows apart in memory (Qwen3's per-head shape, transposed), the residual not."""
    ref = _norm(16, torch.float32)
    x, r = _pair((2, 5, 4, 16), torch.float32, seed=2)  # B, T, H, D
    strided = x.transpose(1, 2)  # B, H, T, D, not contiguous
    got, new_residual = add_rms_norm(strided, r.transpose(1, 2).contiguous(), ref.weight, ref.eps)
    s = strided + r.transpose(1, 2)
    with torch.no_grad():
        assert _err(got, ref(s)) <= TOL[torch.float32]
    assert torch.equal(new_residual, s)


def test_add_rms_norm_refuses_a_residual_unlike_x():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, torch.randn(2, 4), w, 1e-6)
    with pytest.raises(ValueError, match="residual must have x's dtype and device"):
        add_rms_norm(x, torch.randn(2, 8).half(), w, 1e-6)
    with pytest.raises(ValueError, match="residual must have x's dtype and device"):
        add_rms_norm(x, torch.empty(2, 8, device="meta"), w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(x, x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        add_rms_norm(x.double(), x.double(), torch.ones(8, dtype=torch.float64), 1e-6)


def test_the_triton_backend_runs_its_norms_as_one_kernel_each(tmp_path):
    from nanoserve import LLM, SamplingParams
    from nanoserve.models.triton_layers import TritonRMSNorm
    from nanoserve.tools.launch_count import llama_shape, random_checkpoint

    path = random_checkpoint(tmp_path / "llama", llama_shape(2))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(path), dtype="float32", device="cpu", attention_backend=backend)
        norms = [m for m in llm.model.modules() if isinstance(m, RMSNorm)]
        fused = [m for m in norms if isinstance(m, TritonRMSNorm)]
        assert len(fused) == (len(norms) if backend == "triton" else 0) and len(norms) == 5
        outs[backend] = llm.generate([list(range(40, 60))], params, use_tqdm=False)[0]
    assert outs["triton"].outputs[0].token_ids == outs["torch"].outputs[0].token_ids
