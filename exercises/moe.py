"""Exercise 13: top-k expert routing, the mixture-of-experts layer of Mixtral and Qwen3-MoE.

Your versions of SparseMoeBlock.route and SparseMoeBlock.forward from nanoserve/models/moe.py, with
the same names and signatures. The class inherits nanoserve's, so the router (`self.gate`, an
nn.Linear C -> E), the experts (`self.experts`, E gated MLPs), `self.top_k` and `self.renormalize`
are given. Taught in notebooks/10_model_families.ipynb, section 3. Check your work with

    make exercises EX=ex13        # or: .venv/bin/pytest tests/exercises -m ex13 --impl exercises

Shapes: N tokens, C hidden size, E experts, k = self.top_k experts per token.
"""

from __future__ import annotations

import torch

import nanoserve.models.moe


class SparseMoeBlock(nanoserve.models.moe.SparseMoeBlock):
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weights [N, k] in x's dtype, expert ids [N, k]).

        The router's probabilities over all E experts (softmax of self.gate(x), in float32), each
        token's k largest, and, when self.renormalize, those k divided by their sum."""
        raise NotImplementedError(
            "Exercise 13.1: each token's k most probable experts under the router, weighted by "
            "those probabilities, rescaled to sum to 1 when renormalising (roughly 5 lines; see "
            "notebooks/10_model_families, section 3, 'Mixture of experts'; more: make hint "
            "EX=ex13 N=2)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] -> [..., C]: each token's output is Σ over its k experts of weight ·
        expert(token).

        Group the work by expert: each expert that some token chose runs once, on all of its tokens,
        and its weighted outputs are added back at those tokens' rows."""
        raise NotImplementedError(
            "Exercise 13.2: each expert runs once, on the tokens that chose it, and adds its "
            "weighted output to theirs (roughly 9 lines; see notebooks/10_model_families, section "
            "3, 'Mixture of experts'; more: make hint EX=ex13 N=2)")
