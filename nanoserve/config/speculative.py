"""The speculative section: which proposer drafts, how many tokens, how γ adapts, and Medusa's token
tree (nanoserve/spec/). None in EngineConfig: no speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import EngineArg, arg, check_choice, flat_name

# spec/proposers.py, medusa.py, eagle.py
SPECULATIVE_METHODS = ("draft", "ngram", "medusa", "eagle")
# γ beyond this almost never pays: α^γ is tiny (it bounds test sizes too)
MAX_SPECULATIVE_TOKENS = 16
# Medusa's speculative_tree="default": 8 candidates to depth 3 (3 heads): the first head's top 2;
# after its best, the second head's top 2, after its second best, the second head's best; after the
# best pair, the third head's top 2; after (0, 1), its best
DEFAULT_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]


def _as_path(choice):
    """A path given as a list reads as the tuple it stands for; anything else is checked as is."""
    if isinstance(choice, list):
        return tuple(choice)
    return choice


def check_tree_choices(choices) -> list[tuple[int, ...]] | None:
    """Medusa's tree as paths of top-k indices, checked and sorted (shorter first): each non-empty,
    of indices ≥ 0, listed once, its parent path listed too, at most MAX_SPECULATIVE_TOKENS in all.
    None stays None (no tree: a chain)."""
    if choices is None:
        return None
    if isinstance(choices, (str, bytes)) or not hasattr(choices, "__iter__"):
        raise NanoserveError("speculative_tree must be a list of paths such as "
                             f"[(0,), (1,), (0, 0)] or 'default', got {choices!r}")
    paths = [_as_path(c) for c in choices]
    for c in paths:
        if not isinstance(c, tuple) or not c or not all(_is_index(i) for i in c):
            raise NanoserveError(f"speculative_tree: each path must be a non-empty tuple of top-k "
                                 f"indices ≥ 0, got {c!r}")
        if len(c) > 1 and c[:-1] not in paths:
            raise NanoserveError(f"speculative_tree: path {c} is listed without its parent path "
                                 f"{c[:-1]}")
    if len(set(paths)) != len(paths):
        raise NanoserveError("speculative_tree lists a path twice")
    if not 1 <= len(paths) <= MAX_SPECULATIVE_TOKENS:
        raise NanoserveError(f"speculative_tree has {len(paths)} paths; allowed: "
                             f"1..{MAX_SPECULATIVE_TOKENS} (each is a token the target verifies)")
    return sorted(paths, key=lambda c: (len(c), c))


def _is_index(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i >= 0


@dataclass
class SpeculativeConfig:
    """What speculative decoding runs with (nanoserve/spec/). `tree` (Medusa only): the heads' top-1
    chain becomes a token tree of top-k paths, as Medusa's "choices" (spec/tree_sampler.py)."""

    method: str  # "draft" (a small model), "ngram" (prompt lookup), "medusa" or "eagle" (heads)
    num_speculative_tokens: int = 4  # γ: the most tokens drafted per step
    draft_model: str | None = None  # draft: a model; medusa, eagle: the heads' directory
    adaptive: bool = True  # pick each sample's γ from its observed acceptance (else always γ)
    min_acceptance: float = 0.3  # below this estimated α a sample stops speculating (then probes)
    probe_interval: int = 16  # plain steps between probes of a switched-off sample
    ngram_max: int = 3  # n-gram lookup: longest and shortest suffix to match
    ngram_min: int = 1
    # c pinned (v = 1, nothing timed); None: measured (spec/controller.py)
    cost: float | None = None
    tree: list[tuple[int, ...]] | None = None  # Medusa: top-k paths; None: a chain

    def __post_init__(self):
        if self.tree == "default":
            self.tree = DEFAULT_TREE
        self.tree = check_tree_choices(self.tree)
        self.validate()

    @property
    def verify_tokens(self) -> int:
        """The most new tokens a verification row computes when its forwards replay CUDA graphs
        (engine/cuda_graph.py): 1 + γ for a draft model's or n-gram lookup's chain; 1 (no
        verification graphs) for draft heads, whose hidden states keep every graph off
        (spec/draft_heads.py)."""
        if self.method in ("medusa", "eagle"):
            return 1
        return 1 + self.num_speculative_tokens

    def validate(self) -> None:
        check_choice("speculative", self.method, SPECULATIVE_METHODS)
        g = self.num_speculative_tokens
        if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= MAX_SPECULATIVE_TOKENS:
            raise NanoserveError(f"num_speculative_tokens={g!r} must be an integer in "
                                 f"1..{MAX_SPECULATIVE_TOKENS}")
        if self.method == "draft" and not self.draft_model:
            raise NanoserveError("speculative decoding with a draft model needs "
                                 "speculative_model=<name or path>")
        if self.method in ("medusa", "eagle") and not self.draft_model:
            what = {"medusa": "the Medusa heads' directory", "eagle": "the EAGLE head's directory"}
            raise NanoserveError(f"speculative={self.method!r} needs "
                                 f"speculative_model=<{what[self.method]}>")
        if not 0 <= self.min_acceptance < 1:
            raise NanoserveError(f"min_acceptance={self.min_acceptance!r} must be in [0, 1)")
        if self.tree is not None and self.method != "medusa":
            raise NanoserveError("speculative_tree is for speculative='medusa' (its heads' top-k "
                                 f"candidates), not {self.method!r}, whose proposer drafts one "
                                 "chain")
        c = self.cost
        finite = isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < float("inf")
        if c is not None and not finite:
            raise NanoserveError(f"speculative_cost={c!r} must be a finite number ≥ 0 (a draft "
                                 "forward's cost in target steps), or None to measure it")


# its keyword arguments (config/args.py)
SPECULATIVE_ARGS: dict[str, EngineArg] = {
    "speculative": arg("speculative", "method", "the proposer (ngram: prompt lookup)",
                       choices=SPECULATIVE_METHODS),
    "speculative_model": arg("speculative", "draft_model",
                             "a draft model (e.g. demo-draft), or the Medusa / EAGLE heads' "
                             "directory"),
    "num_speculative_tokens": arg("speculative", "num_speculative_tokens",
                                  f"γ, draft tokens per step (1..{MAX_SPECULATIVE_TOKENS})"),
    "speculative_adaptive": arg("speculative", "adaptive",
                                "pick each sample's γ from its observed acceptance"),
    "speculative_cost": arg("speculative", "cost", "pin a draft forward's cost in target steps "
                            "(default: measured; pinned, seeded sampling no longer depends on the "
                            "machine's speed)"),
    "speculative_tree": arg("speculative", "tree", "Medusa's token tree (paths)", cli=False),
}


def speculative_section(values: dict) -> SpeculativeConfig | None:
    """speculative / speculative_model turn speculation on; its other options need one of them."""
    if values.get("method") is None and values.get("draft_model") is None:
        if values:
            name = flat_name(SPECULATIVE_ARGS, "speculative", next(iter(values)))
            raise NanoserveError(f"{name} needs speculative=<method> or speculative_model=<name> "
                                 "(no speculative decoding is on)")
        return None
    values = dict(values)
    if values.get("method") is None:
        values["method"] = "draft"
    return SpeculativeConfig(**values)


