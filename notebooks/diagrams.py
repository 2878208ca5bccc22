"""Concept diagrams for the notebooks, drawn with matplotlib from the notebook's own objects, so
they are regenerated with every run: `from diagrams import block_table_diagram`.

Each function draws one picture and returns its figure; none computes anything the notebook does
not already show in numbers.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

COLOURS = plt.get_cmap("tab10").colors


def _box(ax, x, y, w, h, text, colour="white", size=9, edge="black"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor=edge, lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _arrow(ax, start, end, colour="black", rad=0.0, style="-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=colour,
                                 lw=1, connectionstyle=f"arc3,rad={rad}"))


def _canvas(width, height, size):
    fig, ax = plt.subplots(figsize=size)
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def block_table_diagram(block_table, num_tokens, block_size, num_blocks):
    """A sequence's tokens in logical blocks (top), its block table (middle) and the pool's
    physical blocks with their slot numbers (bottom); arrows follow the table."""
    width = max(len(block_table), num_blocks) * (block_size + 1) + 1
    fig, ax = _canvas(width, 7.2, (11, 3.6))
    ax.text(0, 6.6, "sequence: token i in logical block i // bs, offset i % bs", fontsize=9)
    for j, physical in enumerate(block_table):
        x0 = 1 + j * (block_size + 1)
        for offset in range(block_size):
            i = j * block_size + offset
            colour = COLOURS[j % 10] if i < num_tokens else "white"
            _box(ax, x0 + offset, 5.2, 1, 1, str(i) if i < num_tokens else "", colour, 8)
        _box(ax, x0, 3.4, block_size, 0.8, f"block_table[{j}] = {physical}", "0.93", 8)
        _arrow(ax, (x0 + block_size / 2, 5.2), (x0 + block_size / 2, 4.2))
        px = 1 + physical * (block_size + 1) + block_size / 2
        _arrow(ax, (x0 + block_size / 2, 3.4), (px, 1.9), COLOURS[j % 10], rad=0.15)
    ax.text(0, 2.35, "pool: physical block b holds slots b·bs .. b·bs + bs − 1", fontsize=9)
    owner = {physical: j for j, physical in enumerate(block_table)}
    for b in range(num_blocks):
        x0 = 1 + b * (block_size + 1)
        for offset in range(block_size):
            colour = "white"
            if b in owner and owner[b] * block_size + offset < num_tokens:
                colour = COLOURS[owner[b] % 10]
            _box(ax, x0 + offset, 0.6, 1, 1, str(b * block_size + offset), colour, 7)
        ax.text(x0 + block_size / 2, 0.1, f"block {b}", ha="center", fontsize=8)
    fig.tight_layout()
    return fig


def step_diagram():
    """One engine step, from a request to its tokens: the loop LLMEngine.step() runs."""
    fig, ax = _canvas(15, 5, (11, 3.6))
    stages = [
        (0.2, 3.4, "add_request\nprompt → token ids\n(validated once)"),
        (3.2, 3.4, "waiting queue\n(priority, arrival)"),
        (6.2, 3.4, "Scheduler.schedule()\nwho runs, how many tokens\n(budget, blocks, preempt)"),
        (9.7, 3.4, "BlockAllocator\nallocate / append_slot\n→ block tables, slots"),
        (9.7, 0.6, "ModelRunner.run\nforwards: decodes together,\nprefills by length"),
        (6.2, 0.6, "sampler\nlogits → one token for\neach row at its last token"),
        (3.2, 0.6, "Scheduler.postprocess\nappend the token, stop?\nfree the blocks if done"),
        (0.2, 0.6, "outputs\ntext deltas, logprobs,\nfinish reason"),
    ]
    for x, y, text in stages:
        _box(ax, x, y, 2.8 if x < 6 else 3.2, 1.3, text, "0.95", 8)
    for start, end in [((3.0, 4.05), (3.2, 4.05)), ((6.0, 4.05), (6.2, 4.05)),
                       ((9.4, 4.05), (9.7, 4.05)), ((11.3, 3.4), (11.3, 1.9)),
                       ((9.7, 1.25), (9.4, 1.25)), ((6.2, 1.25), (6.0, 1.25)),
                       ((3.2, 1.25), (3.0, 1.25))]:
        _arrow(ax, start, end)
    _arrow(ax, (4.6, 1.9), (7.8, 3.4), "tab:blue", rad=-0.25)
    ax.text(5.1, 2.45, "next step: unfinished rows\nrun again; preempted ones wait",
            fontsize=8, color="tab:blue")
    ax.set_title("one step of LLMEngine.step(): schedule → forward → sample → update", fontsize=10)
    fig.tight_layout()
    return fig


def speculative_step_diagram(prompt_len, drafts, accepted, gamma):
    """A speculative step at the token level: γ draft tokens, the target's verdict on each, the
    token the target adds, and where both caches stand after the rollback."""
    width = prompt_len + gamma + 3
    fig, ax = _canvas(width, 6.4, (11, 3.4))
    for i in range(prompt_len):
        _box(ax, i, 4.4, 1, 0.9, f"t{i}", "0.9", 8)
    for j, token in enumerate(drafts):
        ok = j < accepted
        colour = "#b6e3b6" if ok else ("#f4b6b6" if j == accepted else "white")
        _box(ax, prompt_len + j, 4.4, 1, 0.9, f"d{j + 1}\n{token}", colour, 7)
        mark = "accept" if ok else ("reject" if j == accepted else "dropped")
        ax.text(prompt_len + j + 0.5, 3.9, mark, ha="center", fontsize=7)
    ax.text(0, 5.6, f"the draft proposes γ = {gamma} tokens after the {prompt_len} it has; the "
            "target scores all γ + 1 positions in one forward", fontsize=9)
    new = prompt_len + accepted
    _box(ax, new, 2.3, 1, 0.9, "new", "#ffe08a", 8)
    ax.text(new + 1.2, 2.6, "the target's token: resampled at the rejection\n(a bonus token when "
            "all γ pass); its K and V come next step", fontsize=8)
    kept = prompt_len + accepted
    for y, name in ((1.2, "target KV"), (0.2, "draft KV")):
        _box(ax, 0, y, kept, 0.7, f"{name}: {kept} tokens kept", "0.95", 8)
        if kept < prompt_len + gamma:
            _box(ax, kept, y, prompt_len + gamma - kept, 0.7, "rolled back", "white", 7,
                 edge="0.6")
    fig.tight_layout()
    return fig


def tensor_parallel_diagram(ranks=2):
    """An MLP over `ranks` processes: the first linear split by columns (each rank a slice of the
    hidden units), the second by rows (each rank a partial sum), one all-reduce at the end."""
    fig, ax = _canvas(16, 1.6 + 2.2 * ranks, (11, 1.2 + 1.3 * ranks))
    top = 0.6 + 2.2 * ranks
    _box(ax, 0.2, top / 2 - 0.6, 2, 1.2, "x  [T, C]\n(every rank)", "0.95", 8)
    for r in range(ranks):
        y = top - 2.2 * (r + 1)
        colour = COLOURS[r]
        first = f"W₁: rank {r}'s slice\nof the columns\n(column-parallel)"
        second = f"W₂: rank {r}'s rows\na partial sum\n(row-parallel)"
        _box(ax, 3.2, y, 3, 1.4, first, colour, 8)
        _box(ax, 7.0, y, 2.4, 1.4, f"h, rank {r}\n[T, 4C/{ranks}]\nactivation local", "white", 8)
        _box(ax, 10.2, y, 2.6, 1.4, second, colour, 8)
        _arrow(ax, (2.2, top / 2), (3.2, y + 0.7))
        _arrow(ax, (6.2, y + 0.7), (7.0, y + 0.7))
        _arrow(ax, (9.4, y + 0.7), (10.2, y + 0.7))
        _arrow(ax, (12.8, y + 0.7), (13.6, top / 2))
    _box(ax, 13.6, top / 2 - 0.6, 2.2, 1.2, "all-reduce\nΣ partials\n+ bias once", "#ffe08a", 8)
    ax.set_title("a block's MLP split over ranks: no communication until the sum", fontsize=10)
    fig.tight_layout()
    return fig
