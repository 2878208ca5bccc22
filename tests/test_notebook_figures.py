"""A figure in a notebook's prose comes from that notebook's own outputs (issue 45, item 1).

A *measured figure* is a number or a range followed by a unit of time, rate, speed-up or share
(`0.43 s`, `1.47 ms`, `2.88–4.80 ms`, `1,500 tokens/s`, `1.94×`, `38.2 %`). Each one in a
markdown cell must be *supported*, one of:

1. some number printed by a code cell of the same notebook (stream, text, markdown or HTML output)
   rounds to it at the precision the prose states (`0.43 s` is supported by `0.4312`, not by
   `0.47`); a range needs both ends; the unit is not compared (an output in seconds may back a
   figure in milliseconds only if the notebook prints the milliseconds);
2. the cell names `benchmarks/RESULTS.md` and the figure is written there as it is in the prose
   (a measurement recorded with its device, date and command);
3. it is a fact from outside the notebook — a datasheet, a paper, arithmetic on the page — listed
   in CITED below with where it comes from.

Times change from run to run and nbval hides them (notebooks/sanitize.cfg), so a sentence that
wants a notebook's own timings writes them from the cell (`display(Markdown(...))`) or quotes the
committed output; this test reads the committed notebook, outputs and prose together.
Negative controls: a figure edited away from its output, and a notebook whose outputs are
stripped, are both caught.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = r"ms|µs|us|s|×|x|%|tok/s|tokens/s|requests/s|req/s|TB/s|GB/s|TFLOP/s|Tflop/s"
# a number, or a range "a–b" / "a-b", then a unit that ends the word
FIGURE = re.compile(rf"(?<![\w.,])({NUMBER})(?:\s*[–-]\s*({NUMBER}))?\s?({UNIT})(?![\w/])")
OUTPUT_NUMBER = re.compile(rf"(?<![\w.])-?(?:{NUMBER})(?:e[-+]?\d+)?")

# Facts from outside the notebook, by notebook: the figure as the prose writes it, and its source.
H100 = "the H100 SXM's datasheet"
PAGED_ATTENTION = "the PagedAttention paper (Kwon et al. 2023)"
CITED: dict[str, dict[str, str]] = {
    "02": {"20.4–38.2 %": PAGED_ATTENTION, "20–38 %": PAGED_ATTENTION + ", rounded"},
    "03": {"990 TFLOP/s": H100, "3.35 TB/s": H100, "36.9×": "the Orca paper (Yu et al. 2022)",
           "1.25×": "nanoserve/engine/model_runner.py, PREFILL_SLACK"},
    "04": {"3.35 TB/s": H100, "1.2–1.26×": PAGED_ATTENTION + " (its kernel's latency)"},
    "05": {"990 TFLOP/s": H100, "3.35 TB/s": H100, "3.8×": "arithmetic: 16 / 4.16 bits",
           "90 %": "the course's split of tinyshakespeare (nanoserve/assets)"},
    "07": {"989 Tflop/s": H100, "3.35 TB/s": H100},
    "08": {"11×": "arithmetic: the 4.8M-parameter demo over the 0.43M-parameter demo-draft"},
    "12": {"25 %": "arithmetic: a 2-byte scale per 8 values",
           "3.9x": "arithmetic: 4 · 64 / (64 + 2) bytes", "1.94x": "arithmetic: 2 · 64 / (64 + 2)"},
    "14": {"21–33 %": "arithmetic: 2r(in + out) / (2 · in · out) at r = 64 on GPT-2 6 × 384",
           "65 %": "arithmetic: the LM head's 50,257 × 384 of the model's multiply-adds"},
    "16": {"91 %": "arithmetic: 50,257 of the formula's 55,249 values a token"},
}


def _text_of(output: dict) -> str:
    if "text" in output:
        return "".join(output["text"])
    data = output.get("data", {})
    parts = [data.get(kind, "") for kind in ("text/plain", "text/markdown", "text/html")]
    return "".join("".join(p) for p in parts)


def _printed_numbers(nb: dict) -> list[str]:
    """Every number a code cell of `nb` printed, as written."""
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            for output in cell.get("outputs", []):
                found += OUTPUT_NUMBER.findall(_text_of(output))
    return found


def _decimals(written: str) -> int:
    return len(written.split(".")[1]) if "." in written else 0


def _value(written: str) -> float:
    return float(written.replace(",", ""))


def _rounds_to(printed: str, quoted: str) -> bool:
    """`printed` (a number from an output) rounded at `quoted`'s precision equals `quoted`."""
    half_unit = 0.5 * 10 ** -_decimals(quoted)
    return abs(abs(_value(printed)) - _value(quoted)) <= half_unit + 1e-12


