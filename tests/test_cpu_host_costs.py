"""The single-stream step's cheaper paths agree with the plain ones (issue 20, "Fifth step"): the
attention metadata derived from Python lists against the same values derived with tensor ops, the
C-array host tensors against torch.tensor, the few-rows route to MKL (which library each shape
takes, each within fp32's rounding bound), and the LM head's
decode shortcut against indexing. Each with a control that shows the comparison can fail.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kv import metadata as md
from nanoserve.kv.torch_backend import CacheView
from nanoserve.kv.triton_backend import TritonCacheView
from nanoserve.models import build_model, onednn
from nanoserve.models.config import gpt2_config
from nanoserve.models.onednn import OneDNNLinear, onednn_unavailable


def metadata_by_tensor_ops(slot_mapping, context_lens, block_size):
    """The derived values written as tensor ops (how metadata.build computed them before the host
    lists)."""
    flat = slot_mapping.flatten()
    src = (flat >= 0).nonzero().squeeze(1)
    dst = flat[src]
    num_new = (slot_mapping >= 0).sum(1)
    cu = torch.zeros(len(num_new) + 1, dtype=torch.int32)
    cu[1:] = num_new.cumsum(0)
    B, T = slot_mapping.shape
    return dict(src=src, dst=dst, fresh_blocks=dst[dst % block_size == 0] // block_size,
                cu_seqlens=cu,
                prefix_lens=(context_lens - num_new).to(torch.int32),
                max_context=int(context_lens.max()) if B else 1, decode=T == 1 and len(src) == B,
                max_query_len=int(num_new.max()) if B else 1,
                no_prefix=bool((context_lens == num_new).all()))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("B,T", [(0, 1), (1, 1), (5, 1), (3, 6), (7, 4)])
def test_metadata_from_host_lists_equals_tensor_ops(B, T, seed):
    rng, bs = random.Random(seed), 4
    rows, lens = [], []
    # n real tokens after `start` cached ones, then −1 padding (a padding row: n = 0)
    for b in range(B):
        n, start = 0 if b == 2 else rng.randint(1, T), rng.choice([0, 0, rng.randint(1, 30)])
        rows.append([100 + start + j for j in range(n)] + [-1] * (T - n))
        lens.append(start + n)
    slot_mapping = torch.tensor(rows, dtype=torch.long).view(B, T)
    context_lens = torch.tensor(lens, dtype=torch.long)
    tables = torch.zeros(B, 3, dtype=torch.long)
    meta = build_both(slot_mapping, tables, context_lens, bs)
    want = metadata_by_tensor_ops(slot_mapping, context_lens, bs)
    for name, value in want.items():
        got = getattr(meta, name)
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value), name
        else:
            assert got == value, name
    assert [(r.tolist(), n) for r, n in meta.buckets] == [(r.tolist(), n) for r, n in
                                                          md.length_buckets(context_lens, bs)]
    # control: a step with one more cached token per row changes what the comparison reads
    if B:
        other = build_both(slot_mapping, tables, context_lens + 1, bs)
        assert not torch.equal(other.prefix_lens, want["prefix_lens"])


def build_both(slot_mapping, tables, context_lens, bs) -> SimpleNamespace:
    """The torch and the Triton backends' metadata of one step, their fields side by side."""
    common = md.CommonAttentionMetadata.build(slot_mapping, tables, context_lens)
    cache = SimpleNamespace(block_size=bs)
    torch_meta = CacheView.build_metadata(cache, common)
    triton_meta = TritonCacheView.build_metadata(cache, common)
    return SimpleNamespace(**vars(triton_meta), **{name: value for name, value in
                                                   vars(torch_meta).items()
                                                   if name not in vars(triton_meta)})


