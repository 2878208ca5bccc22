"""Evaluate the shipped `demo-sinks` model and write its model card.

    python benchmarks/demo_sinks_model.py [--data PATH/TO/tinyshakespeare/input.txt]

`demo-sinks` (nanoserve/assets/demo-sinks) is the Llama that notebook 20 evicts from: every one
of its training windows started with BOS. Its validation loss is measured the way it was trained:
the held-out last 10 % of tinyshakespeare cut into windows of 256 bytes, each read as BOS then its
first 255 bytes, every byte scored once. Its attention sinks are measured as
benchmarks/bench_kv_eviction.py measures them (`sink_shares`). Writes `card.json` (the numbers
tests check) and `README.md` beside the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.models.loader import ASSETS, load_model
from nanoserve.tools.train import BOS, bos_first_inputs, load_bytes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_kv_eviction import per_layer, sink_shares  # noqa: E402

DEFAULT_DATA = HERE.parent.parent / "shared" / "corpora" / "tinyshakespeare" / "input.txt"
NAME = "demo-sinks"
SINK_WINDOWS = 24  # held-out windows the sink shares average over


def bos_windows(data: Path, T: int) -> torch.Tensor:
    """The held-out bytes cut into [N, T] windows (the tail that does not fill one is dropped)."""
    val = load_bytes(data)[1]
    n = len(val) // T
    return val[:n * T].view(n, T)


def validation_loss(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean nats per byte: each window's bytes predicted from BOS and the bytes before them."""
    total, count = 0.0, 0
    T = windows.shape[1]
    positions = torch.arange(T)[None]
    for start in range(0, len(windows), batch_size):
        y = windows[start:start + batch_size]
        with torch.no_grad():
            logits = model(bos_first_inputs(y, BOS), positions.expand(len(y), T)).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def card_markdown(cfg, card: dict, log: dict) -> str:
    """The model card: a table of what it is and how it was made, then its sinks."""
    T, tc = cfg.max_position_embeddings, log["train_config"]
    rows = [
        ("architecture", f"llama, {cfg.n_layers} layers, {cfg.hidden_size} wide, "
                         f"{cfg.n_heads} heads, context {T}"),
        ("parameters", f"{card['parameters']:,} (stored in {tc['save_dtype']})"),
        ("vocabulary", "bytes (256) + `<|endoftext|>` (the EOS and the BOS: a text prompt "
                       "starts with it)"),
        ("data", "tinyshakespeare `input.txt` (public domain), first 90 % of bytes train, "
                 "last 10 % validation"),
        ("validation loss", f"**{card['val_loss_nats_per_byte']:.4f} nats/byte** "
                            f"({card['val_bits_per_byte']:.3f} bits/byte), windows of BOS + "
                            f"{T - 1} bytes, {card['val_tokens']:,} bytes"),
        ("training", f"{tc['steps']} steps × {tc['batch_size']} × {tc['block_size']} tokens "
                     f"(BOS first), AdamW, lr {tc['lr']} cosine → {tc['min_lr']}, weight decay "
                     f"{tc['weight_decay']}, seed {tc['seed']}"),
        ("training time", f"{log['train_time_s'] / 60:.1f} min on {log.get('device', 'CPU')}"),
        ("reproduce", "`python -m nanoserve.tools.train --preset demo-sinks --data "
                      "PATH/TO/tinyshakespeare/input.txt`"),
    ]
    lines = [f"# {NAME}", "",
             "A byte-level Llama whose every training window started with BOS, trained so that "
             "its attention", "has sinks: notebook 20 evicts from it (StreamingLLM against "
             "truncation).", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    lines += ["", "Attention on the first key (BOS) from the queries at positions ≥ 32, averaged "
              f"over {card['sink_windows']}", "held-out windows, per layer (the most over a "
              "layer's heads / the mean):", per_layer(card["first_key_share"]), "",
              f"Evaluated on {card['evaluated']} with `python benchmarks/demo_sinks_model.py`.",
              ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, cfg, _ = load_model(NAME, dtype="float32", device="cpu")
    T = cfg.max_position_embeddings
    windows = bos_windows(Path(args.data), T)
    val = validation_loss(model, windows)
    shares = sink_shares(model, list(bos_first_inputs(windows[:SINK_WINDOWS], BOS)))
    log = json.loads((ASSETS / NAME / "train_log.json").read_text())
    card = {"val_loss_nats_per_byte": val, "val_bits_per_byte": val / math.log(2),
            "val_tokens": windows.numel(), "parameters": cfg.num_parameters(),
            "first_key_share": shares, "sink_windows": SINK_WINDOWS,
            "train_time_s": log["train_time_s"], "train_device": log.get("device", "CPU"),
            "evaluated": date.today().isoformat()}
    (ASSETS / NAME / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (ASSETS / NAME / "README.md").write_text(card_markdown(cfg, card, log))
    print(f"{NAME}: {card['parameters']:,} params, val {val:.4f} nats/byte")
    print("first-key share per layer (most / mean over heads):", per_layer(shares))


if __name__ == "__main__":
    main()
