"""Hints that teach: the first thing a learner reads about a part — its stub's NotImplementedError
message — is the idea, never the code; exercises/hints/exNN.md then gives three levels per part
(the idea, the shape of the code, nearly the code), one at a time (`make hint EX=ex04 N=2`,
scripts/hint.py).

Every exercise has its hints file.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = ROOT / "exercises"
sys.path.insert(0, str(ROOT / "scripts"))
from hint import LEVELS, parse  # noqa: E402

# code in a sentence: an assignment, a comprehension, a call with arguments, a subscript
CODE = re.compile(r"\b\w+(\[[^\]]*\])? = |\bfor \w+ in\b|\[[^\]]* for |\w\([\w.]+[,)]|\w\[\w")


def _stub_messages() -> dict[str, list[str]]:
    """{"4.1": its messages} of every NotImplementedError in exercises/*.py (a part may be raised
    in two places: a class's constructor and its forward)."""
    found = {}
    for path in sorted(EXERCISES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", "") == "NotImplementedError"):
                message = ast.literal_eval(node.exc.args[0])
                for part in re.findall(r"(?:Exercise |; )(\d+\.\d+):", message):
                    found.setdefault(part, []).append(message)
    return found


STUBS = _stub_messages()
HINTED = sorted(path.stem for path in (EXERCISES / "hints").glob("ex*.md"))


def hint_problems(exercise: str, text: str, stubs: dict[str, list[str]]) -> list[str]:
    """What keeps an exercise's hints (file text) and stub messages from teaching in steps."""
    number = str(int(exercise[2:]))
    parts = parse(text)
    wanted = sorted(p for p in stubs if p.split(".")[0] == number)
    problems = [f"no hints for {p}" for p in wanted if p not in parts]
    for part, (_, levels) in parts.items():
        if len(levels) != LEVELS or not all(levels):
            problems.append(f"{part}: {len(levels)} levels, {LEVELS} wanted")
            continue
        if CODE.search(levels[0]):
            problems.append(f"{part}: level 1 (the idea) holds code: {CODE.search(levels[0])[0]!r}")
        if len(set(levels)) != LEVELS:
            problems.append(f"{part}: two levels say the same")
    for part in wanted:
        for message in stubs[part]:
            code = CODE.search(message)
            if code:
                problems.append(f"{part}: the stub's message holds code: {code[0]!r}")
            if f"make hint EX={exercise}" not in message:
                problems.append(f"{part}: the stub's message does not say "
                                f"`make hint EX={exercise}`")
    return problems


def test_every_exercise_has_its_hints():
    assert HINTED == [f"ex{n:02d}" for n in range(1, 25)]


@pytest.mark.parametrize("exercise", HINTED)
def test_hints_go_from_the_idea_to_nearly_the_code(exercise):
    text = (EXERCISES / "hints" / f"{exercise}.md").read_text()
    assert hint_problems(exercise, text, STUBS) == []


def test_negative_controls_code_in_the_first_words_is_caught():
    """The stub message of 4.1 as it was (the solution in the first thing a learner reads), and a
    hints file whose first level is code or that lacks a level."""
    old_stub = ("Exercise 4.1: RuntimeError if seq already has blocks; hits, needed, available = "
                "self._plan(seq); block_table = hits + [self._take_free_block() for each needed] "
                "(roughly 12 lines; see notebooks/02_paged_kv_cache, section 2)")
    stubs = {**STUBS, "4.1": [old_stub]}
    text = (EXERCISES / "hints" / "ex04.md").read_text()
    assert hint_problems("ex04", text, stubs)[:2] == [
        "4.1: the stub's message holds code: 'available = '",
        "4.1: the stub's message does not say `make hint EX=ex04`"]
    coded = text.replace("1. A new sequence's table", "1. `seq.block_table = hits` — a table", 1)
    assert hint_problems("ex04", coded, STUBS) == [
        "4.1: level 1 (the idea) holds code: 'block_table = '"]
    two_levels = re.sub(r"\n3\. `hits, needed.*?\n\n", "\n\n", text, count=1, flags=re.S)
    assert hint_problems("ex04", two_levels, STUBS) == ["4.1: 2 levels, 3 wanted"]


def test_make_hint_shows_one_level_at_a_time():
    def hint(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "hint.py"), *args],
                              capture_output=True, text=True)
    idea, shape = hint("ex04", "1").stdout, hint("ex04", "2", "4.2").stdout
    assert "hint 1 of 3, the idea" in idea and "_take_free_block" not in idea
    assert idea.count("Exercise 4.") == 4 and "make hint EX=ex04 N=2" in idea
    assert shape.count("Exercise 4.") == 1 and "len(seq) − 1" in shape
    assert "nearly the code" in hint("ex04", "3").stdout
    assert "there are 3 levels" in hint("ex04", "4").stderr
    assert "no such exercise" in hint("ex99").stderr
