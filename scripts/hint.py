"""Print one level of the hints of an exercise: `make hint EX=ex04 N=2`.

    python scripts/hint.py ex04        # level 1 of every part: the idea
    python scripts/hint.py ex04 2      # level 2: the shape of the code
    python scripts/hint.py ex04 3 4.2  # level 3 (nearly the code) of part 4.2 only

The hints are exercises/hints/exNN.md: per part (a "## N.M" heading), three numbered levels. A
level is shown alone, so reading the shape does not also show you the code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HINTS = Path(__file__).resolve().parents[1] / "exercises" / "hints"
PART = re.compile(r"^## (\d+\.\d+)(.*)$", re.M)
LEVEL = re.compile(r"^(\d)\. ", re.M)
LEVELS = 3


def parse(text: str) -> dict[str, tuple[str, list[str]]]:
    """{"4.1": (title, [level 1, level 2, level 3])} from a hints file's text."""
    parts = {}
    matches = list(PART.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end():end]
        starts = list(LEVEL.finditer(body))
        levels = []
        for j, start in enumerate(starts):
            stop = starts[j + 1].start() if j + 1 < len(starts) else len(body)
            levels.append(" ".join(body[start.end():stop].split()))
        parts[match.group(1)] = (match.group(2).strip(), levels)
    return parts


def main(argv: list[str]) -> None:
    if not argv or not re.fullmatch(r"ex\d\d", argv[0]):
        raise SystemExit("usage: make hint EX=ex04 [N=1|2|3] [PART=4.2]")
    path = HINTS / f"{argv[0]}.md"
    if not path.is_file():
        raise SystemExit(f"{argv[0]}: no such exercise (exercises/hints/ has ex01.md .. ex24.md)")
    level = int(argv[1]) if len(argv) > 1 and argv[1] else 1
    if not 1 <= level <= LEVELS:
        raise SystemExit(f"N={level}: there are {LEVELS} levels (1 the idea, 2 the shape, 3 nearly "
                         "the code)")
    only = argv[2] if len(argv) > 2 and argv[2] else None
    names = {1: "the idea", 2: "the shape of the code", 3: "nearly the code"}
    for part, (title, levels) in parse(path.read_text()).items():
        if only and part != only:
            continue
        print(f"Exercise {part} {title} — hint {level} of {LEVELS}, {names[level]}:")
        print(f"  {levels[level - 1]}\n")
    if level < LEVELS:
        print(f"Still stuck? make hint EX={argv[0]} N={level + 1}")


if __name__ == "__main__":
    main(sys.argv[1:])