def test_host_tensor_equals_torch_tensor():
    for values, shape, dtype in (([3, -1, 2**40], None, torch.long),
                                 ([3, -1, 7], None, torch.int32),
                                 (list(range(12)), (3, 4), torch.long),
                                 (list(range(12)), (4, 3), torch.int32),
                                 ([], (2, 0), torch.long), ([], None, torch.int32)):
        want = torch.tensor(values, dtype=dtype)
        got = md.host_tensor(iter(values), shape, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, want if shape is None else want.view(shape))
    with pytest.raises(OverflowError):  # an id int32 cannot hold is refused, not wrapped
        md.host_tensor([2**40], dtype=torch.int32)


def test_the_block_id_check_takes_its_shortcut_only_when_every_entry_is_in_range():
    """check_block_ids: all entries in range → one reduction and done; else only the entries a row
    reads count."""
    from nanoserve.kernels.checks import check_block_ids

    lens = torch.tensor([5, 2])  # block size 4: row 0 reads 2 blocks, row 1 reads 1
    check_block_ids(torch.tensor([[0, 1, 2], [3, 0, 0]]), lens, 4, 4)  # every entry in range
    # out of range, but never read
    check_block_ids(torch.tensor([[0, 1, 99], [3, -1, 7]]), lens, 4, 4)
    # a read entry out of range (control)
    for bad in ([[0, 9, 2], [3, 0, 0]], [[0, 1, 2], [-1, 0, 0]]):
        with pytest.raises(ValueError, match=r"outside 0 \.\. 3 within context_lens"):
            check_block_ids(torch.tensor(bad), lens, 4, 4)


needs_onednn = pytest.mark.skipif(onednn_unavailable(torch.device("cpu"),
                                                     torch.float32) is not None,
                                  reason="no oneDNN linear op in this torch build")


