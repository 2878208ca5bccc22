"""Draft heads on the target's own hidden states — Medusa's (medusa.py) and EAGLE's (eagle.py) —
loaded for the engine and checked against it: `head_proposer(cfg, engine)` -> (the proposer, its
prior cost c).

Both read what the model runner keeps of each forward (the model's `keep_hidden`), so decode steps
run eagerly: CUDA graphs recorded before the heads arrived are dropped. c's prior is the heads'
parameters over the target's (the controller then measures it: controller.py).
"""

from __future__ import annotations

from ..errors import NanoserveError
from .eagle import load_eagle
from .eagle_proposer import EagleProposer
from .medusa import MedusaProposer, load_medusa


def head_proposer(cfg, engine):
    hidden, vocab = engine.config.hidden_size, engine.config.vocab_size
    if cfg.method == "eagle":
        head = load_eagle(cfg.draft_model, hidden, vocab, engine.device, engine.dtype)
        proposer = EagleProposer(head, engine.runner)
    else:
        head = load_medusa(cfg.draft_model, hidden, vocab, engine.device, engine.dtype)
        if cfg.num_speculative_tokens > head.num_heads:
            raise NanoserveError(f"num_speculative_tokens={cfg.num_speculative_tokens} but the "
                                 f"Medusa heads at {cfg.draft_model} predict {head.num_heads} "
                                 f"tokens; allowed: 1..{head.num_heads}")
        check_tree_fits(cfg.tree, head.num_heads, engine)
        proposer = MedusaProposer(head, engine.runner, cfg.tree)
    if engine.runner.graphs is not None:  # the graphs were recorded without keeping hidden states
        engine.runner.graphs = None
        engine.cuda_graphs_off = f"{cfg.method} heads read each step's hidden states"
    cost = sum(p.numel() for p in head.parameters()) / sum(
        p.numel() for p in engine.model.parameters()
    )
    return proposer, cost


def check_tree_fits(tree, num_heads: int, engine) -> None:
    """A token tree needs a head per depth, an attention backend that takes its mask, and no sliding
    window."""
    if tree is None:
        return
    if max(map(len, tree)) > num_heads:
        raise NanoserveError(f"speculative_tree has a path of length {max(map(len, tree))} but the "
                             f"Medusa heads predict {num_heads} tokens; allowed: paths of length "
                             f"1..{num_heads}")
    if max(max(c) for c in tree) >= engine.config.vocab_size:
        raise NanoserveError(f"speculative_tree asks for candidate {max(max(c) for c in tree)} of "
                             f"a head; the vocabulary has {engine.config.vocab_size} tokens")
    if engine.attention_backend == "triton" and engine.runner.kv.quant is not None:
        raise NanoserveError("speculative_tree with the triton backend needs "
                             "kv_cache_dtype='auto': over a quantized pool its kernel reads the "
                             "tree's keys back from the pool, unmasked")
    if engine.config.sliding_window is not None:
        raise NanoserveError("speculative_tree is not supported with sliding-window attention (a "
                             "node's window would follow its path, not its slot); without a tree, "
                             "Medusa verifies a chain")
