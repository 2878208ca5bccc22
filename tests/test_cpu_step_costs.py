"""The CPU step's fast paths agree with their plain versions (issue 20): the torch backend's
length buckets and gather workspace against attention written out per row, and the oneDNN linear
layers against a float64 reference beside F.linear's own error. Each with a negative control.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kv import PagedKVCache
from nanoserve.kv import metadata as md
from nanoserve.models.config import gpt2_config
from nanoserve.models.layers import naive_attention
from nanoserve.models.onednn import OneDNNLinear, onednn_unavailable, use_onednn_linears

BS = 4


@pytest.mark.parametrize("per_doubling", [1, 2, 4, 16])
def test_bucket_ladder(per_doubling):
    sizes = [md.bucket_size(n, per_doubling) for n in range(1, 300)]
    assert sizes == sorted(sizes)  # monotone: a longer row never gets a smaller bucket
    for n, b in zip(range(1, 300), sizes):
        assert b >= n
        assert b == n if n <= per_doubling else (b - n) / b < 1 / per_doubling, (n, b)
    if per_doubling == 1:
        assert all(b & (b - 1) == 0 for b in sizes)  # powers of two


def _decode_case(lens, num_blocks=128, H=2, D=8, seed=0):
    """A pool holding rows of `lens` tokens (the last one written this step), their keys also kept
    in logical order by the test itself: (cache, view inputs, q, new k/v, per-row logical K/V)."""
    g = torch.Generator().manual_seed(seed)
    cfg = gpt2_config("gpt2", n_layers=1, hidden_size=H * D, n_heads=H, vocab_size=16)
    cache = PagedKVCache(cfg, num_blocks, BS)
    cache.k.fill_(float("nan"))  # stale memory: must never reach a result
    cache.v.fill_(float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, logical = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
        for j in range(n - 1):  # the cached tokens; the last one arrives with the step
            cache.k[0, table[j // BS], j % BS], cache.v[0, table[j // BS], j % BS] = k[j], v[j]
        # its first slot is this step's token: the view zeroes the fresh block
        if (n - 1) % BS == 0:
            cache.k[0, table[-1]] = cache.v[0, table[-1]] = 0
        else:  # unused slots of a partly filled block hold zeros (written at its first token)
            cache.k[0, table[-1], (n - 1) % BS:] = cache.v[0, table[-1], (n - 1) % BS:] = 0
        tables.append(table)
        logical.append((k, v))
    M = max(map(len, tables))
    block_tables = torch.tensor([t + [t[0]] * (M - len(t)) for t in tables])
    # B, 1
    slot = torch.tensor([[t[(n - 1) // BS] * BS + (n - 1) % BS] for t, n in zip(tables, lens)])
    q = torch.randn(len(lens), 1, H, D, generator=g)
    k_new = torch.stack([k[-1:] for k, _ in logical])  # B, 1, H, D
    v_new = torch.stack([v[-1:] for _, v in logical])
    return cache, (slot, block_tables, torch.tensor(lens)), q, k_new, v_new, logical


@pytest.mark.parametrize("per_doubling", [1, 4, 16])
def test_bucketed_attention_equals_attention_per_row(monkeypatch, per_doubling):
    lens = [1, 3, 4, 5, 9, 16, 17, 30, 33, 47, 64, 2, 12]  # many block counts: many buckets
    monkeypatch.setattr(md.length_buckets, "__defaults__", (per_doubling,))
    cache, view_args, q, k_new, v_new, logical = _decode_case(lens)
    view = cache.view(*view_args)
    assert len(view.meta.buckets) > 1
    pos = torch.tensor(lens)[:, None] - 1  # B, 1
    for _ in range(2):  # twice: the second call reuses (and must overwrite) the gather workspace
        out = view.attention(0, q, k_new, v_new, pos)  # B, 1, H, D
    for i, (k, v) in enumerate(logical):
        ref = naive_attention(q[i:i + 1], k[None], v[None], pos[i:i + 1])
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
    # negative control: a bucket one block short drops each of its rows' last block
    short = [(rows, n - 1) for rows, n in view.meta.buckets if n > 1]
    meta = dataclasses.replace(view.meta,
                               buckets=short + [(rows,
                                                 n) for rows, n in view.meta.buckets if n == 1])
    bad = cache.bind(meta).attention(0, q, k_new, v_new, pos)
    assert not torch.allclose(bad, out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_prefills_from_scratch_attend_without_the_gather(monkeypatch, window):
    """Rows with nothing cached attend over their own new k, v (no gather from the pool): the same
    as the gathered path and as attention written out per row, right-padded rows of several
    lengths."""
    H, D, lens = 2, 8, [7, 3, 5, 1]
    g = torch.Generator().manual_seed(4)
    cache = PagedKVCache(gpt2_config("gpt2", n_layers=1, hidden_size=H * D, n_heads=H,
                                     vocab_size=16), 64, BS)
    B, T, start = len(lens), max(lens), 0
    tables, slots = [], []
    for n in lens:
        table = list(range(start, start + -(-n // BS)))
        start += len(table)
        tables.append(table + [table[0]] * (-(-T // BS) - len(table)))
        slots.append([table[j // BS] * BS + j % BS for j in range(n)] + [-1] * (T - n))
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    pos = torch.tensor([list(range(n)) + [n - 1] * (T - n) for n in lens])  # B, T
    view = cache.view(torch.tensor(slots), torch.tensor(tables), torch.tensor(lens))
    assert view.meta.no_prefix
    gathered = cache.bind(dataclasses.replace(view.meta, no_prefix=False))
    with monkeypatch.context() as m:  # the fast path must not gather
        m.setattr(cache, "gather_buffers", lambda *a: pytest.fail("gathered"))
        out = view.attention(0, q, k, v, pos, window)
    ref = gathered.attention(0, q, k, v, pos, window)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i, :n], ref[i, :n], rtol=1e-5, atol=1e-5)
        want = naive_attention(
            q[i : i + 1, :n], k[i : i + 1, :n], v[i : i + 1, :n], pos[i : i + 1, :n], window
        )
        torch.testing.assert_close(out[i:i + 1, :n], want, rtol=1e-5, atol=1e-5)
    # control: one row with a token cached before this step is not a prefill from scratch
    assert not cache.view(torch.tensor(slots), torch.tensor(tables),
                          torch.tensor(lens) + torch.tensor(
        [0, 0, 1, 0])).meta.no_prefix


def test_gather_workspace_is_reused_and_grown():
    cache, view_args, q, k_new, v_new, _ = _decode_case([5, 9, 17])
    a, _ = cache.gather_buffers(3)
    b, _ = cache.gather_buffers(2)
    assert a.data_ptr() == b.data_ptr() and a.shape[0] >= 3  # reused
    c, _ = cache.gather_buffers(a.shape[0] + 1)
    assert c.shape[0] >= a.shape[0] + 1  # grown


needs_onednn = pytest.mark.skipif(onednn_unavailable(torch.device("cpu"),
                                                     torch.float32) is not None,
                                  reason="no oneDNN linear op in this torch build")


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (3, 5, 48), (2, 0, 48)])
def test_onednn_linear_is_fp32_exact(shape):
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(48, 300)
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        plain, fast = lin(x), OneDNNLinear.from_linear(lin)(x)
    assert fast.shape == plain.shape and fast.dtype == torch.float32
    if x.numel():
        err_plain, err_fast = ((t.double() - ref).abs().max().item() for t in (plain, fast))
        assert err_fast <= max(4 * err_plain, 1e-5)  # as close to float64 as MKL's fp32 GEMM
        # negative control: the same check catches an input rounded to bf16
        assert (lin(x.bfloat16().float()).double() - ref).abs().max().item() > max(
            4 * err_plain, 1e-5
        )


@needs_onednn
def test_the_packed_weight_follows_in_place_changes():
    """The layer computes with a prepacked copy of its weight: a copy_ into the weight (a LoRA
    merge, a quantizer's dequantized weights) must reach the output, and the copy must not be remade
    per call."""
    g = torch.Generator().manual_seed(2)
    lin = OneDNNLinear.from_linear(nn.Linear(48, 300))
    x = torch.randn(5, 48, generator=g)
    with torch.inference_mode():
        packed = lin.packed_weight()
        assert packed.is_mkldnn and lin.packed_weight() is packed  # made once
        new_w = torch.randn(300, 48, generator=g)
        lin.weight.copy_(new_w)
        torch.testing.assert_close(lin(x), F.linear(x, new_w, lin.bias), rtol=1e-5, atol=1e-5)
        assert lin.packed_weight() is not packed
        # negative control: the stale copy (what a cache keyed on the Parameter alone would keep)
        stale = torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")
        assert (stale - F.linear(x, new_w, lin.bias)).abs().max() > 0.1


@needs_onednn
@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_the_gelu_post_op_equals_gelu_after_the_linear(act, monkeypatch):
    """forward_gelu (oneDNN's GELU post-op) against ACTIVATION_FNS[act] after F.linear, as close as
    the float64 reference allows; GPT-2's MLP takes it on a CPU model (counted), and the model's
    output stays."""
    from nanoserve.models import build_model
    from nanoserve.models.layers import ACTIVATION_FNS

    g = torch.Generator().manual_seed(3)
    lin = OneDNNLinear.from_linear(nn.Linear(48, 200))
    x = torch.randn(6, 48, generator=g) * 2
    with torch.inference_mode():
        ref = ACTIVATION_FNS[act](x.double() @ lin.weight.double().t() + lin.bias.double())
        plain = ACTIVATION_FNS[act](F.linear(x, lin.weight, lin.bias))
        fused = lin.forward_gelu(x, act)
        assert (fused.double() - ref).abs().max() <= max(
            4 * (plain.double() - ref).abs().max(), 1e-5
        )
        # control: the other GELU (tanh against erf) is farther than that
        other = lin.forward_gelu(x, "gelu" if act == "gelu_new" else "gelu_new")
        assert (other.double() - ref).abs().max() > 1e-4
    assert lin.fuses_gelu(act) and not lin.fuses_gelu("silu") and not lin.fuses_gelu("quick_gelu")
    cfg = gpt2_config("gpt2", n_layers=2, hidden_size=32, n_heads=2, vocab_size=50)
    model = build_model(cfg)
    ids = torch.randint(0, 50, (2, 5), generator=g)
    with torch.inference_mode():
        before = model(ids)
        use_onednn_linears(model)
        calls, fused_gelu = [], OneDNNLinear.forward_gelu
        monkeypatch.setattr(OneDNNLinear, "forward_gelu", lambda self, x,
                            a: calls.append(a) or fused_gelu(self, x, a))
        torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    assert calls == ["gelu_new", "gelu_new"]  # one per layer


@needs_onednn
def test_use_onednn_linears_swaps_plain_linears_and_keeps_ties():
    cfg = gpt2_config("gpt2", n_layers=1, hidden_size=32, n_heads=2, vocab_size=50)
    from nanoserve.models import build_model

    model = build_model(cfg)
    x = torch.randint(0, 50, (2, 5))
    with torch.inference_mode():
        before = model(x)
    assert use_onednn_linears(model) is None
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the swap
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    y = torch.randn(3, 32, requires_grad=True)  # autograd takes the plain path
    linears[0](y).sum().backward()
    assert y.grad is not None
    assert "device" in use_onednn_linears(nn.Linear(2, 2, device="meta"))


@needs_onednn
def test_the_engine_runs_its_cpu_linears_through_onednn():
    from nanoserve import LLMEngine

    engine = LLMEngine.from_kwargs("demo")
    assert engine.runner.onednn_off is None
    linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    assert "dtype" in onednn_unavailable(torch.device("cpu"), torch.float16)



def test_forward_groups_bound_prefill_padding():
    import random

    from nanoserve.engine.model_runner import forward_groups

    rng = random.Random(0)
    for _ in range(200):
        num_new = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 40))]
        # a few verifications
        num_logits = [n if n > 1 and rng.random() < 0.1 else 1 for n in num_new]
        groups = forward_groups(num_new, num_logits)
        assert sorted(i for g in groups for i in g) == list(range(len(num_new)))  # each row once
        kinds = [{(num_new[i] == 1, num_logits[i] > 1) for i in g} for g in groups]
        # decodes, verifications, prefills never share a forward
        assert all(len(k) == 1 for k in kinds)
        assert sum(k == {(True, False)} for k in kinds) <= 1  # all decodes in one forward
        for g in groups:
            if len(g) > 1 and num_logits[g[0]] == 1 and num_new[g[0]] > 1:  # a prefill forward
                assert len(g) * max(num_new[i] for i in g) <= 1.25 * sum(num_new[i] for i in g)
    # negative control: without the split, this step's prefill forward would be mostly padding
    assert forward_groups([300, 10, 10, 1], [1] * 4, slack=float("inf")) == [[3], [0, 1, 2]]
    assert forward_groups([300, 10, 10, 1], [1] * 4) == [[3], [0], [1, 2]]


def test_run_returns_each_rows_logits_whatever_the_forward_order():
    """forward_groups runs prefills longest first; the logits must come back in the caller's order
    (a regression: one sorted group was once returned as it was, swapping rows' logits)."""
    from nanoserve import LLMEngine
    from nanoserve.engine.sequence import Sequence

    engine = LLMEngine.from_kwargs("demo", enable_prefix_caching=False)
    # one prefill forward, not in length order
    seqs = [Sequence(list(range(1, 1 + n))) for n in (8, 10, 9)]
    for s in seqs:
        engine.block_allocator.allocate(s)
    num_new = [len(s) for s in seqs]
    from nanoserve.engine.model_runner import forward_groups

    assert forward_groups(num_new, [1, 1, 1]) == [[1, 2, 0]]  # one forward, longest first
    forward = engine.runner.run(seqs, num_new)  # B, V
    backward = engine.runner.run(seqs[::-1], num_new[::-1])
    # the same forwards, rows back in each caller's order
    assert torch.equal(forward, backward.flip(0))
    assert not torch.equal(forward, backward)  # control: the rows' logits do differ
