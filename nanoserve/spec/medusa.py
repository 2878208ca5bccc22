"""Medusa heads (Cai et al. 2024): draft tokens from the target's own last hidden state, no draft
model.

The target's LM head turns the hidden state h_t (after the last block and the final norm) into the
distribution of token t + 1. A Medusa head is a small block on the same h_t, trained to predict
token t + 1 + i instead (i = 1..k): one residual block, h + SiLU(W h + b), then its own LM head [V,
C] (initialized from the target's). All k heads read one vector, so drafting k tokens costs k small
matmuls, not k forwards of anything: the cheapest proposer there is beside n-gram lookup.

    MedusaHeads      the k heads (Medusa-1's layout), `forward(h) -> logits [N, k, V]`
    save_medusa      a directory in Medusa's own layout: config.json (medusa_num_heads,
    load_medusa      medusa_num_layers, base_model_name_or_path, and our hidden_size / vocab_size)
                     and medusa_lm_head.safetensors with keys "{i}.{j}.linear.weight" /
                     ".bias" (block j of head i) and "{i}.{L}.weight" (head i's LM head,
                     L = medusa_num_layers)
    MedusaProposer   the engine's proposer: each row's top-1 of heads 1..γ, a chain of γ drafts

By default the heads' top-1 tokens form one chain, verified like any draft (spec_decode.py): greedy
keeps the target's tokens exactly, and at T > 0 the chain is a deterministic proposal (q one-hot, as
n-gram's), which the rejection sampler verifies without changing the target's law. With
`speculative_tree` the heads' top-k candidates form a token tree (tree_sampler.tree_from_choices),
scored in one forward with a tree mask and verified by walking it (tree_sampler.py: greedy, or
SpecInfer's multi-candidate rejection).

The hidden state: the model keeps its LM head's input when `keep_hidden` is set (models/base.py),
the proposer keeps each row's rows of it by sequence after every forward (`keep_hidden`, a hook in
the model runner's `after_forward`), and picks the
one that produced the sequence's latest token: the last row after a plain step, row `accepted` after
a verification (recorded at `rollback`; a tree's: its last accepted node's). Training:
tools/train_medusa.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError
from .tree_sampler import tree_from_choices

WEIGHTS, CONFIG = "medusa_lm_head.safetensors", "config.json"


class ResBlock(nn.Module):
    """h + SiLU(W h + b); W starts at zero, so an untrained head is its LM head on h."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """k heads; head i (0-based) at position t predicts token t + 2 + i. Its state dict is
    Medusa's."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden = hidden
        self.vocab = vocab
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                          nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h [..., C] -> logits [..., k, V]
        return torch.stack([head(h) for head in self.heads], dim=-2)


def save_medusa(heads: MedusaHeads, path: str | Path, base_model: str = "") -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model, "hidden_size": heads.hidden,
              "vocab_size": heads.vocab}
    (path / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in heads.heads.state_dict().items()},
              str(path / WEIGHTS))
    return path


def load_medusa(path: str | Path, hidden: int, vocab: int, device=None, dtype=None) -> MedusaHeads:
    """Heads saved by save_medusa (or Medusa itself), checked against the target's hidden size and
    vocabulary."""
    path = Path(path)
    for f in (CONFIG, WEIGHTS):
        if not (path / f).is_file():
            raise CheckpointError(f"{path} holds no Medusa heads: {f} is missing")
    cfg = json.loads((path / CONFIG).read_text())
    k, layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers", 1)
    if not isinstance(k, int) or k < 1 or not isinstance(layers, int) or layers < 0:
        raise CheckpointError(f"{path / CONFIG}: medusa_num_heads={k!r} and "
                              f"medusa_num_layers={layers!r} must be integers, ≥ 1 and ≥ 0")
    state = load_file(str(path / WEIGHTS))
    shape = tuple(state.get(f"0.{layers}.weight", torch.empty(0)).shape)
    if shape != (vocab, hidden):
        raise CheckpointError(f"{path}: the heads' LM head is {shape} (vocab, hidden); the "
                              f"target's is {(vocab, hidden)}: these heads were trained for "
                              "another model")
    heads = MedusaHeads(hidden, vocab, k, layers)
    missing, unexpected = heads.heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path / WEIGHTS}: tensors missing {missing[:3]} or unexpected "
                              f"{unexpected[:3]} for {k} heads of {layers} blocks")
    return heads.to(device=device, dtype=dtype).eval()


