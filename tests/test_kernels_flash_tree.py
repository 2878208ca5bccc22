"""Flash attention over a token tree (`tree_bits`: kernels/flash_attention.py), in the interpreter.

The oracle is outside the mask: each node alone, through SDPA, over the prefix and the keys of its
own path (its ancestors and itself, found by walking its parents) — what decoding that path as a
chain would attend to. A batch mixes two trees (one of 17 nodes, past a 16-wide tile) with a plain
chain (bits −1), over a paged, NaN-poisoned prefix. The kernel and the torch reference must both
match it; the control: without the bits the tree rows see their siblings' branches and miss it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.flash_attention import flash_attention, flash_attention_ref
from test_kernels_flash import FP32_TOL, _cu, _err, _paged_prefix, _wrong
from testdata import tree_path

SMALL = [-1, 0, 0, 1, 1, 2, 3]
# 17 nodes: the last tile starts at node 16
WIDE = [-1, 0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 12, 15]


def _bits(parents: list[int] | None, n: int) -> list[int]:
    return (
        [-1] * n if parents is None
        else [sum(1 << j for j in tree_path(parents, i)) for i in range(n)]
    )


def _case(H=4, Hkv=2, D=32, block_size=8):
    rows = [SMALL, None, WIDE]  # a chain of 4 between the trees
    lens = [len(SMALL), 4, len(WIDE)]
    prefix_lens = [5, 9, 20]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), H, D, generator=g)  # total, H, D
    k = torch.randn(sum(lens), Hkv, D, generator=g)
    v = torch.randn(sum(lens), Hkv, D, generator=g)
    k_cache, v_cache, tables, ctx, prefixes = _paged_prefix(prefix_lens, Hkv, D, block_size)
    bits = torch.tensor([b for parents, n in zip(rows, lens) for b in _bits(parents, n)],
                        dtype=torch.int64)
    paged = dict(block_tables=tables, k_cache=k_cache, v_cache=v_cache, context_lens=ctx)
    return q, k, v, _cu(lens), paged, bits, rows, prefixes


def _oracle(q, k, v, cu, rows, prefixes):
    out = torch.zeros_like(q)
    cu = cu.tolist()
    for b, parents in enumerate(rows):
        n = cu[b + 1] - cu[b]
        for i in range(n):
            seen = tree_path(parents, i) if parents is not None else list(range(i + 1))
            keys = torch.cat([prefixes[b][0], k[cu[b]:cu[b + 1]][seen]])  # S_i, Hkv, D
            vals = torch.cat([prefixes[b][1], v[cu[b]:cu[b + 1]][seen]])
            o = F.scaled_dot_product_attention(q[cu[b] + i][:, None], keys.transpose(0, 1),
                                               vals.transpose(0, 1),
                                               enable_gqa=True)  # H, 1, D
            out[cu[b] + i] = o[:, 0]
    return out


def test_tree_rows_see_their_ancestors_only():
    q, k, v, cu, paged, bits, rows, prefixes = _case()
    want = _oracle(q, k, v, cu, rows, prefixes)
    got = flash_attention(q, k, v, cu, cu, causal=True, tree_bits=bits, **paged)
    assert _err(got, want) <= FP32_TOL
    assert _err(flash_attention_ref(q, k, v, cu, cu, causal=True, tree_bits=bits, **paged),
                want) <= FP32_TOL
    # the control: causal alone lets a node see every earlier node, its siblings' branches included
    plain = flash_attention(q, k, v, cu, cu, causal=True, **paged)
    assert _wrong(_err(plain[:len(SMALL)], want[:len(SMALL)]))
    assert _wrong(_err(plain[-len(WIDE):], want[-len(WIDE):]))
    # the chain row: the same
    assert _err(plain[len(SMALL):-len(WIDE)], want[len(SMALL):-len(WIDE)]) <= FP32_TOL


@pytest.mark.parametrize("change,message", [
    ("dtype", "int64"), ("shape", "shape"), ("causal", "causal=True")])
def test_tree_bits_are_checked(change, message):
    q, k, v, cu, paged, bits, _, _ = _case()
    kwargs = dict(causal=True, tree_bits=bits)
    if change == "dtype":
        kwargs["tree_bits"] = bits.int()
    elif change == "shape":
        kwargs["tree_bits"] = bits[1:]
    else:
        kwargs["causal"] = False
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, cu, cu, **kwargs, **paged)
