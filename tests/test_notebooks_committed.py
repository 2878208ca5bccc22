"""The notebooks are committed executed, top to bottom in one run: strict nbval compares each cell's
stored outputs with a fresh run, so a notebook saved without outputs would pass while testing
nothing (docs/TESTING.md §E)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _problem(nb: dict) -> str | None:
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        return f"execution counts {counts[:8]}... are not 1..{len(code)}: re-run it top to bottom (make notebooks)"
    if sum(bool(c.get("outputs")) for c in code) < len(code) // 2:
        return "most code cells have no stored output"
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    assert len(NOTEBOOKS) == 23
    assert _problem(json.loads(path.read_text())) is None, (
        f"{path.name}: {_problem(json.loads(path.read_text()))}"
    )


def test_a_stripped_notebook_is_caught():
    nb = json.loads(NOTEBOOKS[0].read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["execution_count"], c["outputs"] = None, []
    assert "execution counts" in _problem(nb)


ROOT = Path(__file__).resolve().parents[1]
# a repository path in a notebook's prose: `nanoserve/engine/scheduler.py`, `docs/ARCHITECTURE.md`
PATH = re.compile(r"(?<![\w/.])((?:nanoserve|kernels|exercises|benchmarks|docs|tests|scripts)"
                  r"/[\w/.-]+\.(?:py|md|c|json))")


def _missing_paths(nb: dict) -> list[str]:
    """The repository files a notebook's markdown names that do not exist."""
    missing = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            missing += [p for p in PATH.findall("".join(cell["source"])) if not (ROOT / p).exists()]
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_files_a_notebook_points_at_exist(path):
    """Hand-over cells point at the package's files (docs/ARCHITECTURE.md's reading order): a file
    moved or renamed must take the notebook's prose with it."""
    assert _missing_paths(json.loads(path.read_text())) == []


def test_a_moved_file_is_caught():
    nb = {"cells": [{"cell_type": "markdown",
                     "source": ["the scheduler: `nanoserve/engine/scheduler.py`, the old one: "
                                "`nanoserve/engine/old_scheduler.py`"]}]}
    assert _missing_paths(nb) == ["nanoserve/engine/old_scheduler.py"]


# an absolute path of the machine that ran the notebook: a venv, a home, a checkout
MACHINE_PATH = re.compile(r"(?:/(?:home|root|Users|work|tmp)/[\w.-]+|site-packages)")


def _machine_paths(nb: dict) -> list[str]:
    found = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(
                "".join(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
            found += MACHINE_PATH.findall(text)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_output_shows_the_machine_it_ran_on(path):
    """A learner's outputs would differ from the committed ones only in noise, never in whose disk
    ran them (a library's warning printing its own path, say)."""
    assert _machine_paths(json.loads(path.read_text())) == []


def test_a_warning_with_a_venv_path_is_caught():
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stderr",
                     "text": ["/work/main/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: "
                              "TqdmWarning: IProgress not found\n"]}]}]}
    assert _machine_paths(nb) == ["/work/main", "site-packages"]


def _section_numbers(nb: dict) -> list[int]:
    return [int(m.group(1)) for cell in nb["cells"] if cell["cell_type"] == "markdown"
            for m in re.finditer(r"^## (\d+)\.", "".join(cell["source"]), re.M)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_sections_are_numbered_1_2_3(path):
    numbers = _section_numbers(json.loads(path.read_text()))
    assert numbers == list(range(1, len(numbers) + 1))


HAND_OVER_LINES = 15
# notebooks whose hand-over still runs longer than that: shrink the list, never grow it
LONG_HAND_OVERS: set[str] = set()


def _hand_over_cells(nb: dict) -> list[str] | None:
    """The code cells of the section whose heading names the hand-over (None: no such section)."""
    cells, found = nb["cells"], None
    for index, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and re.search(r"^## .*[Hh]and-over", text, re.M):
            found = []
            for after in cells[index + 1:]:
                source = "".join(after["source"])
                if after["cell_type"] == "markdown" and re.match(r"#{1,2} ", source):
                    break
                if after["cell_type"] == "code":
                    found.append(source)
    return found


def _short_hand_over(cells: list[str]) -> bool:
    """One cell of at most HAND_OVER_LINES lines asserts the equality."""
    return any("assert" in c and len(c.splitlines()) <= HAND_OVER_LINES for c in cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_hand_over_is_a_short_cell_that_asserts(path):
    """Where a notebook hands over in a section of its own, one short cell states the equality
    (its helpers in the cells before it); LONG_HAND_OVERS lists the ones still to be cut."""
    cells = _hand_over_cells(json.loads(path.read_text()))
    if cells is None:
        pytest.skip("this notebook hands over inside its sections, not in one of its own")
    assert _short_hand_over(cells) == (path.stem not in LONG_HAND_OVERS)


def test_a_long_hand_over_is_caught():
    long_cell = "\n".join(["x = 1"] * 20 + ["assert x"])
    nb = {"cells": [{"cell_type": "markdown", "source": ["## 5. Hand-over"]},
                    {"cell_type": "code", "source": [long_cell]},
                    {"cell_type": "markdown", "source": ["## What we built"]}]}
    assert _hand_over_cells(nb) == [long_cell] and not _short_hand_over(_hand_over_cells(nb))
    assert _section_numbers({"cells": [{"cell_type": "markdown",
                                        "source": ["## 1. a\n", "## 3. b"]}]}) == [1, 3]