class MedusaProposer:
    """Each speculating row's drafts: the top token of heads 1..γ on the hidden state behind its
    latest token, or with `tree` (checked choices) the tree of the paths of length ≤ γ over the
    heads' top-k."""

    timing = None  # (one batched head call per step: timed as one draft forward by spec_decode)
    # all γ drafts come from that one call: a step costs v + c, not v + c·γ (spec/controller.py)
    one_call = True

    def __init__(self, heads: MedusaHeads, runner, tree: list[tuple[int, ...]] | None = None):
        self.heads, self.runner, self.tree = heads, runner, tree
        # candidates read per head
        self.top_k = 1 if tree is None else 1 + max(i for c in tree for i in c)
        runner.model.keep_hidden = True  # the model keeps its LM head's input (models/base.py)
        self.hidden: dict[int, torch.Tensor] = {}  # seq_id -> [K, C] where its latest logits were
        runner.after_forward.append(self.keep_hidden)
        self.start: dict[int, int] = {}  # seq_id -> its length before this step's drafts
        # seq_id -> (the verification's rows, accepted)
        self.verified: dict[int, tuple[torch.Tensor, int]] = {}

    def propose(self, rows, matchers=None):
        """rows: (seq, γ, params, generator) -> (draft ids, None) each, or (node tokens 1.., None,
        parents) for a tree; drafts ignore a grammar (verification masks a chain's, as n-gram
        drafts: a row under a grammar drafts a chain) and are deterministic: q is one-hot."""
        found, picked = [], []
        for i, (seq, _, _, _) in enumerate(rows):
            h = self.hidden.get(seq.seq_id)  # [K, C] of its latest forward
            if h is None:
                continue
            rows_then, accepted = self.verified.pop(seq.seq_id, (None, -1))
            # row `accepted` only of that verification
            picked.append(h[accepted] if rows_then is h else h[-1])
            found.append(i)
            self.start[seq.seq_id] = len(seq)
        drafts: list[tuple] = [([], None) for _ in rows]
        if found:
            with torch.inference_mode():
                scores = self.heads(torch.stack(picked))  # N, k, V
                best = (
                    scores.argmax(-1, keepdim=True) if self.top_k == 1
                    else scores.topk(self.top_k, -1).indices
                )
                tops = best.tolist()  # N, k, top_k
            for i, top in zip(found, tops):
                gamma = rows[i][1]
                if self.tree is None or (matchers and matchers[i] is not None):
                    drafts[i] = ([t[0] for t in top[:gamma]], None)
                else:
                    parents, tokens = tree_from_choices(
                        [c for c in self.tree if len(c) <= gamma], top
                    )
                    drafts[i] = (tokens[1:], None, parents)
        return drafts

    def rollback(self, seq, num_valid: int, row: int | None = None) -> None:
        """After verifying: the hidden row behind the latest token is that of the last accepted
        draft (a chain's row num_valid − start; a tree's last accepted node, `row`)."""
        start = self.start.pop(seq.seq_id, None)
        h = self.hidden.get(seq.seq_id)
        if start is not None and h is not None:
            self.verified[seq.seq_id] = (h, num_valid - start if row is None else row)

    def keep_hidden(self, seqs, num_new: list[int], num_logits: list[int]) -> None:
        """After each target forward: each row's hidden states where its logits are [m, C]."""
        for i, (seq, m) in enumerate(zip(seqs, num_logits)):
            self.hidden[seq.seq_id] = self.runner.model.last_hidden[i, :m]

    def free(self, seq) -> None:
        self.hidden.pop(seq.seq_id, None)
        self.start.pop(seq.seq_id, None)
        self.verified.pop(seq.seq_id, None)
