"""What speculative decoding runs with: `SpecDecodeConfig`, checked before any model loads (spec_decode.py uses it).

    LLM(target, speculative="draft" | "ngram" | "medusa" | "eagle", speculative_model=..., num_speculative_tokens=γ,
        speculative_adaptive=True, speculative_cost=None, speculative_tree=None)

`speculative_tree` (Medusa only) turns the heads' top-1 chain into a token tree: a list of paths of top-k
indices, as Medusa's "choices" — (0,) the first head's best token, (1,) its second best, (0, 1) the second
head's second best after (0,) — each path's parent path listed too; or "default" for DEFAULT_TREE. Each step
verifies the paths of length ≤ γ at once (tree_sampler.py, model_runner.tree_mask).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .rejection_sampler import MAX_SPECULATIVE_TOKENS
from .tree_sampler import DEFAULT_TREE, check_tree_choices

SPECULATIVE_METHODS = ("draft", "ngram", "medusa", "eagle")


@dataclass
class SpecDecodeConfig:
    method: str  # "draft" (a small model), "ngram" (prompt lookup), "medusa" or "eagle" (heads on the target)
    num_speculative_tokens: int = 4  # γ: the most tokens drafted per step
    draft_model: str | None = None  # "draft": a shipped name, checkpoint dir or .bin; "medusa", "eagle": the head's dir
    adaptive: bool = True  # pick each sample's γ from its observed acceptance (else always γ)
    min_acceptance: float = 0.3  # below this estimated α a sample stops speculating (then probes)
    probe_interval: int = 16  # plain steps between probes of a switched-off sample
    ngram_max: int = 3  # n-gram lookup: longest and shortest suffix to match
    ngram_min: int = 1
    cost: float | None = None  # c pinned (v = 1, nothing timed); None: measured (spec/controller.py)
    tree: list[tuple[int, ...]] | None = None  # Medusa: a token tree of top-k paths (tree_sampler.py); None: a chain

    @classmethod
    def from_args(cls, method: str | None, num_speculative_tokens: int, draft_model: str | None,
                  adaptive: bool, cost: float | None = None, tree=None) -> SpecDecodeConfig | None:
        """The validated config of LLMEngine's speculative arguments; None when they ask for no speculation."""
        if draft_model is None and method is None:
            if tree is not None:
                raise NanoserveError("speculative_tree needs speculative='medusa' (its heads' top-k form the tree)")
            return None
        cfg = cls(method or "draft", num_speculative_tokens, draft_model, adaptive, cost=cost,
                  tree=check_tree_choices(DEFAULT_TREE if tree == "default" else tree))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise NanoserveError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                                 f"got {self.method!r}")
        g = self.num_speculative_tokens
        if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= MAX_SPECULATIVE_TOKENS:
            raise NanoserveError(f"num_speculative_tokens={g!r} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}")
        if self.method == "draft" and not self.draft_model:
            raise NanoserveError("speculative decoding with a draft model needs speculative_model=<name or path>")
        if self.method in ("medusa", "eagle") and not self.draft_model:
            what = {"medusa": "the Medusa heads' directory", "eagle": "the EAGLE head's directory"}[self.method]
            raise NanoserveError(f"speculative={self.method!r} needs speculative_model=<{what}>")
        if not 0 <= self.min_acceptance < 1:
            raise NanoserveError(f"min_acceptance={self.min_acceptance!r} must be in [0, 1)")
        if self.tree is not None and self.method != "medusa":
            raise NanoserveError(f"speculative_tree is for speculative='medusa' (its heads' top-k candidates), not "
                                 f"{self.method!r}, whose proposer drafts one chain")
        c = self.cost
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < float("inf")):
            raise NanoserveError(f"speculative_cost={c!r} must be a finite number ≥ 0 (a draft forward's cost "
                                 "in target steps), or None to measure it")