def fp32_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The worst-case rounding error of an fp32 dot product of length K plus a bias, in any
    summation order and on any processor: γ_(K+1) · (|x| @ |W|ᵀ + |b|), γ_n = n·u / (1 − n·u), u =
    2⁻²⁴ (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1). Exact in float64 for the
    sizes used here."""
    n = x.shape[-1] + 1
    u = 2.0**-24
    gamma = n * u / (1 - n * u)
    return gamma * (x.double().abs() @ weight.double().abs().t() + bias.double().abs())


def record_calls(monkeypatch, module, names: tuple[str, ...]) -> list[str]:
    """Wrap module.<name> for each name so that every call appends its name to the returned list."""
    calls: list[str] = []
    for name in names:
        original = getattr(module, name)

        def wrapper(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(module, name, wrapper)
    return calls


ROUTES = ("blas_linear", "onednn_linear", "onednn_linear_gelu")


def test_the_few_rows_rule_is_the_vendors():
    """MKL takes a few rows on Intel processors only (measured on a Xeon and an EPYC:
    RESULTS.md)."""
    assert onednn.gemv_max_rows("GenuineIntel") == 3
    assert onednn.gemv_max_rows("AuthenticAMD") == onednn.gemv_max_rows("") == 0
    assert onednn.GEMV_MAX_ROWS == onednn.gemv_max_rows(onednn.cpu_vendor())
    lscpu = subprocess.run(["lscpu"], capture_output=True,
                           text=True) if shutil.which("lscpu") else None
    if lscpu is not None and "Vendor ID:" in lscpu.stdout:  # another reader of the same fact
        assert f"Vendor ID: {onednn.cpu_vendor()}" in " ".join(lscpu.stdout.split())


@needs_onednn
# the Intel rule and everyone else's, on whatever runs the test
@pytest.mark.parametrize("rule", [3, 0])
@pytest.mark.parametrize("shape",
                         [(1, 96), (1, 1, 96), (3, 96), (1, 3, 96), (4, 96), (2, 2, 96), (0, 96)])
def test_a_few_rows_take_blas_below_the_size_limit(shape, rule, monkeypatch):
    """The routing rule, observed at the two libraries' entry points: a float32 weight under
    GEMV_MAX_BYTES sends ≤ GEMV_MAX_ROWS rows to torch's BLAS (MKL), more to oneDNN; the fused GELU
    follows the same rule. Each path's result is within the fp32 rounding bound of a float64
    reference (a bound, not bitwise equality: which library rounds how depends on the processor)."""
    g = torch.Generator().manual_seed(5)
    lin = OneDNNLinear.from_linear(nn.Linear(96, 300))
    monkeypatch.setattr(onednn, "GEMV_MAX_ROWS", rule)
    calls = record_calls(monkeypatch, onednn, ROUTES)
    x = torch.randn(*shape, generator=g)
    few = x.numel() <= rule * 96  # (an empty input too: either library gives it back empty)
    with torch.inference_mode():
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        bound = fp32_error_bound(x, lin.weight, lin.bias)
        y = lin(x)
        assert calls == ["blas_linear" if few else "onednn_linear"]
        assert y.shape == ref.shape and ((y.double() - ref).abs() <= bound).all()
        calls.clear()
        g_fused = lin.forward_gelu(x, "gelu_new")
        assert calls == ["blas_linear" if few else "onednn_linear_gelu"]
        # GELU's slope is at most 1.13: the linear's bound carries over, plus a few ulps of GELU
        # itself
        g_ref = F.gelu(ref, approximate="tanh")
        assert ((g_fused.double() - g_ref).abs() <= 1.13 * bound + 1e-6 * (1 + g_ref.abs())).all()
        # control: an input rounded to bf16 (a wrong dtype on either path) is outside the bound
        if x.numel():
            rounded = F.linear(x.bfloat16().float(), lin.weight, lin.bias)
            assert ((rounded.double() - ref).abs() > bound).any()


@needs_onednn
def test_blas_is_not_taken_for_bf16_big_weights_or_autograd(monkeypatch):
    """Outside the rule every call goes to oneDNN (bf16: MKL has no bf16 GEMV; a weight over the
    size limit), and a forward that needs gradients takes F.linear, which neither wrapper sees."""
    g = torch.Generator().manual_seed(6)
    lin = OneDNNLinear.from_linear(nn.Linear(96, 300))
    half = OneDNNLinear.from_linear(nn.Linear(96, 300).bfloat16())
    calls = record_calls(monkeypatch, onednn, ROUTES)
    x = torch.randn(1, 96, generator=g)
    with torch.inference_mode():
        y = half(x.bfloat16())
        assert calls == ["onednn_linear"]
        ref = x.bfloat16().double() @ half.weight.double().t() + half.bias.double()
        # fp32 accumulation, then one rounding to bf16 (8 bits of mantissa): relative 2⁻⁸
        bound = fp32_error_bound(x, half.weight, half.bias) + ref.abs() * 2.0**-8
        assert ((y.double() - ref).abs() <= bound).all()
        calls.clear()
        monkeypatch.setattr(onednn, "GEMV_MAX_BYTES", 96 * 300 * 4)  # the weight is not under it
        lin(x)
        assert calls == ["onednn_linear"]
    calls.clear()
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()
    assert calls == [] and xg.grad is not None
    # control: the wrappers do see the BLAS route when the rule takes it
    monkeypatch.setattr(onednn, "GEMV_MAX_BYTES", 32 << 20)
    monkeypatch.setattr(onednn, "GEMV_MAX_ROWS", 3)
    with torch.inference_mode():
        lin(x)
    assert calls == ["blas_linear"]


def test_the_heads_decode_shortcut_equals_indexing():
    """One position per row: the logits are h's, whatever logit_index's form, as indexing gives
    them."""
    torch.manual_seed(0)
    model = build_model(gpt2_config("gpt2", n_layers=1, hidden_size=32, n_heads=2,
                                    vocab_size=50)).eval()
    h = torch.randn(3, 1, 32)
    with torch.inference_mode():
        want = model.lm_logits(h)  # B, 1, V
        for index in (torch.zeros(3, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long)):
            assert torch.equal(model.head(h, index), want)
        # control: with two positions the index picks one (here the first), not h's last
        h2 = torch.randn(3, 2, 32)
        got = model.head(h2, torch.zeros(3, dtype=torch.long))
        assert torch.equal(got, model.lm_logits(h2[:, :1])) and not torch.equal(
            got, model.lm_logits(h2[:, 1:])
        )
