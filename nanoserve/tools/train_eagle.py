"""Train EAGLE's draft head on a frozen model by self-distillation (spec/eagle.py).

    python -m nanoserve.tools.train_eagle --model demo --out DIR [--steps 400]

The data is the model's own text, as for Medusa (train_medusa.self_distill_data). The model runs
once over it without a cache and its features f_t (the LM head's input) are kept. The head reads
(f_t, embedding of token t + 1) at each position — all positions at once, causally, as the head's
attention runs while drafting — and is trained to give f_{t+1}: smooth L1 against the feature, plus
0.1 × the cross-entropy of the LM head's distribution at the prediction against the model's own
distribution there (EAGLE's two losses and weight). Uniform noise U(−0.1, 0.1)·std is added to the
input features (EAGLE's: drafting feeds the head its own, imperfect predictions). AdamW, a fixed
seed; ~1 minute for the demo's defaults on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ..spec.eagle import EagleHead, save_eagle, token_embedding
from .train_medusa import hidden_states, self_distill_data


def eagle_losses(head: EagleHead, model, feats: torch.Tensor, ids: torch.Tensor, noise: float = 0.0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature loss, token loss) of the head on feats [N, T, C] (the model's) and ids [N, T]."""
    T = ids.shape[1]
    inputs = feats[:, :-1]  # f_0 .. f_{T−2}
    if noise:
        scale = noise * feats.std()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) * 2 - 1) * scale
    with torch.no_grad():
        embeds = token_embedding(model)(ids[:, 1:]).float()  # tokens 1 .. T − 1
        # the model's law of tokens 2 .. T
        want = F.softmax(model.lm_logits(feats[:, 1:]).float(), -1)
    pred, _ = head(inputs, embeds, torch.arange(T - 1))  # f̂_1 .. f̂_{T−1}
    feature_loss = F.smooth_l1_loss(pred, feats[:, 1:])
    token_loss = -(want * F.log_softmax(model.lm_logits(pred).float(), -1)).sum(-1).mean()
    return feature_loss, token_loss


def init_head(model, num_heads: int | None = None, intermediate: int | None = None) -> EagleHead:
    cfg = model.config
    return EagleHead(cfg.hidden_size, num_heads or cfg.n_heads, intermediate or 2 * cfg.hidden_size,
                     cfg.vocab_size)


def train_eagle(model, ids: torch.Tensor, steps: int = 400, lr: float = 1e-3, batch_size: int = 16,
                seed: int = 0,
                log=None) -> EagleHead:
    """A head trained on `ids` [N, T] (the model's own samples); the model itself is not changed."""
    torch.manual_seed(seed)
    feats = hidden_states(model, ids)
    head = init_head(model)
    # (no gradient for the model; given back after)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch_size,), generator=g)
        feature_loss, token_loss = eagle_losses(head, model, feats[pick], ids[pick], noise=0.1,
                                                generator=g)
        loss = feature_loss + 0.1 * token_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step}: feature loss {feature_loss.item():.4f}, token loss "
                f"{token_loss.item():.3f}")
    for p in frozen:
        p.requires_grad_(True)
    return head.eval()


@torch.no_grad()
def eagle_accuracy(head: EagleHead, model, ids: torch.Tensor) -> float:
    """How often the head's top token at f̂_{t+1} is the model's own top token there
    (teacher-forced)."""
    feats = hidden_states(model, ids)
    embeds = token_embedding(model)(ids[:, 1:]).float()
    pred, _ = head(feats[:, :-1], embeds, torch.arange(ids.shape[1] - 1))
    return (
        (model.lm_logits(pred).argmax(-1) == model.lm_logits(feats[:, 1:]).argmax(-1)) .float()
        .mean() .item()
    )


def main() -> None:
    from ..engine.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqs", type=int, default=256, help="self-generated sequences to train on")
    ap.add_argument("--length", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32", device="cpu")
    ids = self_distill_data(llm, args.seqs + 32, args.length, args.seed)
    train, held_out = ids[: args.seqs], ids[args.seqs:]
    head = train_eagle(llm.model, train, args.steps, seed=args.seed, log=print)
    before = eagle_accuracy(init_head(llm.model), llm.model, held_out)
    after = eagle_accuracy(head, llm.model, held_out)
    save_eagle(head, args.out, args.model)
    print(f"held-out agreement with the model's top token: untrained {before:.3f}, trained "
          f"{after:.3f}; {time.perf_counter() - t0:.1f} s; saved {args.out}")


if __name__ == "__main__":
    main()
