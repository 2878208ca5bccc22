"""Evaluate the shipped demo pair and write their model cards.

    python benchmarks/demo_models.py [--data PATH/TO/tinyshakespeare/input.txt]   (default: beside the checkout)

For `demo` and `demo-draft` (nanoserve/assets/): validation loss on the held-out last 10 % of
tinyshakespeare (non-overlapping windows: context 128, stride 127, every byte after the first
scored once; nats/byte = nats/token for a byte-level vocabulary), the draft's acceptance
statistics against the target, then `card.json` (the numbers tests check) and `README.md`
(the card) in each model's directory, and `benchmarks/demo_models.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from nanoserve.models.loader import ASSETS, load_model
from nanoserve.tools.evaluate import acceptance_stats, perplexity
from nanoserve.tools.train import load_bytes

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "corpora" / "tinyshakespeare" / "input.txt"
VAL_CONTEXT, VAL_STRIDE = 128, 127


def val_text(data: Path) -> str:
    return bytes(load_bytes(data)[1].tolist()).decode("utf-8")


def evaluate_pair(data: Path) -> dict:
    text = val_text(data)
    target, tcfg, tok = load_model("demo", dtype="float32", device="cpu")
    draft, dcfg, _ = load_model("demo-draft", dtype="float32", device="cpu")
    out = {}
    for name, model, cfg in (("demo", target, tcfg), ("demo-draft", draft, dcfg)):
        res = perplexity(model, tok, text, context=VAL_CONTEXT, stride=VAL_STRIDE, progress=False)
        out[name] = {"val_loss_nats_per_byte": res.nats_per_byte,
                     "val_bits_per_byte": res.bits_per_byte,
                     "val_tokens": res.n_tokens, "parameters": cfg.num_parameters()}
    out["acceptance"] = acceptance_stats(target, draft, tok.encode(text), context=VAL_CONTEXT,
                                         max_windows=32)
    return out


CARD = """# {name}

{summary}

| | |
|---|---|
| architecture | {arch} |
| parameters | {params:,} |
| vocabulary | bytes (256) + `<|endoftext|>`, a tiktoken encoding (`tokenizer.tiktoken`), also as HF `tokenizer.json` |
| data | tinyshakespeare `input.txt` (public domain), first 90 % of bytes train, last 10 % validation |
| validation loss | **{val:.4f} nats/byte** ({bits:.3f} bits/byte), context 128, stride 127, {ntok:,} bytes |
| training | {steps} steps × {batch} × {block} bytes, AdamW, lr {lr} cosine → {min_lr}, seed {seed} |
| training time | {time_min:.1f} min on {device} |
| reproduce | `{command}` |
{extra}
Evaluated on {date} with `python benchmarks/demo_models.py`.
"""


def write_cards(results: dict) -> None:
    acc = results["acceptance"]
    for name in ("demo", "demo-draft"):
        d = ASSETS / name
        log = json.loads((d / "train_log.json").read_text())
        tc = log["train_config"]
        # the shipped config (context trimmed to the trained length)
        mc = load_model(name)[1].to_dict()
        r = results[name]
        card = {**r, "train_time_s": log["train_time_s"], "train_device": log.get("device", "CPU"),
                "evaluated": date.today().isoformat()}
        extra = ""
        if name == "demo-draft":
            card["acceptance"] = acc
            a1, a0 = acc["alpha"]["1.0"], acc["alpha"]["0"]
            rows = " | ".join(
                f"{acc['expected_tokens_per_step']['1.0'][g]:.2f}" for g in range(1, 9)
            )
            rows0 = " | ".join(
                f"{acc['expected_tokens_per_step']['0'][g]:.2f}" for g in range(1, 9)
            )
            extra = ("\nDistilled from `demo` (loss = KL(target ‖ draft), α-weight "
                     f"{tc['distill_alpha']}).\nAcceptance against `demo` over "
                     f"{acc['positions']:,} held-out positions: α = {a1:.3f} at temperature 1 (E[Σ "
                     f"min(p, q)]), {a0:.3f} at temperature 0 (argmax agreement). Expected tokens "
                     "per target call, (1 − α^(γ+1)) / (1 − α):\n\n| γ | 1 | 2 | 3 | 4 | 5 | 6 | "
                     f"7 | 8 |\n|---|---|---|---|---|---|---|---|---|\n| T = 1 | {rows} |\n| T = 0 "
                     f"| {rows0} |\n")
        command = ("python -m nanoserve.tools.train --preset demo --data "
                   "PATH/TO/tinyshakespeare/input.txt"
                   if name == "demo" else
                   "python -m nanoserve.tools.train --preset demo-draft --teacher demo "
                   "--data PATH/TO/tinyshakespeare/input.txt")
        summary = ("The shipped default model of nanoserve: a small GPT-2 trained on Shakespeare, "
                   "bytes in, bytes out."
                   if name == "demo" else
                   "A Llama-architecture draft for speculative decoding, distilled from `demo`.")
        (d / "card.json").write_text(json.dumps(card, indent=2) + "\n")
        (d / "README.md").write_text(CARD.format(
            name=name, summary=summary,
            arch=f"{mc['arch']}, {mc['n_layers']} layers, {mc['hidden_size']} wide, "
                 f"{mc['n_heads']} heads ({mc['n_kv_heads']} kv heads), context "
                 f"{mc['max_position_embeddings']}",
            params=r["parameters"], val=r["val_loss_nats_per_byte"], bits=r["val_bits_per_byte"],
            ntok=r["val_tokens"], steps=tc["steps"], batch=tc["batch_size"], block=tc["block_size"],
            lr=tc["lr"],
            min_lr=tc["min_lr"], seed=tc["seed"], time_min=log["train_time_s"] / 60,
            device=log.get("device", "CPU"), command=command, extra=extra,
            date=date.today().isoformat()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = evaluate_pair(Path(args.data))
    results.update(date=date.today().isoformat(), device=f"CPU ({platform.machine()}), 2 threads",
                   torch=torch.__version__)
    (HERE / "demo_models.json").write_text(json.dumps(results, indent=2) + "\n")
    write_cards(results)
    for name in ("demo", "demo-draft"):
        r = results[name]
        print(f"{name:<11} {r['parameters']:>10,} params   val {r['val_loss_nats_per_byte']:.4f} "
              "nats/byte")
    acc = results["acceptance"]
    print(f"draft acceptance: alpha(T=1) = {acc['alpha']['1.0']:.3f}, alpha(T=0) = "
          f"{acc['alpha']['0']:.3f}")


if __name__ == "__main__":
    main()