def unsupported_figures(nb: dict, name: str, results_md: str) -> list[str]:
    """The measured figures in `nb`'s markdown that no output, RESULTS.md line or citation backs:
    one "cell N: 'figure' in '…context…'" line each."""
    printed = _printed_numbers(nb)
    cited = CITED.get(name, {})
    problems = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        names_results = "benchmarks/RESULTS.md" in source
        for match in FIGURE.finditer(source):
            figure = match.group(0)
            ends = [end for end in match.group(1, 2) if end]
            if figure in cited:
                continue
            if names_results and figure in results_md:
                continue
            if all(any(_rounds_to(p, end) for p in printed) for end in ends):
                continue
            context = source[max(0, match.start() - 40):match.end() + 20].replace("\n", " ")
            problems.append(f"cell {index}: {figure!r} in '…{context}…'")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_figure_in_the_prose_is_an_output_of_its_notebook(path):
    nb = json.loads(path.read_text())
    problems = unsupported_figures(nb, path.stem[:2], RESULTS.read_text())
    assert problems == [], (
        f"{path.name}: figures in the prose that no output of the notebook prints (write them from "
        "the cell, quote the committed output, or cite benchmarks/RESULTS.md):\n"
        + "\n".join(problems))


def _cell(kind: str, text: str, outputs: list | None = None) -> dict:
    cell = {"cell_type": kind, "source": [text]}
    if kind == "code":
        cell["outputs"] = outputs or []
    return cell


def test_a_figure_that_no_output_prints_is_caught():
    printed = [{"output_type": "stream", "name": "stdout",
                "text": ["1 seq: 1.472 ms a step\n", "16 seqs: 2.88 ms\n", "rate 1,512.3\n"]}]
    good = {"cells": [_cell("code", "measure()", printed),
                      _cell("markdown", "A step takes 1.47 ms for one sequence, 1.5–2.9 ms for "
                                        "16; ~1,512 tokens/s.")]}
    assert unsupported_figures(good, "99", "") == []
    stale = {"cells": [good["cells"][0],
                       _cell("markdown", "A step takes ≈ 2 ms for one sequence, 9–11 ms for 16.")]}
    assert [p.split(":")[1].strip().split(" in ")[0] for p in
            unsupported_figures(stale, "99", "")] == ["'2 ms'", "'9–11 ms'"]
    one_end = {"cells": [good["cells"][0], _cell("markdown", "from 1.47 to 4.80 ms: 1.47–4.80 ms")]}
    assert len(unsupported_figures(one_end, "99", "")) == 2  # "4.80 ms" and the range's end


def test_a_stripped_notebook_and_an_uncited_result_are_caught():
    nb, name = json.loads(NOTEBOOKS[3].read_text()), NOTEBOOKS[3].stem[:2]
    figures = [m.group(0) for c in nb["cells"] if c["cell_type"] == "markdown"
               for m in FIGURE.finditer("".join(c["source"]))]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = []
    # only what CITED backs survives the loss of every output (notebook 03 cites no RESULTS.md)
    cited = [f for f in figures if f in CITED[name]]
    assert cited and len(figures) > len(cited)
    assert len(unsupported_figures(nb, name, RESULTS.read_text())) == len(figures) - len(cited)
    quoted = {"cells": [_cell("markdown", "On an H100 it ran at 23 % of HBM peak "
                                          "(`benchmarks/RESULTS.md`).")]}
    assert unsupported_figures(quoted, "99", "batch-1 decode: 23 % of peak") == []
    assert len(unsupported_figures(quoted, "99", "batch-1 decode: 24 % of peak")) == 1
