"""The rules of docs/STYLE.md that a parser can check, held on the core (scripts/core_size.py's
CORE): lines of at most 100 characters, no assignment expression inside a call, no conditional
expression inside a comprehension. Outside the core, ruff holds the line length, with a ledger of
files still to rewrap in pyproject.toml; the ledger may only shrink, so a file that is rewrapped
must leave it.

Each check runs on the real files and on a snippet that breaks its rule (the negative control).
"""

from __future__ import annotations

import ast
import unicodedata
from pathlib import Path

import pytest
from test_layering import core_size  # scripts/core_size.py, loaded by path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 100


def core_files() -> list[Path]:
    return [core_size.module_path(module) for module, _ in core_size.CORE]


def width(line: str) -> int:
    """Columns a line takes, as ruff counts them: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


def long_lines(source: str) -> list[int]:
    """1-based numbers of the lines wider than LIMIT columns."""
    lines = source.split("\n")
    return [i + 1 for i, line in enumerate(lines) if width(line) > LIMIT]


def walrus_in_calls(tree: ast.AST) -> list[int]:
    """Lines where an assignment expression is an argument of a call."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        arguments = [*node.args, *(k.value for k in node.keywords)]
        found += [a.lineno for a in arguments if isinstance(a, ast.NamedExpr)]
    return found


COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def conditionals_in_comprehensions(tree: ast.AST) -> list[int]:
    """Lines where a conditional expression (`a if c else b`) sits inside a comprehension."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, COMPREHENSIONS):
            found += [sub.lineno for sub in ast.walk(node) if isinstance(sub, ast.IfExp)]
    return found


def test_the_core_list_names_real_files():
    files = core_files()
    assert len(files) >= 20
    assert all(path is not None and path.is_file() for path in files)


@pytest.mark.parametrize("check", [walrus_in_calls, conditionals_in_comprehensions])
def test_core_has_no_dense_lines(check):
    found = {}
    for path in core_files():
        lines = check(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"{check.__doc__.strip()} {found}"


def test_core_lines_fit_100_characters():
    found = {}
    for path in core_files():
        lines = long_lines(path.read_text())
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"lines over {LIMIT} characters: {found}"


def test_the_checks_see_what_they_forbid():
    """Negative control: a snippet breaking each rule is caught, on the line that breaks it."""
    snippet = "x = 1\nf(y := g())\nrows = [a if a else b for a in c]\n" + "z = 0  #" + "." * 100
    tree = ast.parse(snippet)
    assert walrus_in_calls(tree) == [2]
    assert conditionals_in_comprehensions(tree) == [3]
    assert long_lines(snippet) == [4]
    plain = "y = g()\nf(y)\nrows = [pick(a, b) for a in c]\n"
    assert walrus_in_calls(ast.parse(plain)) == []
    assert conditionals_in_comprehensions(ast.parse(plain)) == []


def _ruff_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]


def test_line_length_ledger_only_lists_files_still_over():
    """pyproject.toml exempts from ruff's E501 only files that still hold a long line, and no core
    file: rewrapping a file means taking it off the ledger, so the list can only shrink."""
    ruff = _ruff_config()
    assert ruff["line-length"] == LIMIT
    core = {str(path.relative_to(ROOT)) for path in core_files()}
    ledger = ruff["lint"].get("per-file-ignores", {})
    stale, listed_core = [], []
    for name, rules in ledger.items():
        if "E501" not in rules:
            continue
        if name in core:
            listed_core.append(name)
        elif not long_lines((ROOT / name).read_text()):
            stale.append(name)
    assert not listed_core, f"core files may not be exempt from the line length: {listed_core}"
    assert not stale, f"these files fit {LIMIT} columns now; delete them from the ledger: {stale}"
