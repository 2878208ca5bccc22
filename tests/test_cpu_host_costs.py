"""The single-stream step's cheaper paths agree with the plain ones (issue 20, "Fifth step"): the
attention metadata derived from Python lists against the same values derived with tensor ops, the
C-array host tensors against torch.tensor, MKL for up to 3 rows against oneDNN, and the LM head's
decode shortcut against indexing. Each with a control that shows the comparison can fail.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kv import metadata as md
from nanoserve.models import build_model, onednn
from nanoserve.models.config import gpt2_config
from nanoserve.models.onednn import OneDNNLinear, onednn_linear, onednn_unavailable


def metadata_by_tensor_ops(slot_mapping, context_lens, block_size):
    """The derived values written as tensor ops (how metadata.build computed them before the host lists)."""
    flat = slot_mapping.flatten()
    src = (flat >= 0).nonzero().squeeze(1)
    dst = flat[src]
    num_new = (slot_mapping >= 0).sum(1)
    cu = torch.zeros(len(num_new) + 1, dtype=torch.int32)
    cu[1:] = num_new.cumsum(0)
    B, T = slot_mapping.shape
    return dict(src=src, dst=dst, fresh_blocks=dst[dst % block_size == 0] // block_size, cu_seqlens=cu,
                prefix_lens=(context_lens - num_new).to(torch.int32),
                max_context=int(context_lens.max()) if B else 1, decode=T == 1 and len(src) == B,
                max_query_len=int(num_new.max()) if B else 1, no_prefix=bool((context_lens == num_new).all()))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("B,T", [(0, 1), (1, 1), (5, 1), (3, 6), (7, 4)])
def test_metadata_from_host_lists_equals_tensor_ops(B, T, seed):
    rng, bs = random.Random(seed), 4
    rows, lens = [], []
    for b in range(B):  # n real tokens after `start` cached ones, then −1 padding (a padding row: n = 0)
        n, start = 0 if b == 2 else rng.randint(1, T), rng.choice([0, 0, rng.randint(1, 30)])
        rows.append([100 + start + j for j in range(n)] + [-1] * (T - n))
        lens.append(start + n)
    slot_mapping, context_lens = torch.tensor(rows, dtype=torch.long).view(B, T), torch.tensor(lens, dtype=torch.long)
    tables = torch.zeros(B, 3, dtype=torch.long)
    meta = md.AttentionMetadata.build(slot_mapping, tables, context_lens, bs)
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
        other = md.AttentionMetadata.build(slot_mapping, tables, context_lens + 1, bs)
        assert not torch.equal(other.prefix_lens, want["prefix_lens"])


def test_host_tensor_equals_torch_tensor():
    for values, shape, dtype in (([3, -1, 2**40], None, torch.long), ([3, -1, 7], None, torch.int32),
                                 (list(range(12)), (3, 4), torch.long), (list(range(12)), (4, 3), torch.int32),
                                 ([], (2, 0), torch.long), ([], None, torch.int32)):
        want = torch.tensor(values, dtype=dtype)
        got = md.host_tensor(iter(values), shape, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, want if shape is None else want.view(shape))
    with pytest.raises(OverflowError):  # an id int32 cannot hold is refused, not wrapped
        md.host_tensor([2**40], dtype=torch.int32)


def test_the_block_id_check_takes_its_shortcut_only_when_every_entry_is_in_range():
    """check_block_ids: all entries in range → one reduction and done; else only the entries a row reads count."""
    from nanoserve.kernels.checks import check_block_ids

    lens = torch.tensor([5, 2])  # block size 4: row 0 reads 2 blocks, row 1 reads 1
    check_block_ids(torch.tensor([[0, 1, 2], [3, 0, 0]]), lens, 4, 4)  # every entry in range
    check_block_ids(torch.tensor([[0, 1, 99], [3, -1, 7]]), lens, 4, 4)  # out of range, but never read
    for bad in ([[0, 9, 2], [3, 0, 0]], [[0, 1, 2], [-1, 0, 0]]):  # a read entry out of range (control)
        with pytest.raises(ValueError, match=r"outside 0 \.\. 3 within context_lens"):
            check_block_ids(torch.tensor(bad), lens, 4, 4)


needs_onednn = pytest.mark.skipif(onednn_unavailable(torch.device("cpu"), torch.float32) is not None,
                                  reason="no oneDNN linear op in this torch build")


@needs_onednn
def test_a_few_rows_take_mkl_below_the_size_limit(monkeypatch):
    g = torch.Generator().manual_seed(5)
    lin = OneDNNLinear.from_linear(nn.Linear(96, 300))
    half = OneDNNLinear.from_linear(nn.Linear(96, 300).bfloat16())  # no bf16 GEMV in MKL: oneDNN
    with torch.inference_mode():
        for shape in ((1, 96), (1, 1, 96), (3, 96), (1, 3, 96), (4, 96), (2, 2, 96)):  # ≤ 3 rows: MKL
            x = torch.randn(*shape, generator=g)
            by_mkl, by_onednn = F.linear(x, lin.weight, lin.bias), onednn_linear(x, lin.packed_weight(), lin.bias)
            assert not torch.equal(by_mkl, by_onednn)  # the two libraries round differently: the check can tell
            few = x.numel() <= 3 * 96
            assert torch.equal(lin(x), by_mkl if few else by_onednn)
            assert torch.equal(lin.forward_gelu(x, "gelu_new"), F.gelu(by_mkl, approximate="tanh")) == few
        x = torch.randn(1, 96, generator=g)
        monkeypatch.setattr(onednn, "GEMV_MAX_BYTES", 96 * 300 * 4)  # the weight is not under the limit: oneDNN
        assert torch.equal(lin(x), onednn_linear(x, lin.packed_weight(), lin.bias))
        monkeypatch.undo()
        xb = x.bfloat16()
        assert torch.equal(half(xb), onednn_linear(xb, half.packed_weight(), half.bias))


def test_the_heads_decode_shortcut_equals_indexing():
    """One position per row: the logits are h's, whatever logit_index's form, as indexing gives them."""
    torch.manual_seed(0)
    model = build_model(gpt2_config("gpt2", n_layers=1, hidden_size=32, n_heads=2, vocab_size=50)).eval()
    h = torch.randn(3, 1, 32)
    with torch.inference_mode():
        want = model.lm_logits(h)  # B, 1, V
        for index in (torch.zeros(3, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long)):
            assert torch.equal(model.head(h, index), want)
        # control: with two positions the index picks one (here the first), not h's last
        h2 = torch.randn(3, 2, 32)
        got = model.head(h2, torch.zeros(3, dtype=torch.long))
        assert torch.equal(got, model.lm_logits(h2[:, :1])) and not torch.equal(got, model.lm_logits(h2[:, 1:]))
