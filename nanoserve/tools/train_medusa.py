"""Train Medusa heads on a frozen model by self-distillation (spec/medusa.py).

    python -m nanoserve.tools.train_medusa --model demo --out DIR [--heads 3 --steps 400]

The data is the model's own text: sequences it samples (temperature 1, seeded) from short random
prompts, so no dataset is needed and the heads learn what the model says, which is what they must
guess while it decodes (Medusa-2's self-distillation; Cai et al. 2024). The model runs once over all
of it without a cache; its last hidden states h_t (the LM head's input) are kept, and head i
(0-based) is trained by cross-entropy to give token t + 2 + i from h_t, with the model frozen. Each
head starts as the model's own LM head after a residual block whose weight is zero, i.e. (nearly)
guessing token t + 1
again: the untrained baseline the tests compare against. AdamW, a fixed seed; ~25 s for the demo's
defaults on 2 CPU cores (sampling the data included).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ..spec.medusa import MedusaHeads, save_medusa


def self_distill_data(llm, num_seqs: int = 256, length: int = 96, seed: int = 0) -> torch.Tensor:
    """[num_seqs, length] token ids the model sampled itself, each from a 2-token random prompt."""
    from ..engine.sampler import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.inputs.usable_vocab_size
    prompts = torch.randint(0, vocab, (num_seqs, 2), generator=g).tolist()
    params = [SamplingParams(temperature=1.0, max_tokens=length - 2, ignore_eos=True, seed=seed + i)
              for i in range(num_seqs)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])


@torch.no_grad()
def hidden_states(model, ids: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """The LM head's input at every position, [N, T, C], the model run without a cache."""
    out = []
    for chunk in ids.split(batch):
        positions = torch.arange(chunk.shape[1]).expand_as(chunk)
        out.append(model.embed_and_blocks(chunk, positions, None).float())
    return torch.cat(out)


def head_losses(heads: MedusaHeads, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each head against its target: head i at t against ids[t + 2 + i]. [k]"""
    logits = heads(h)  # N, T, k, V
    losses = []
    for i in range(heads.num_heads):
        shift = 2 + i
        losses.append(F.cross_entropy(logits[:, :-shift, i].flatten(0, 1),
                                      ids[:, shift:].flatten()))
    return torch.stack(losses)


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, h: torch.Tensor, ids: torch.Tensor) -> list[float]:
    """Top-1 accuracy of each head on (h, ids): how often its first guess is the token it
    predicts."""
    logits = heads(h)
    return [(logits[:, :-(2 + i), i].argmax(-1) == ids[:, 2 + i:]).float().mean().item()
            for i in range(heads.num_heads)]


def init_heads(model, num_heads: int, num_layers: int = 1) -> MedusaHeads:
    cfg = model.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers)
    lm_head = model.lm_head
    # a quantized LM head (quant/qlinear.py) holds codes: start from the weights they stand for
    start = lm_head.dequantize() if hasattr(lm_head, "dequantize") else lm_head.weight
    with torch.no_grad():
        for head in heads.heads:
            # start from the model's own LM head
            head[-1].weight.copy_(start.float())
    return heads


def train_medusa(model, ids: torch.Tensor, num_heads: int = 3, steps: int = 400, lr: float = 1e-3,
                 batch_size: int = 32, seed: int = 0, log=None) -> MedusaHeads:
    """Heads trained on `ids` [N, T] (the model's own samples); the model itself is not changed."""
    torch.manual_seed(seed)
    h = hidden_states(model, ids)
    heads = init_heads(model, num_heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch_size,), generator=g)
        loss = head_losses(heads, h[pick], ids[pick]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step}: loss {loss.item():.3f}")
    return heads.eval()


def main() -> None:
    from ..engine.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqs", type=int, default=256, help="self-generated sequences to train on")
    ap.add_argument("--length", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32", device="cpu")
    ids = self_distill_data(llm, args.seqs + 32, args.length, args.seed)
    train, held_out = ids[: args.seqs], ids[args.seqs:]
    heads = train_medusa(llm.model, train, args.heads, args.steps, seed=args.seed, log=print)
    h = hidden_states(llm.model, held_out)
    before = head_accuracy(init_heads(llm.model, args.heads), h, held_out)
    after = head_accuracy(heads, h, held_out)
    save_medusa(heads, args.out, args.model)
    print(f"held-out top-1 accuracy per head: untrained {[round(a, 3) for a in before]}, trained "
          f"{[round(a, 3) for a in after]}; {time.perf_counter() - t0:.1f} s; saved {args.out}")


if __name__ == "__main__":
    main()
