"""Exercise 13: top-k expert routing (nanoserve/models/moe.py: SparseMoeBlock.route,
SparseMoeBlock.forward).

Oracles: the routing rule written here from its definition (softmax, top k, renormalise), a
per-token loop written here (each token through its k experts, one at a time), and transformers' own
MixtralSparseMoeBlock with the same weights. Known-wrong variants at the end: softmax over the k
chosen logits only (equal to the right rule only when renormalising), never renormalising, weights
crossed between a token's slots, and every token sent to its first expert only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, explained_failure
from testdata import hf_moe_block_like

REFERENCE = "nanoserve.models.moe"
EXERCISE = "moe"
pytestmark = pytest.mark.ex13


def _block(impl, top_k=2, renormalize=True, E=6, seed=0):
    from nanoserve.models.config import ModelConfig
    from nanoserve.models.layers import ACTIVATION_FNS

    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=16, n_layers=1, n_heads=2,
                      n_kv_heads=2,
                      intermediate_size=24, max_position_embeddings=32, num_experts=E,
                      num_experts_per_tok=top_k,
                      norm_topk_prob=renormalize)
    torch.manual_seed(seed)
    block = impl.SparseMoeBlock(cfg, ACTIVATION_FNS["silu"])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.4)
    return block


def _per_token(block, x):
    """Σ_j w_j · expert_j(token), token by token, with the routing rule written out here."""
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        probs = block.gate(t).float().softmax(-1)
        w, e = probs.topk(block.top_k)
        w = w / w.sum() if block.renormalize else w
        out.append(sum(wi * block.experts[int(ei)](t[None])[0] for wi, ei in zip(w, e)))
    return torch.stack(out).view(x.shape)


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_route(impl, block=None):
    for renormalize in (True, False):
        b = block or _block(impl, top_k=3, renormalize=renormalize)
        x = torch.randn(9, 16)
        with torch.no_grad():
            w, e = b.route(x)
            probs = b.gate(x).float().softmax(-1)
            want_w, want_e = probs.topk(b.top_k, dim=-1)
            want_w = want_w / want_w.sum(-1, keepdim=True) if b.renormalize else want_w
        case = (f"route(9 random tokens), 6 experts, top_k={b.top_k}, "
                f"renormalize={b.renormalize}")
        expect(w.shape == e.shape == (9, b.top_k) and w.dtype == x.dtype,
               f"{case}: the weights' and ids' shapes and dtype", f"(9, {b.top_k}), {x.dtype}",
               (tuple(w.shape), tuple(e.shape), w.dtype))
        got_e, want_sorted = e.sort(-1).values, want_e.sort(-1).values
        differ = (got_e != want_sorted).any(-1).nonzero().flatten().tolist()
        if differ:
            t = differ[0]
            raise AssertionError(f"{case}: the chosen experts of token {t}: expected "
                                 f"{want_sorted[t].tolist()}, got {got_e[t].tolist()}")
        expect_close(w.gather(-1, e.argsort(-1)), want_w.gather(-1, want_e.argsort(-1)),
                     f"{case}: the weights (ordered by expert id)", atol=1e-6,
                     dims="token, slot")


def check_forward_equals_the_per_token_loop(impl, top_k=2, renormalize=False):
    block = _block(impl, top_k=top_k, renormalize=renormalize)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        out = block(x)
        expect_close(out, _per_token(block, x),
                     f"SparseMoeBlock(top_k={top_k}, renormalize={renormalize}) on [2, 7, 16] "
                     "against each token through its k experts one at a time", atol=1e-5,
                     dims="b, t, c")


def check_matches_transformers_mixtral(impl):
    block = _block(impl, top_k=2, renormalize=True)
    hf = hf_moe_block_like(block, "mixtral")
    with torch.no_grad():
        x = torch.randn(3, 5, 16)
        expect_close(block(x), hf(x), "SparseMoeBlock(top_k=2, renormalize=True) against "
                     "transformers' MixtralSparseMoeBlock with the same weights", atol=1e-5,
                     dims="b, t, c")


def check_each_chosen_expert_runs_once(impl):
    block = _block(impl, top_k=2)
    calls = []
    for i, e in enumerate(block.experts):
        e.register_forward_hook(lambda m, a, o, i=i: calls.append((i, a[0].shape[0])))
    with torch.no_grad():
        x = torch.randn(4, 6, 16)
        _, ids = block.route(x.reshape(-1, 16))
        block(x)
    chosen = {int(e): int((ids == e).sum()) for e in ids.unique()}
    # one call per chosen expert, on exactly its tokens
    expect(sorted(calls) == sorted(chosen.items()),
           "the experts' calls on 24 tokens, as (expert, tokens)", sorted(chosen.items()),
           sorted(calls))


# ----------------------------------------------------------------------------- the tests
def test_ex13_1_route_is_softmax_then_top_k_then_renormalise(impl):
    check_route(impl)


@pytest.mark.parametrize("top_k, renormalize", [(1, True), (2, False), (3, True), (6, False)])
def test_ex13_2_forward_equals_the_per_token_loop(impl, top_k, renormalize):
    check_forward_equals_the_per_token_loop(impl, top_k, renormalize)


def test_ex13_2_matches_transformers_mixtral_block(impl):
    check_matches_transformers_mixtral(impl)


def test_ex13_2_each_chosen_expert_runs_once_on_its_tokens(impl):
    check_each_chosen_expert_runs_once(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _variant(route_rule="right", combine="right"):
    import nanoserve.models.moe as ref

    class Variant(ref.SparseMoeBlock):
        def route(self, x):
            logits = self.gate(x).float()
            if route_rule == "softmax of the k chosen":
                top, ids = logits.topk(self.top_k, dim=-1)
                return top.softmax(-1).to(x.dtype), ids
            w, ids = logits.softmax(-1).topk(self.top_k, dim=-1)
            if self.renormalize and route_rule != "never renormalise":
                w = w / w.sum(-1, keepdim=True)
            return w.to(x.dtype), ids

        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            w, ids = self.route(flat)
            if combine == "first expert only":
                ids = ids[:, :1].expand_as(ids)
            if combine == "weights crossed":
                w = w.flip(-1)
            out = torch.zeros_like(flat)
            for e in ids.unique().tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, self.experts[e](flat[tok]) * w[tok, slot, None])
            return out.view(x.shape)

    return SimpleNamespace(SparseMoeBlock=Variant)


WRONG = {
    "softmax over the k chosen logits": (_variant(route_rule="softmax of the k chosen"),
                                         [check_route,
                                          lambda i: check_forward_equals_the_per_token_loop(i, 2)]),
    "never renormalise": (_variant(route_rule="never renormalise"),
                          [check_route, check_matches_transformers_mixtral]),
    "weights crossed between slots": (_variant(combine="weights crossed"),
                                      [check_forward_equals_the_per_token_loop,
                                       check_matches_transformers_mixtral]),
    "every token to its first expert": (_variant(combine="first expert only"),
                                        [check_forward_equals_the_per_token_loop,
                                         check_each_chosen_expert_runs_once]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex13_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex13_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_route, check_forward_equals_the_per_token_loop,
                  check_matches_transformers_mixtral,
                  check_each_chosen_expert_runs_once):
        check(right)
